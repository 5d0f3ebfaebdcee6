"""Tree schedules: pipelined reduce and broadcast over a tree, and allreduce as
reduce-to-root followed by broadcast.

Latency grows with the tree depth (log2 p for the binomial tree), so trees
win for small messages; the buffer is cut into segments so large messages
stream through the tree. Step ``g`` of an inner rank receives segment ``g``
from its children (or parent) and passes segment ``g - 1`` on, so the levels
of the tree work on consecutive segments at once, on NCCL as on MPI.
"""
from __future__ import annotations

from typing import Callable

from ringcomm.algorithms.common import SCRATCH_SLOTS, binomial, pieces, whole
from ringcomm.schedule import Builder, Context, Reduce, Region, Schedule

Topology = Callable[[int, int, int], "tuple[int | None, list[int]]"]


def reduce_steps(b: Builder, data: Region, root: int, topology: Topology = binomial) -> None:
    """Reduce ``data`` of every rank into ``data`` on ``root``, segment by segment.
    Other ranks' ``data`` is left holding partial reductions."""
    ctx = b.ctx
    parent, kids = topology(ctx.rank, ctx.size, root)
    segs = pieces(ctx, data)
    if not segs or ctx.size == 1:
        return
    slot = segs[0].n
    spaces = [b.scratch(SCRATCH_SLOTS * slot) for _ in kids]
    last = len(segs) + (1 if parent is not None and kids else 0)
    for g in range(last):
        sends, recvs, local = [], [], []
        if g < len(segs):
            for kid, space in zip(kids, spaces):
                into = Region(space, (g % SCRATCH_SLOTS) * slot, segs[g].n)
                recvs.append((kid, into))
                local.append(Reduce(segs[g], into))
        if parent is not None:
            done = g - 1 if kids else g  # a leaf's segment g is final at once
            if 0 <= done < len(segs):
                sends.append((parent, segs[done]))
        b.step(sends, recvs, local)


def broadcast_steps(b: Builder, data: Region, root: int, topology: Topology = binomial) -> None:
    """Copy ``data`` of ``root`` into ``data`` of every rank, each segment forwarded
    down the tree one step after it arrived."""
    ctx = b.ctx
    parent, kids = topology(ctx.rank, ctx.size, root)
    segs = pieces(ctx, data)
    if not segs or ctx.size == 1:
        return
    last = len(segs) + (1 if parent is not None and kids else 0)
    for g in range(last):
        recvs = [(parent, segs[g])] if parent is not None and g < len(segs) else []
        fwd = g - 1 if parent is not None else g
        sends = [(kid, segs[fwd]) for kid in kids] if 0 <= fwd < len(segs) else []
        b.step(sends, recvs)


def allreduce(ctx: Context) -> Schedule:
    """Binomial-tree allreduce: reduce to rank 0, then broadcast from it."""
    b = Builder(ctx)
    data = whole(0, ctx.layout[0])
    reduce_steps(b, data, 0)
    broadcast_steps(b, data, 0)
    return b.build()


def broadcast(ctx: Context) -> Schedule:
    """Binomial-tree broadcast from the root, pipelined in segments."""
    b = Builder(ctx)
    broadcast_steps(b, whole(0, ctx.layout[0]), ctx.root)
    return b.build()


def reduce(ctx: Context) -> Schedule:
    """Binomial-tree reduce to the root, pipelined in segments."""
    b = Builder(ctx)
    reduce_steps(b, whole(0, ctx.layout[0]), ctx.root)
    return b.build()
