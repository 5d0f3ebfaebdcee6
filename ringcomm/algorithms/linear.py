"""Direct (linear) schedules: every rank talks to every other rank in one step.

For gather, scatter and all-to-all the data itself is personal, so each byte
crosses one link once whatever the schedule; one step with every message lets
the transport move them concurrently (on NCCL, one group, as NCCL's own
all-to-all does). Latency grows with p at the root of gather/scatter.
"""
from __future__ import annotations

from ringcomm.algorithms.common import whole
from ringcomm.schedule import Builder, Context, Copy, Schedule


def gather(ctx: Context) -> Schedule:
    """Rank i's input (buffer p) lands in chunk i on the root."""
    b = Builder(ctx)
    p, r, root, lay = ctx.size, ctx.rank, ctx.root, ctx.layout
    mine = whole(p, lay[r])
    if r != root:
        b.step(sends=[(root, mine)])
    else:
        b.local(Copy(whole(r, lay[r]), mine))
        b.step(recvs=[(i, whole(i, lay[i])) for i in range(p) if i != root])
    return b.build()


def scatter(ctx: Context) -> Schedule:
    """Chunk i of the root lands in rank i's output (buffer p)."""
    b = Builder(ctx)
    p, r, root, lay = ctx.size, ctx.rank, ctx.root, ctx.layout
    mine = whole(p, lay[r])
    if r != root:
        b.step(recvs=[(root, mine)])
    else:
        b.local(Copy(mine, whole(r, lay[r])))
        b.step(sends=[(i, whole(i, lay[i])) for i in range(p) if i != root])
    return b.build()


def alltoall(ctx: Context) -> Schedule:
    """Send chunk j (buffer j) of rank i lands in receive chunk i (buffer p + i) of
    rank j. Messages are listed by distance (r+1, r+2, ...) so ranks do not all hit
    the same peer first. Empty chunks still send an empty message, so a size
    mismatch fails loudly instead of leaving stale data."""
    b = Builder(ctx)
    p, r = ctx.size, ctx.rank
    sends_n, recvs_n = ctx.layout
    b.local(Copy(whole(p + r, recvs_n[r]), whole(r, sends_n[r])))
    sends, recvs = [], []
    for s in range(1, p):
        src, dst = (r - s) % p, (r + s) % p
        recvs.append((src, whole(p + src, recvs_n[src])))
        sends.append((dst, whole(dst, sends_n[dst])))
    b.step(sends, recvs)
    return b.build()
