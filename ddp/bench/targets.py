"""Speed targets (data in ``ddp/bench/targets.json``): loading and checking them
against a run's breakdown section."""
from __future__ import annotations

from ddp.bench.constants import TARGETS_SCHEMA
from ringcomm.bench.targets import read_targets

_TARGET_KEYS = {"name": str, "metric": str, "models": str, "of": str, "versus": str,
                "bound": str, "goal": (int, float)}
METRICS = ("iteration_ratio", "overlap_saving", "roundrobin_ratio")


def load_targets(path: str) -> list[dict]:
    """The targets in the JSON file at ``path``.

    Raises:
        ValueError: unreadable, or a target lacks a field or has a bad one (named).
    """
    return [t for _, t in read_targets(path, TARGETS_SCHEMA, _TARGET_KEYS, METRICS)]


def comm_heavy_model(doc: dict) -> str | None:
    """The measured model whose flat allreduce takes the largest share of an overlap-off
    iteration on the default group's backend."""
    over = doc.get("breakdown", {})
    b = doc["meta"]["default_group_backend"]
    shares = {m: part["overlap"][b]["comm_share_off"] for m, part in over.items()
              if b in part["overlap"]}
    return max(shares, key=shares.get) if shares else None


def rr_rows(part: dict, cap: float | None = None) -> dict[str, dict]:
    """The roundrobin section's rows of one model at bucket cap ``cap`` (None: the
    section's first cap), by ``"<config> K=<k>"``."""
    cap = part["caps"][0] if cap is None else cap
    return {f"{r['config']} K={r['k']}": r for r in part["rows"] if r["bucket_cap_mb"] == cap}


def _rows_by_model(doc: dict, t: dict) -> dict[str, dict]:
    if t["metric"] == "roundrobin_ratio":
        return {m: rr_rows(part, t.get("bucket_cap_mb"))
                for m, part in doc.get("roundrobin", {}).items()}
    return {m: part["rows"] for m, part in doc.get("breakdown", {}).items()}


def check_targets(doc: dict, spec: list[dict]) -> tuple[str, list[dict]]:
    """Compare the breakdown and roundrobin sections of ``doc`` with the targets; text
    and records.

    ``iteration_ratio``: total time per iteration of ``of`` / of ``versus``.
    ``overlap_saving``: (``versus`` - ``of``) / ``versus``, ``versus`` being an
    overlap-off configuration. ``roundrobin_ratio``: as ``iteration_ratio``, in the
    roundrobin section, ``of`` and ``versus`` naming ``"<config> K=<k>"`` at the
    target's ``bucket_cap_mb`` (default: the section's first cap). ``models``:
    ``each`` (every measured model must meet it), ``comm_heavy``
    (:func:`comm_heavy_model`) or a model name.
    """
    lines = ["#", f"# speed targets ({doc['meta']['world_size']} ranks; checked, never fatal)"]
    recs = []
    for t in spec:
        rows_by_model = _rows_by_model(doc, t)
        models = (list(rows_by_model) if t["models"] == "each" else
                  [comm_heavy_model(doc)] if t["models"] == "comm_heavy" else [t["models"]])
        per_model = {}
        for m in models:
            rows = rows_by_model.get(m or "", {})
            if t["of"] in rows and t["versus"] in rows:
                a, b = rows[t["of"]]["total_ms"], rows[t["versus"]]["total_ms"]
                value = (b - a) / b if t["metric"] == "overlap_saving" else a / b
                per_model[m] = {"of_ms": a, "versus_ms": b, "value": round(value, 4),
                                "ratio": round(a / b, 4)}
        rec = {**t, "per_model": per_model}
        stated = (f", stated for {t['ranks']} ranks" if t.get("ranks") not in
                  (None, doc["meta"]["world_size"]) else "")
        head = f"#   {t['name']}{stated}: "
        if not per_model:
            rec.update(met=None, value=None, ratio=None)
            section = "roundrobin" if t["metric"] == "roundrobin_ratio" else "breakdown"
            lines.append(head + f"NOT MEASURED (needs the {section} section with {t['of']} and "
                         f"{t['versus']}" + (f" for model {t['models']}" if t["models"] not in
                                             ("each", "comm_heavy") else "") + ")")
        else:
            good = {m: (e["value"] <= t["goal"] if t["bound"] == "<=" else e["value"] >= t["goal"])
                    for m, e in per_model.items()}
            worst = (max if t["bound"] == "<=" else min)(per_model, key=lambda m: per_model[m]["value"])
            e = per_model[worst]
            rec.update(met=all(good.values()), value=e["value"], ratio=e["ratio"], worst_model=worst)
            shown = (f"saves {100 * e['value']:.1f}%" if t["metric"] == "overlap_saving"
                     else f"{e['value']:.3f}x")
            lines.append(head + f"{worst}: {t['of']} {e['of_ms']:.1f} ms vs {t['versus']} "
                         f"{e['versus_ms']:.1f} ms = {shown} (ratio {e['ratio']:.3f}; target "
                         f"{t['bound']} {t['goal']:g}) {'MET' if rec['met'] else 'MISSED'}")
        recs.append(rec)
    return "\n".join(lines), recs
