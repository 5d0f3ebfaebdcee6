"""NCCL's double binary tree allreduce (Sanders, Speck and Träff, "Two-tree
algorithms for full bandwidth broadcast, reduction and scan", 2009; NCCL 2.4).

A single tree wastes half the links: leaves only send. Two complementary binary
trees fix that: the first is NCCL's binary tree over ranks 0..p-1 (root 0 with
one child, the odd ranks leaves, the even ranks inner nodes); the second is the
first mirrored (rank r plays p-1-r) when p is even, shifted by one (r plays r-1)
when p is odd, so every inner node of the first tree is a leaf of the second
(all but at most one rank, where p makes it impossible). Each tree reduces half
of the buffer to its root and broadcasts it back, both halves in pipeline
segments of ``ctx.seg`` elements, and a root starts broadcasting a segment as
soon as it is reduced, so both phases overlap: a rank receives and sends about
two segments per step, one per tree, and its links stay busy both ways.

Steps: every message has one global time, the same at both ends, and a rank
has one step per time at which it has messages: with k segments per half and
trees of height H ~ log2 p, the last segment reaches the deepest leaf after
about ``k + 2 H`` rounds (a single tree reduce-then-broadcast: ``2 (k + H)``).
Per rank about ``3 k`` steps (a leaf of one tree and inner node of the other).
Against the binomial tree it halves the bytes through the busiest link for large
messages; against the ring it needs log p instead of p rounds of latency: the
choice for large messages on many ranks (what NCCL uses across nodes).

Deadlock-free under NCCL's rules by construction: a rank's step of time T holds
exactly its messages of time T, so steps of equal time match each other on every
rank, and by induction on T every step completes (the checker and the NCCL-rules
simulator confirm it for every shape the tests try).
"""
from __future__ import annotations

import functools

from ringcomm.schedule import (SCRATCH_SLOTS, Builder, Context, Reduce, Region, Schedule, pieces,
                               split_even)



def binary_tree(rank: int, size: int) -> tuple[int | None, list[int]]:
    """Parent and children of ``rank`` in NCCL's binary tree (``ncclGetBtree``):
    root 0 with one child; for any other rank with lowest set bit ``b`` the parent
    is ``(rank ^ b) | 2b`` (or ``rank ^ b`` when that is out of range) and the
    children ``rank - b/2`` and the highest ``rank + b/2**j`` below ``size``."""
    if size == 1:
        return None, []
    bit = 1
    while bit < size and not bit & rank:
        bit <<= 1
    if rank == 0:
        return None, [bit >> 1]
    up = (rank ^ bit) | (bit << 1)
    if up >= size:
        up = rank ^ bit
    low = bit >> 1
    kids = [rank - low] if low else []
    while low and rank + low >= size:
        low >>= 1
    if low:
        kids.append(rank + low)
    return up, kids


def trees(rank: int, size: int) -> list[tuple[int | None, list[int]]]:
    """``rank``'s (parent, children) in both trees (``ncclGetDtree``)."""
    first = binary_tree(rank, size)
    if size % 2:  # shift by one: rank r plays r - 1
        parent, kids = binary_tree((rank - 1) % size, size)
        move = lambda x: (x + 1) % size  # noqa: E731
    else:  # mirror: rank r plays size - 1 - r
        parent, kids = binary_tree(size - 1 - rank, size)
        move = lambda x: size - 1 - x  # noqa: E731
    second = (None if parent is None else move(parent), [move(k) for k in kids])
    return [first, second]


@functools.lru_cache(maxsize=64)
def _shape(t: int, size: int) -> tuple[list, list, list, list]:
    """Tree ``t`` on ``size`` ranks as lists by rank: parent, children, height (0 for
    a leaf) and depth (0 for the root)."""
    parent, kids = zip(*(trees(r, size)[t] for r in range(size)))
    height, depth = [0] * size, [0] * size
    root = parent.index(None)
    order = [root]
    for r in order:  # breadth first: parents before children
        for k in kids[r]:
            depth[k] = depth[r] + 1
            order.append(k)
    for r in reversed(order):
        height[r] = max((height[k] + 1 for k in kids[r]), default=0)
    return list(parent), list(kids), height, depth


# Every message is placed at one global time, the same at both ends, and a rank's
# step for time T holds exactly its messages of time T (both trees, the first
# tree's first). Steps of equal time then match each other on every rank, so the
# schedule cannot deadlock under NCCL's rules (by induction on T), and a pair's
# messages are in the same order at both ends. The times:
#   reduce:    rank x passes segment s up at s + height(x), once every child
#              (height < height(x)) has passed it;
#   broadcast: the root of height H sends segment s at s + H, as soon as it is
#              reduced; a rank at depth d receives it at s + H + d - 1 and forwards
#              it at s + H + d.
# A rank receives its final segment s strictly after it passed its partial sum up
# (height + depth <= H), so reduction and broadcast overlap safely.

def _timed(b: Builder, t: int, me: int, segs: list[Region], at: dict) -> None:
    """Add tree ``t``'s messages and reductions of rank ``me`` to ``at``:
    time -> (sends, recvs, local)."""
    if not segs:
        return
    parent, kids, height, depth = _shape(t, b.ctx.size)

    def step(time: int) -> tuple[list, list, list]:
        return at.setdefault(time, ([], [], []))

    slot = segs[0].n
    for kid in kids[me]:
        space = b.scratch(SCRATCH_SLOTS * slot)
        for s, rg in enumerate(segs):
            into = Region(space, (s % SCRATCH_SLOTS) * slot, rg.n)
            _, recvs, local = step(s + height[kid])
            recvs.append((kid, into))
            local.append(Reduce(rg, into))
    top = parent.index(None)
    for s, rg in enumerate(segs):
        if parent[me] is not None:
            step(s + height[me])[0].append((parent[me], rg))
            step(s + height[top] + depth[me] - 1)[1].append((parent[me], rg))
        for kid in kids[me]:
            step(s + height[top] + depth[me])[0].append((kid, rg))


def allreduce(ctx: Context) -> Schedule:
    """Allreduce buffer 0 in place: half 0 over the first tree, half 1 over the second."""
    b = Builder(ctx)
    p, n = ctx.size, ctx.layout[0]
    if p == 1 or n == 0:
        return b.build()
    at: dict[int, tuple[list, list, list]] = {}
    for t, half in enumerate(split_even(Region(0, 0, n), 2)):
        _timed(b, t, ctx.rank, pieces(half, ctx.seg), at)
    for time in sorted(at):
        b.step(*at[time])
    return b.build()


#: what ``import ringcomm`` registers of this module: (collective, name) -> builder
REGISTERS = {("allreduce", "double_tree"): allreduce}
#: each algorithm's row in docs/architecture.md's generated table: name -> (its
#: steps, where it wins)
ROWS = {
    'double_tree': (
        "NCCL's two complementary binary trees (mirrored for even p, shifted for "
        'odd), each reducing and broadcasting half, pipelined; every message has one '
        'global time, so steps of equal time match everywhere (deadlock-free by '
        'construction); about k + 2 log2 p rounds for k segments',
        'large sizes on many ranks that are not a power of two (48, 96, 256 ranks)'),
}
