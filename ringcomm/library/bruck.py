"""Bruck's allgather (Bruck, Ho, Kipnis, Upfal and Weathersby, 1997):
ceil(log2 p) steps for any p.

Each rank keeps the blocks it holds in a scratch buffer in *rotated* order, its
own block first: position j holds rank ``(rank + j) % p``'s block. In step k
(distance ``d = 2**k``) it sends its first ``min(d, p - d)`` blocks to rank
``rank - d`` and receives as many from rank ``rank + d``, appending them, so the
number of blocks held doubles each step. At the end a local rotation copies
position j into output chunk ``(rank + j) % p``. Blocks may differ in length
(the layout is per-rank counts): every rank computes the same offsets from the
same counts.

Steps: ceil(log2 p) message steps, plus a copy in and the rotation. Bytes sent
per rank: the (p-1)/p of the output the ring sends too, so it wins when latency
dominates (small messages, many ranks); the price is the scratch copy of the
whole output and the rotation.
"""
from __future__ import annotations

from ringcomm.schedule import Builder, Context, Copy, Region, Schedule


def allgather(ctx: Context) -> Schedule:
    """Allgather of the input (buffer p) into chunks 0..p-1."""
    b = Builder(ctx)
    p, r, counts = ctx.size, ctx.rank, ctx.layout
    # offset of rotated position j in the scratch buffer
    offs = [0]
    for j in range(p):
        offs.append(offs[-1] + counts[(r + j) % p])
    if p == 1:
        b.local(Copy(Region(0, 0, counts[0]), Region(1, 0, counts[0])))
        return b.build()
    held = b.scratch(offs[p])
    b.local(Copy(Region(held, 0, counts[r]), Region(p, 0, counts[r])))
    d = 1
    while d < p:
        m = min(d, p - d)  # blocks that move this step
        # Rank r - d needs blocks r .. r+m-1: my first m positions. From rank r + d come
        # its first m, blocks r+d .. r+d+m-1: my positions d .. d+m-1. Sizes agree on
        # both sides because both compute them from the same counts; empty messages are
        # skipped on both sides alike.
        out = Region(held, 0, offs[m])
        into = Region(held, offs[d], offs[d + m] - offs[d])
        b.step([((r - d) % p, out)] if out.n else [], [((r + d) % p, into)] if into.n else [])
        d *= 2
    b.local(*(Copy(Region((r + j) % p, 0, counts[(r + j) % p]),
                   Region(held, offs[j], offs[j + 1] - offs[j])) for j in range(p)))
    return b.build()


#: what ``import ringcomm`` registers of this module: (collective, name) -> builder
REGISTERS = {("allgather", "bruck"): allgather}
#: each algorithm's row in docs/architecture.md's generated table: name -> (its
#: steps, where it wins)
ROWS = {
    'bruck': (
        'ceil(log2 p) steps over a rotated scratch copy, then a local rotation; '
        'chunks may differ',
        'small chunks from 4 ranks on'),
}
