"""The benchmark's result records and the queries over them.

A run produces one :class:`Point` per (collective, dtype, op, size, column); in the
JSON document (schema :data:`SCHEMA`) each becomes a dict with the point's fields
plus ``collective``, ``size``, ``count``, ``dtype``, ``redop`` and ``root``. The
functions here select from such lists of dicts, for a live run and for saved
JSON alike.
"""
from __future__ import annotations

import dataclasses

#: the JSON document of one run: {"schema": SCHEMA, "meta": ..., "results": ..., "analysis": ...}
SCHEMA = "ringcomm.compare_collectives/1"


@dataclasses.dataclass
class Point:
    """The measurement of one column at one size."""

    column: str
    status: str                      # ok | unsupported | error | skipped
    time_us: float | None = None     # max over ranks of the per-rank median
    algbw: float | None = None       # GB/s
    busbw: float | None = None       # GB/s
    wrong: int | None = None         # wrong elements summed over ranks (None: not checked)
    iters: int | None = None
    rank_median_us: list | None = None
    rank_q25_us: list | None = None
    rank_q75_us: list | None = None
    auto_choice: str | None = None
    reason: str | None = None
    dispatch_us: float | None = None  # floor only: its do-nothing dist.all_reduce part


def group_keys(results: list[dict]) -> list[tuple[str, str, str]]:
    """The distinct (collective, dtype, op) of ``results``, in the order measured."""
    keys: list[tuple[str, str, str]] = []
    for r in results:
        k = (r["collective"], r["dtype"], r["redop"])
        if k not in keys:
            keys.append(k)
    return keys


def points(results: list[dict], coll: str, dt: str, op: str, column: str) -> list[dict]:
    """Every result of ``column`` for one (collective, dtype, op), in the order measured."""
    return [r for r in results if r["collective"] == coll and r["dtype"] == dt
            and r["redop"] == op and r["column"] == column]


def ok_points(results: list[dict], coll: str, dt: str, op: str, column: str) -> list[dict]:
    """The measured (status ``ok``) results of ``column``, by size."""
    return sorted((r for r in points(results, coll, dt, op, column) if r["status"] == "ok"),
                  key=lambda r: r["size"])
