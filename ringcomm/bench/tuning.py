"""Tuning for ringcomm's ``auto`` from measured times: the fastest ringcomm
algorithm at each size, robust to noise (:func:`tuning_rows`), per collective
and world size of saved results (:func:`measured_tuning`), written into a
tuning file that ringcomm loads (:func:`write_tuning`) and summarised as text
(:func:`tuning_text`).

The rows come from the measurements, not the cost model.
"""
from __future__ import annotations

import json
import math
import os
from typing import Mapping, Sequence

import numpy as np

from ringcomm.bench.results import ok_points
from ringcomm.bench.sizes import ELEMENT_SIZE, REDUCING, format_size

#: ringcomm columns left out of tuning: auto is the mix the tuning decides. native
#: takes part (auto falls back to the built-in choice where MPI cannot reduce a dtype)
NOT_SCHEDULES = ("auto",)


def _ok(v) -> bool:
    return v is not None and math.isfinite(v) and v > 0


def smooth(values: Sequence[float | None]) -> list[float | None]:
    """Running median of three neighbouring sizes (ends kept): removes a spike at
    one size, of any height, and keeps trends and real crossings in place."""
    out = list(values)
    for i in range(1, len(values) - 1):
        if not _ok(values[i]):
            continue
        window = [v for v in values[i - 1:i + 2] if _ok(v)]
        out[i] = float(np.median(window))
    return out


def best_per_size(sizes: Sequence[int], times: Mapping[str, Sequence[float | None]],
                  tolerance: float = 0.05) -> list[str]:
    """The fastest algorithm at each size, robust to noise.

    Times are smoothed (:func:`smooth`), and the winner changes only when another
    algorithm is faster by more than ``tolerance`` (a fraction): within that,
    the two are a tie and the previous winner stays, so the table does not flip
    back and forth on noise.

    Args:
        sizes: message sizes, ascending.
        times: algorithm -> time at each size (None or non-finite: not measured).
    Raises:
        ValueError: a size where no algorithm has a time, or mismatched lengths.
    """
    names = list(times)
    for name in names:
        if len(times[name]) != len(sizes):
            raise ValueError(f"best_per_size: {name} has {len(times[name])} times "
                             f"for {len(sizes)} sizes")
    sm = {a: smooth(times[a]) for a in names}
    winners: list[str] = []
    for i, n in enumerate(sizes):
        cands = [(sm[a][i], a) for a in names if _ok(sm[a][i])]
        if not cands:
            raise ValueError(f"best_per_size: no algorithm has a time at {n} B")
        t_best, best = min(cands)
        prev = winners[-1] if winners else None
        if prev is not None and prev != best and _ok(sm[prev][i]) and \
                sm[prev][i] <= t_best * (1 + tolerance):
            best = prev
        winners.append(best)
    return winners


def tuning_rows(sizes: Sequence[int], times: Mapping[str, Sequence[float | None]],
                tolerance: float = 0.05) -> list[list]:
    """Tuning rows ``[[max_bytes, algorithm], ..., [None, algorithm]]`` for ringcomm's
    ``auto`` choice from measured times (first matching row wins).

    Where the winner changes between two measured sizes, the threshold is where the
    two time curves cross, interpolated linearly in log(size).

    Args:
        sizes: message sizes in the unit ``auto`` is asked with, ascending.
        times: algorithm -> time at each size (None: not measured).
        tolerance: see :func:`best_per_size`.
    """
    sizes = list(sizes)
    if sorted(sizes) != sizes or len(set(sizes)) != len(sizes):
        raise ValueError("tuning_rows: sizes must be strictly ascending")
    winners = best_per_size(sizes, times, tolerance)
    sm = {a: smooth(times[a]) for a in times}
    rows: list[list] = []
    for i in range(len(sizes) - 1):
        a, b = winners[i], winners[i + 1]
        if a == b:
            continue
        s0, s1 = sizes[i], sizes[i + 1]
        ta0, ta1 = sm[a][i], sm[a][i + 1]
        tb0, tb1 = sm[b][i], sm[b][i + 1]
        frac = 0.0
        if all(_ok(v) for v in (ta0, ta1, tb0, tb1)):
            d0, d1 = ta0 - tb0, ta1 - tb1  # d0 <= 0 (a wins at s0), d1 >= 0
            if d1 != d0:
                frac = min(1.0, max(0.0, d0 / (d0 - d1)))
        if s0 > 0:
            cut = math.exp(math.log(s0) + frac * (math.log(s1) - math.log(s0)))
        else:
            cut = s0 + frac * (s1 - s0)
        max_bytes = int(min(s1 - 1, max(s0, math.floor(cut))))
        rows.append([max_bytes, a])
    rows.append([None, winners[-1]])
    return rows


def measured_tuning(docs: list[dict], tolerance: float) -> dict[str, dict[str, list]]:
    """Tuning rows per collective and world size from the measured ringcomm
    algorithms (native and registered ones included, auto excluded), in ringcomm's
    tuning-file shape.

    Uses float/sum timings when present (else the first dtype/op measured); sizes
    are converted to what ``auto`` is asked with (one rank's block for allgather
    and reduce_scatter).
    """
    table: dict[str, dict[str, list]] = {}
    for doc in docs:
        meta = doc["meta"]
        p = int(meta["world_size"])
        # every algorithm ringcomm can run (a user's registered ones with --import);
        # not auto, which is their mix
        algos = [c["name"] for c in meta["columns"]
                 if c["kind"] == "ringcomm" and c["algo"] not in NOT_SCHEDULES]
        colls = []
        for r in doc["results"]:
            if r["collective"] not in colls:
                colls.append(r["collective"])
        for coll in colls:
            combos = []
            for r in doc["results"]:
                k = (r["dtype"], r["redop"])
                if r["collective"] == coll and k not in combos:
                    combos.append(k)
            dt, op = ("float", "sum" if coll in REDUCING else "none")
            if (dt, op) not in combos:
                dt, op = combos[0]
            per_algo = {a: {r["size"]: r for r in ok_points(doc["results"], coll, dt, op, a)}
                        for a in algos}
            per_algo = {a: v for a, v in per_algo.items() if v}
            if not per_algo:
                continue
            sizes = sorted(set().union(*[set(v) for v in per_algo.values()]))
            esize = ELEMENT_SIZE[dt]
            units = []
            for s in sizes:
                count = s // esize
                per = count // p if coll in ("allgather", "reduce_scatter") else count
                units.append(per * esize)
            times = {a: [v[s]["time_us"] if s in v else None for s in sizes]
                     for a, v in per_algo.items()}
            # Drop sizes where no algorithm ran, and sizes that round to a unit
            # already seen (too small to give every rank a whole element).
            keep, seen = [], set()
            for i, u in enumerate(units):
                if u not in seen and any(times[a][i] for a in times):
                    keep.append(i)
                    seen.add(u)
            if not keep:
                continue
            units = [units[i] for i in keep]
            times = {a: [t[i] for i in keep] for a, t in times.items()}
            rows = tuning_rows(units, times, tolerance)
            table.setdefault(coll, {})[str(p)] = rows
    return table


def write_tuning(path: str, table: dict[str, dict[str, list]]) -> tuple[list[str], list[str]]:
    """Merge ``table`` into the tuning file at ``path`` (created if missing) and
    check ringcomm accepts the result.

    Returns:
        (entries written as "collective/world size", collectives ringcomm's tuning
        does not know and were left out).
    Raises:
        ValueError: the existing file is not a tuning file, or ringcomm rejects the result.
    """
    from ringcomm.algorithms import select

    existing: dict = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                existing = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--write-tuning: {path!r} exists and is not JSON ({e}); "
                             "remove it or pick another file") from e
        if not isinstance(existing, dict):
            raise ValueError(f"--write-tuning: {path!r} is not a ringcomm tuning file")
    written, left_out = [], []
    for coll, by_p in table.items():
        if coll not in select.DEFAULT_TUNING:
            left_out.append(coll)
            continue
        for p, rows in by_p.items():
            existing.setdefault(coll, {})[p] = rows
            written.append(f"{coll}/{p}")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(existing, f, indent=1)
        f.write("\n")
    try:
        select.load_tuning(tmp)
    except ValueError:
        os.unlink(tmp)
        raise
    os.replace(tmp, path)
    return written, left_out


def tuning_text(table: dict[str, dict[str, list]]) -> str:
    """One line per collective and world size: which algorithm is fastest up to which size."""
    lines = []
    for coll, by_p in table.items():
        for p, rows in by_p.items():
            parts, lo = [], 0
            for max_bytes, algo in rows:
                if max_bytes is None:
                    parts.append(f"{algo} from {format_size(lo)}" if lo else f"{algo} always")
                else:
                    parts.append(f"{algo} up to {format_size(max_bytes)}")
                    lo = max_bytes + 1
            lines.append(f"#   measured best at {p} ranks, {coll}: " + ", then ".join(parts))
    return "\n".join(lines)


def tuning_report(table: dict[str, dict[str, list]]) -> str:
    """:func:`tuning_text` under its heading, as a run prints it."""
    return ("#\n# measured tuning (the fastest ringcomm algorithm by size; sizes as auto "
            "sees them):\n" + tuning_text(table))
