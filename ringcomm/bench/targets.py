"""Speed targets: the goals a run is checked against after its tables.

The targets are data, not code: a JSON file (schema :data:`TARGETS_SCHEMA`), by
default ``targets.json`` next to this module (shipped with the package), another
one with ``--targets FILE``. Each target names a collective, dtype and op, a size
range, a metric (``time_us`` or ``busbw``), the columns whose best counts
(``of``), optionally a column to divide by (``versus``; ``"best"``: the best of
the columns listed in ``among`` at each size), a bound (``<=``/``>=``) and a
goal. :func:`load_targets` reads and validates a file;
:func:`check_targets` compares one run's results with them.
"""
from __future__ import annotations

import json
from pathlib import Path

from ringcomm.bench.sizes import format_size

#: the targets file shipped with the package (the default of ``--targets``)
DEFAULT_TARGETS = str(Path(__file__).resolve().with_name("targets.json"))
TARGETS_SCHEMA = "ringcomm.compare_collectives.targets/1"

_TARGET_KEYS = {"name": str, "collective": str, "dtype": str, "redop": str, "min_bytes": int,
                "max_bytes": int, "metric": str, "of": list, "bound": str, "goal": (int, float)}


def read_targets(path: str, schema: str, keys: dict, metrics: tuple[str, ...]):
    """Yield ``(where, target)`` for each target of the JSON file at ``path``, after
    the checks every targets file shares: its ``schema``, each target an object
    with ``keys`` (name -> type) of those types, a ``metric`` among ``metrics`` and
    a bound ``<=`` or ``>=``. ``where`` names the target for further checks.

    Raises:
        ValueError: unreadable, or a target lacks a field or has a bad one (named).
    """
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--targets {path!r}: cannot read it: {e}") from e
    if not isinstance(doc, dict) or doc.get("schema") != schema:
        raise ValueError(f"--targets {path!r}: not a targets file (schema must be "
                         f"{schema!r})")
    for i, t in enumerate(doc.get("targets", [])):
        where = f"--targets {path!r}, target {i}"
        if not isinstance(t, dict):
            raise ValueError(f"{where}: not an object")
        for k, typ in keys.items():
            if not isinstance(t.get(k), typ) or isinstance(t.get(k), bool):
                raise ValueError(f"{where} ({t.get('name', '?')}): field {k!r} is missing or "
                                 f"not a {typ.__name__ if isinstance(typ, type) else 'number'}")
        if t["metric"] not in metrics:
            raise ValueError(f"{where}: metric must be one of {', '.join(metrics)}, "
                             f"got {t['metric']!r}")
        if t["bound"] not in ("<=", ">="):
            raise ValueError(f"{where}: bound must be '<=' or '>=', got {t['bound']!r}")
        yield where, t


def load_targets(path: str) -> list[dict]:
    """The targets listed in the JSON file at ``path`` (see :data:`DEFAULT_TARGETS`).

    Raises:
        ValueError: unreadable, or a target lacks a field or has a bad one (named).
    """
    out = []
    for where, t in read_targets(path, TARGETS_SCHEMA, _TARGET_KEYS, ("time_us", "busbw")):
        if not t["of"] or not all(isinstance(c, str) for c in t["of"]):
            raise ValueError(f"{where}: 'of' must list column names")
        if t.get("versus") is not None and not isinstance(t["versus"], str):
            raise ValueError(f"{where}: 'versus' must be a column name or null")
        if t.get("versus") == "best" and not (isinstance(t.get("among"), list) and t["among"]):
            raise ValueError(f"{where}: 'versus': 'best' needs 'among', the columns whose "
                             "best it is")
        if t["goal"] <= 0:
            raise ValueError(f"{where}: goal must be positive (ratios are taken against it), "
                             f"got {t['goal']!r}")
        if t["min_bytes"] > t["max_bytes"]:
            raise ValueError(f"{where}: min_bytes is above max_bytes")
        out.append(t)
    return out


def _range_text(t: dict) -> str:
    lo, hi = format_size(t["min_bytes"]), format_size(t["max_bytes"])
    return lo if lo == hi else f"{lo}-{hi}"


def check_targets(results: list[dict], p: int, spec: list[dict] | None = None,
                  ) -> tuple[str, list[dict]]:
    """Check the speed targets ``spec`` (default: the file :data:`DEFAULT_TARGETS`)
    against one run's results, as text and records. Ratios use this run's numbers only.

    Each record: the target's fields plus ``value`` (the worst measured ratio, or
    the worst measured value when the target has no ``versus``), ``ratio`` (value
    over goal for an absolute target, else the same as ``value``), ``met`` (True,
    False, or None when no size in its range was measured with every column it
    needs), ``sizes`` (per size: the best column, its value and the ratio).
    """
    if spec is None:
        spec = load_targets(DEFAULT_TARGETS)
    recs: list[dict] = []
    if not spec:
        return "", recs
    lines = ["#", f"# speed targets on {p} ranks (met when true at every measured size in "
                  "its range)"]
    for t in spec:
        per_size, missing = _measure(results, t)
        rec, line = _verdict(t, p, per_size, missing)
        recs.append(rec)
        lines.append(line)
    return "\n".join(lines), recs


def _ok(results: list[dict], coll: str, dt: str, op: str, column: str, size: int,
        ) -> dict | None:
    """The ``ok`` result of ``column`` at ``size`` of (coll, dt, op), or None."""
    for r in results:
        if (r["collective"], r["dtype"], r["redop"], r["column"], r["size"]) == \
                (coll, dt, op, column, size) and r["status"] == "ok":
            return r
    return None


def _measure(results: list[dict], t: dict) -> tuple[list[dict], list[int]]:
    """Target ``t`` at each size of its range: the entries of the sizes measured with
    every column it needs (best column, value, ratio) and the sizes that were not."""
    coll, dt, op, metric = t["collective"], t["dtype"], t["redop"], t["metric"]
    versus, goal = t.get("versus"), float(t["goal"])
    pick = min if metric == "time_us" else max
    sizes = sorted({r["size"] for r in results if (r["collective"], r["dtype"], r["redop"])
                    == (coll, dt, op) and t["min_bytes"] <= r["size"] <= t["max_bytes"]})
    per_size, missing = [], []
    for size in sizes:
        cands = [x for x in (_ok(results, coll, dt, op, c, size) for c in t["of"]) if x]
        if not cands:
            missing.append(size)
            continue
        best = pick(cands, key=lambda r: r[metric])
        entry = {"size": size, "best": best["column"], "value": best[metric]}
        if versus:
            if versus == "best":  # the best of the columns the target lists
                rivals = [x for x in (_ok(results, coll, dt, op, c, size) for c in t["among"])
                          if x]
                other = pick(rivals, key=lambda r: r[metric]) if rivals else None
            else:
                other = _ok(results, coll, dt, op, versus, size)
            if not other:
                missing.append(size)
                continue
            entry["versus_value"] = other[metric]
            entry["ratio"] = best[metric] / other[metric]
        else:
            entry["ratio"] = best[metric] / goal
        per_size.append(entry)
    return per_size, missing


def _verdict(t: dict, p: int, per_size: list[dict], missing: list[int]) -> tuple[dict, str]:
    """Target ``t``'s record and its line from what :func:`_measure` found."""
    coll, dt, op = t["collective"], t["dtype"], t["redop"]
    versus, goal, bound = t.get("versus"), float(t["goal"]), t["bound"]
    unit = "us" if t["metric"] == "time_us" else "GB/s"
    rec = {**t, "sizes": per_size, "unmeasured_sizes": missing}
    stated = f" (stated for {t['ranks']} ranks)" if t.get("ranks") not in (None, p) else ""
    head = f"#   {t['name']} ({coll} {dt} {op}{stated}): "
    if not per_size:
        need = ", ".join(t["of"]) + (f" and {versus}" if versus else "")
        rec.update(value=None, ratio=None, met=None)
        return rec, (head + f"NOT MEASURED (needs {need} at {_range_text(t)}, "
                     f"-d {dt}" + (f" -o {op}" if op != "none" else "") + ")")
    key = "ratio" if versus else "value"
    worst = (max if bound == "<=" else min)(per_size, key=lambda e: e[key])
    value = worst[key]
    met = all(e[key] <= goal if bound == "<=" else e[key] >= goal for e in per_size)
    rec.update(value=value, ratio=worst["ratio"], met=met, worst_size=worst["size"])
    at = f"worst at {format_size(worst['size'])}: " if len(per_size) > 1 else ""
    n_ok = sum(1 for e in per_size if (e[key] <= goal if bound == "<=" else e[key] >= goal))
    count = f", {n_ok} of {len(per_size)} sizes" if len(per_size) > 1 else ""
    if missing:
        count += f"; no data at {', '.join(format_size(m) for m in missing)}"
    if versus:
        return rec, (head + f"{at}{worst['best']} {worst['value']:.3f} {unit} vs "
                     f"{versus} {worst['versus_value']:.3f} {unit} = {value:.2f}x "
                     f"(target {bound} {goal:g}x{count}) {'MET' if met else 'MISSED'}")
    return rec, (head + f"{at}{worst['best']} {value:.3f} {unit} = "
                 f"{worst['ratio']:.2f}x the goal (target {bound} {goal:g} {unit}"
                 f"{count}) {'MET' if met else 'MISSED'}")


#: what :func:`check_targets` adds to each target in its records
_OUTCOME_FIELDS = ("sizes", "unmeasured_sizes", "value", "ratio", "met", "worst_size")


def recorded_targets(records: list[dict]) -> list[dict]:
    """The targets a run was checked against, from its records (``analysis.targets``
    of a saved run): each record less what the check added."""
    return [{k: v for k, v in r.items() if k not in _OUTCOME_FIELDS} for r in records]
