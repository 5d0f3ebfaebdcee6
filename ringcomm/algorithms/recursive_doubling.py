"""Recursive-doubling allreduce: log2 p rounds in which every rank exchanges its
whole buffer with the rank whose number differs in one bit, and reduces.

Fewest message steps of all (one exchange for 2 ranks, against two sequential
messages for a tree), at the price of sending the whole buffer every round:
the choice for small messages. A non-power-of-two world first folds the extra
ranks into partners and hands them the result at the end. Every rank combines
the same pairs in the same tree; reduce ops are commutative, so all ranks end
with bit-identical results.
"""
from __future__ import annotations

import torch

from ..transport import Transport


def allreduce(tp: Transport, buf: torch.Tensor, op, *, segment_bytes: int = 0) -> None:
    """Allreduce 1-D ``buf`` in place (``segment_bytes`` is unused: no pipelining)."""
    p, r = tp.size, tp.rank
    if p == 1:
        return
    tmp = tp.scratch(0, buf.numel(), buf.dtype)
    pow2 = 1 << (p.bit_length() - 1)
    extra = p - pow2
    # Fold: among the first 2*extra ranks, each even rank hands its data to the next
    # odd rank and sits out; the others renumber 0..pow2-1.
    if r < 2 * extra:
        if r % 2 == 0:
            tp.send(buf, r + 1)
            tp.recv(buf, r + 1)
            return
        tp.recv(tmp, r - 1)
        tp.reduce_(buf, tmp, op)
        vr = r // 2
    else:
        vr = r - extra
    mask = 1
    while mask < pow2:
        vpeer = vr ^ mask
        peer = vpeer * 2 + 1 if vpeer < extra else vpeer + extra
        tp.sendrecv(buf, peer, tmp, peer)
        tp.reduce_(buf, tmp, op)
        mask <<= 1
    if r < 2 * extra:
        tp.send(buf, r - 1)
