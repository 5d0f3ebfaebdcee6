"""Pairwise-exchange all-to-all: p-1 steps, one partner per step.

In step k (1 <= k < p) rank r sends its chunk for ``(r + k) % p`` and receives
from ``(r - k) % p``; when p is a power of two the partner is ``r XOR k`` instead,
so each step is a set of disjoint pairwise swaps (each link carries one message
each way). Counts may differ per pair and be zero: every step still sends one,
possibly empty, message, so ranks that disagree about a count fail loudly
instead of leaving stale data (as the linear schedule does).

Steps: p-1 message steps, plus the local copy of the own chunk. Against the
linear schedule (all p-1 messages in one step) it keeps one message in flight
per direction, so it never floods one receiver and needs no posting of p-1
receives at once: the choice for large messages on many ranks, where the linear
schedule's incast congests the network (which the cost model, counting the
busiest rank's bytes only, does not see).
"""
from __future__ import annotations

from ringcomm.schedule import Builder, Context, Copy, Region, Schedule


def alltoall(ctx: Context) -> Schedule:
    """Send chunk j (buffer j) of rank i lands in receive chunk i (buffer p + i) of rank j."""
    b = Builder(ctx)
    p, r = ctx.size, ctx.rank
    sends, recvs = ctx.layout
    b.local(Copy(Region(p + r, 0, recvs[r]), Region(r, 0, sends[r])))
    xor = p & (p - 1) == 0
    for k in range(1, p):
        to, frm = (r ^ k, r ^ k) if xor else ((r + k) % p, (r - k) % p)
        b.step([(to, Region(to, 0, sends[to]))], [(frm, Region(p + frm, 0, recvs[frm]))])
    return b.build()


#: what ``import ringcomm`` registers of this module: (collective, name) -> builder
REGISTERS = {("alltoall", "pairwise"): alltoall}
#: each algorithm's row in docs/architecture.md's generated table: name -> (its
#: steps, where it wins)
ROWS = {
    'pairwise': (
        'p-1 steps, partner r±k (r XOR k on powers of two); counts may differ and be '
        'zero',
        'not by the model (it counts no congestion); select it by hand'),
}
