"""Helpers shared by schedule builders: splitting buffers into chunks and pieces, tree shapes."""
from __future__ import annotations

from ..schedule import Context, Region

#: scratch slots per receiving peer in pipelined reductions: the MPI executor may
#: post that many receives ahead (bounded memory whatever the message size)
WINDOW = 4


def split_even(rg: Region, parts: int) -> list[Region]:
    """``parts`` consecutive regions of ``rg`` whose lengths differ by at most one
    (the first ``rg.n % parts`` are longer); some are empty when ``rg.n < parts``."""
    base, extra = divmod(rg.n, parts)
    out, a = [], rg.off
    for i in range(parts):
        ln = base + (1 if i < extra else 0)
        out.append(Region(rg.buf, a, ln))
        a += ln
    return out


def piece(rg: Region, k: int, seg: int) -> Region | None:
    """The ``k``-th pipeline segment of ``rg`` (None past its end)."""
    a = k * seg
    if a >= rg.n:
        return None
    return Region(rg.buf, rg.off + a, min(seg, rg.n - a))


def pieces(ctx: Context, rg: Region) -> list[Region]:
    """``rg`` cut into pipeline segments of ``ctx.seg`` elements (none when empty)."""
    return [Region(rg.buf, a, n) for a, n in ctx.segments(rg.off, rg.n)]


def count_pieces(n: int, seg: int) -> int:
    return -(-n // seg)


def whole(buf: int, n: int) -> Region:
    return Region(buf, 0, n)


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
