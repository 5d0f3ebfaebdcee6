"""Dissemination barrier: ceil(log2 p) rounds, no root.

In round k rank r sends to r + 2^k and receives from r - 2^k. What a rank sends
is everything it has received so far (plus its own token), so each message
depends, as data, on the previous round's receive: no executor can send it
early, and a rank leaves only after hearing, directly or through others, from
every rank. The messages grow to p/2 bytes in the last round: still tiny.
"""
from __future__ import annotations

from ringcomm.schedule import Builder, Context, Copy, Region, Schedule


def dissemination(ctx: Context) -> Schedule:
    """Barrier over the one-element entry token (buffer 0)."""
    b = Builder(ctx)
    p, r = ctx.size, ctx.rank
    if p == 1:
        return b.build()
    rounds = (p - 1).bit_length()
    have = b.scratch(1 << rounds)
    b.local(Copy(Region(have, 0, 1), Region(0, 0, 1)))
    for k in range(rounds):
        n = 1 << k
        b.step(sends=[((r + n) % p, Region(have, 0, n))],
               recvs=[((r - n) % p, Region(have, n, n))])
    return b.build()
