"""Helpers shared by algorithms: splitting buffers into chunks and segments, tree shapes."""
from __future__ import annotations

import torch

#: receives kept posted ahead of the one being reduced (bounded scratch memory:
#: WINDOW segments per peer, whatever the message size)
WINDOW = 4


def seg_elems(segment_bytes: int, dtype: torch.dtype) -> int:
    """Elements per pipeline segment (at least one)."""
    return max(1, segment_bytes // dtype.itemsize)


def segments(t: torch.Tensor, seg: int) -> list[torch.Tensor]:
    """Views of 1-D ``t`` of at most ``seg`` elements each; none for an empty tensor."""
    n = t.numel()
    if 0 < n <= seg:
        return [t]
    return [t[a:a + seg] for a in range(0, n, seg)]


def split_even(t: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``parts`` contiguous views of 1-D ``t`` whose lengths differ by at most one
    (the first ``numel % parts`` are longer); some are empty when numel < parts."""
    n = t.numel()
    base, extra = divmod(n, parts)
    out, a = [], 0
    for i in range(parts):
        ln = base + (1 if i < extra else 0)
        out.append(t[a:a + ln])
        a += ln
    return out


def binomial(rank: int, size: int, root: int) -> tuple[int | None, list[int]]:
    """Parent and children of ``rank`` in a binomial tree rooted at ``root``.

    Relative rank ``v = rank - root (mod size)``; the parent clears v's lowest set bit;
    children are ``v + 2**k`` for ``2**k`` below that bit. Children come largest
    subtree first (the order a broadcast should feed them).
    """
    v = (rank - root) % size
    parent = None if v == 0 else ((v & (v - 1)) + root) % size
    low = v & -v if v else 1 << size.bit_length()
    kids, k = [], 1
    while k < low and v + k < size:
        kids.append((v + k + root) % size)
        k <<= 1
    return parent, kids[::-1]


def chain(rank: int, size: int, root: int) -> tuple[int | None, list[int]]:
    """Parent and child of ``rank`` in the pipeline root -> root+1 -> ... (mod size)."""
    v = (rank - root) % size
    parent = None if v == 0 else (rank - 1) % size
    kids = [(rank + 1) % size] if v + 1 < size else []
    return parent, kids
