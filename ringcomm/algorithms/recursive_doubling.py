"""Recursive-doubling allreduce: log2 p rounds in which every rank exchanges its
whole buffer with the rank whose number differs in one bit, and reduces.

Fewest message steps of all (one exchange for 2 ranks, against two sequential
messages for a tree), at the price of sending the whole buffer every round:
the choice for small messages. A non-power-of-two world first folds the extra
ranks into partners and hands them the result at the end. Every rank combines
the same pairs in the same tree, each pair as (lower ranks' part) op (higher
ranks' part), so all ranks end with bit-identical results even where an op's
operand order shows (MIN and MAX of +0 and -0 return one operand's sign).
"""
from __future__ import annotations

from ringcomm.algorithms.common import whole
from ringcomm.schedule import Builder, Context, Reduce, Schedule


def allreduce(ctx: Context) -> Schedule:
    """Allreduce buffer 0 in place (no pipelining: whole-buffer messages)."""
    b = Builder(ctx)
    p, r, n = ctx.size, ctx.rank, ctx.layout[0]
    if p == 1 or n == 0:
        return b.build()
    data = whole(0, n)
    tmp = whole(b.scratch(n), n)
    pow2 = 1 << (p.bit_length() - 1)
    extra = p - pow2
    # the partial result stays in `data`, received parts come into `tmp`; a partner
    # holding the lower ranks' part gives the left operand (src_first)
    # Fold: among the first 2*extra ranks, each even rank hands its data to the next
    # odd rank and sits out until the result comes back; the others renumber 0..pow2-1.
    if r < 2 * extra:
        if r % 2 == 0:
            b.step(sends=[(r + 1, data)])
            b.step(recvs=[(r + 1, data)])
            return b.build()
        b.step(recvs=[(r - 1, tmp)], local=[Reduce(data, tmp, src_first=True)])
        vr = r // 2
    else:
        vr = r - extra
    mask = 1
    while mask < pow2:
        vpeer = vr ^ mask
        peer = vpeer * 2 + 1 if vpeer < extra else vpeer + extra
        b.step(sends=[(peer, data)], recvs=[(peer, tmp)],
               local=[Reduce(data, tmp, src_first=vpeer < vr)])
        mask <<= 1
    if r < 2 * extra:
        b.step(sends=[(r - 1, data)])
    return b.build()
