"""Helpers shared by the built-in schedule builders.

Splitting, segmenting and tree shapes are public (:mod:`ringcomm.schedule`:
``split_even``, ``pieces``, ``binomial_tree``, ``SCRATCH_SLOTS``) so that algorithms
written outside ringcomm use the very same code; this module keeps the built-ins'
short names for them and the few helpers only the built-ins use.
"""
from __future__ import annotations

from ringcomm.schedule import SCRATCH_SLOTS, Context, Region
from ringcomm.schedule import binomial_tree as binomial
from ringcomm.schedule import pieces as _pieces
from ringcomm.schedule import split_even

__all__ = ["SCRATCH_SLOTS", "split_even", "binomial", "piece", "pieces", "count_pieces", "whole",
           "chain"]


def piece(rg: Region, k: int, seg: int) -> Region | None:
    """The ``k``-th pipeline segment of ``rg`` (None past its end)."""
    a = k * seg
    if a >= rg.n:
        return None
    return Region(rg.buf, rg.off + a, min(seg, rg.n - a))


def pieces(ctx: Context, rg: Region) -> list[Region]:
    """``rg`` cut into pipeline segments of ``ctx.seg`` elements (none when empty)."""
    return _pieces(rg, ctx.seg)


def count_pieces(n: int, seg: int) -> int:
    return -(-n // seg)


def whole(buf: int, n: int) -> Region:
    return Region(buf, 0, n)


def chain(rank: int, size: int, root: int) -> tuple[int | None, list[int]]:
    """Parent and child of ``rank`` in the pipeline root -> root+1 -> ... (mod size)."""
    v = (rank - root) % size
    parent = None if v == 0 else (rank - 1) % size
    kids = [(rank + 1) % size] if v + 1 < size else []
    return parent, kids
