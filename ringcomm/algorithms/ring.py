"""Ring schedules: reduce-scatter, allgather, and allreduce as the two in a row.

Every rank sends to its right neighbour and receives from its left one, so
each link carries (p-1)/p of the data once per phase: bandwidth-optimal, with
latency growing with p. Chunks are cut into pipeline segments; step ``(s, k)``
moves segment ``k`` of ring step ``s``. Under NCCL every rank runs step
``(s, k)`` at once; the MPI executor lets a rank send segment ``k`` of step
``s + 1`` as soon as it has reduced it, while later segments are in flight.
"""
from __future__ import annotations

from ringcomm.algorithms.common import SCRATCH_SLOTS, chain, count_pieces, piece, split_even, whole
from ringcomm.algorithms.tree import broadcast_steps
from ringcomm.schedule import Builder, Context, Copy, Reduce, Region, Schedule


def reduce_scatter_steps(b: Builder, chunks: list[Region]) -> None:
    """Ring reduce-scatter over ``chunks`` (one region per rank, same lengths on every
    rank): afterwards ``chunks[rank]`` holds the reduction of every rank's; the other
    chunks hold partial results."""
    ctx = b.ctx
    p, r, seg = ctx.size, ctx.rank, ctx.seg
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    k_max = max(count_pieces(c.n, seg) for c in chunks)
    if k_max == 0:
        return
    slot = min(seg, max(c.n for c in chunks))
    tmp = b.scratch(SCRATCH_SLOTS * slot)
    i = 0
    # Step s sends chunk r-s-1 (its partial sum from step s-1) and receives chunk r-s-2,
    # reducing into it; the last step receives chunk r, which is then complete.
    for s in range(p - 1):
        out, into = chunks[(r - s - 1) % p], chunks[(r - s - 2) % p]
        for k in range(k_max):
            snd, rcv = piece(out, k, seg), piece(into, k, seg)
            sends = [(right, snd)] if snd else []
            recvs, local = [], []
            if rcv:
                space = Region(tmp, (i % SCRATCH_SLOTS) * slot, rcv.n)
                recvs, local = [(left, space)], [Reduce(rcv, space)]
                i += 1
            b.step(sends, recvs, local)


def allgather_steps(b: Builder, chunks: list[Region]) -> None:
    """Ring allgather: ``chunks[rank]`` holds this rank's block; afterwards every
    ``chunks[i]`` holds rank i's block. Chunks may differ in length."""
    ctx = b.ctx
    p, r, seg = ctx.size, ctx.rank, ctx.seg
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    k_max = max(count_pieces(c.n, seg) for c in chunks)
    # Step s sends chunk r-s and receives chunk r-s-1 straight into place.
    for s in range(p - 1):
        out, into = chunks[(r - s) % p], chunks[(r - s - 1) % p]
        for k in range(k_max):
            snd, rcv = piece(out, k, seg), piece(into, k, seg)
            b.step([(right, snd)] if snd else [], [(left, rcv)] if rcv else [])


def allreduce(ctx: Context) -> Schedule:
    """Ring allreduce of buffer 0: reduce-scatter, then allgather, over p chunks."""
    b = Builder(ctx)
    chunks = split_even(whole(0, ctx.layout[0]), ctx.size)
    reduce_scatter_steps(b, chunks)
    allgather_steps(b, chunks)
    return b.build()


def reduce_scatter(ctx: Context) -> Schedule:
    """Ring reduce-scatter of chunks 0..p-1 (overwritten with partial sums) into the
    output buffer p."""
    b = Builder(ctx)
    p, r = ctx.size, ctx.rank
    chunks = [whole(i, n) for i, n in enumerate(ctx.layout)]
    reduce_scatter_steps(b, chunks)
    b.local(Copy(whole(p, ctx.layout[r]), chunks[r]))
    return b.build()


def allgather(ctx: Context) -> Schedule:
    """Ring allgather: the input (buffer p) is copied into chunk ``rank``, then the ring."""
    b = Builder(ctx)
    p, r = ctx.size, ctx.rank
    chunks = [whole(i, n) for i, n in enumerate(ctx.layout)]
    b.local(Copy(chunks[r], whole(p, ctx.layout[r])))
    allgather_steps(b, chunks)
    return b.build()


def broadcast(ctx: Context) -> Schedule:
    """Pipelined broadcast along the ring from the root (a chain): every rank
    receives and forwards each segment once, so large messages move at link bandwidth."""
    b = Builder(ctx)
    broadcast_steps(b, whole(0, ctx.layout[0]), ctx.root, chain)
    return b.build()
