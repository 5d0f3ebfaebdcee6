"""What the numbers say, for a live run or saved JSON alike: the cost model fitted
per column (:func:`fit_models`), its report with predictions at other world sizes
and ring/tree crossovers (:func:`model_report`, and :func:`model_text` for a
report saved in a run's ``analysis.cost_model``), and :func:`analyse`, which adds
the speed targets and the measured tuning and prints it all.

Needs only result documents (schema :data:`ringcomm.bench.results.SCHEMA`): no
MPI, no process group.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Callable, Sequence

from ringcomm.bench import cost_model
from ringcomm.bench.sizes import REDUCING, format_size
from ringcomm.bench.targets import check_targets, load_targets
from ringcomm.bench.tuning import measured_tuning, tuning_report, write_tuning

_MODEL_HEADER = [
    "#", "# cost model: T = o + alpha*A(p,n) + beta*B(p,n) + gamma*G(p,n)  "
    "(A messages, B bytes on the busiest link, G bytes reduced, for each algorithm;",
    "#   other libraries: T = o + beta*n at the measured world size only; gamma is "
    "measured by a local reduction, not fitted)"]


def fit_models(docs: list[dict]) -> list[dict]:
    """Fit a cost model per (collective, dtype, op, column) over one or more result
    documents (several world sizes give a better model).

    Returns:
        One dict per fit: the :class:`cost_model.Fit` fields plus ``column``, ``dtype``, ``redop``.
    """
    by_key: dict[tuple, list] = {}
    seg: dict[tuple, int] = {}
    gammas: dict[tuple, float] = {}
    kinds: dict[str, str] = {}
    for doc in docs:
        meta = doc["meta"]
        p = int(meta["world_size"])
        for c in meta["columns"]:
            kinds[c["name"]] = c["kind"] if c["algo"] != "auto" else "auto"
        for r in doc["results"]:
            if r["status"] != "ok" or r["time_us"] is None:
                continue
            k = (r["collective"], r["dtype"], r["redop"], r["column"])
            by_key.setdefault(k, []).append((p, r["size"], r["time_us"] * 1e-6))
            seg[k] = int(meta["ringcomm"]["segment_bytes"])
            g = meta.get("gamma_s_per_byte", {}).get(f"{r['dtype']}/{r['redop']}")
            if g is not None:
                gammas[k] = max(gammas.get(k, 0.0), float(g))
    fits = []
    for (coll, dt, op, column), samples in by_key.items():
        kind = kinds.get(column, column)
        if kind in ("auto", "floor") or len(samples) < 2:
            # auto is one algorithm or another by size: its own curve has no single
            # model; the floor is a bound made of two measurements, not an implementation
            continue
        algo = column if kind in ("ringcomm", "ringcomm-cuda") else None
        gamma = gammas.get((coll, dt, op, column)) if coll in REDUCING else None
        note = None
        try:
            f = cost_model.fit(coll, algo, samples, segment_bytes=seg[(coll, dt, op, column)],
                          gamma=gamma)
        except ValueError as e:  # e.g. a user's builder the checker refuses at this shape
            if algo is None:
                raise
            note = f"no structural model ({e}); black box instead"
            f = cost_model.fit(coll, None, samples, segment_bytes=seg[(coll, dt, op, column)])
        fits.append({**f.as_dict(), "column": column, "dtype": dt, "redop": op,
                     **({"note": note} if note else {})})
    return fits


def _fit_obj(d: dict) -> cost_model.Fit:
    names = {f.name for f in dataclasses.fields(cost_model.Fit)}
    kw = {k: v for k, v in d.items() if k in names}
    kw["fitted"] = tuple(kw["fitted"])
    kw["world_sizes"] = tuple(kw["world_sizes"])
    return cost_model.Fit(**kw)


def _by_group(fits: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for f in fits:
        groups.setdefault((f["collective"], f["dtype"], f["redop"]), []).append(f)
    return groups


def _fit_lines(coll: str, dt: str, op: str, fs: list[dict]) -> list[str]:
    """The fitted parameters of one (collective, dtype, op), one line per column."""
    sizes = sorted({p for f in fs for p in f["world_sizes"]})
    lines = [f"# {coll} {dt} {op}: fitted on world sizes {', '.join(str(p) for p in sizes)}"]
    w = max([8] + [len(f["column"]) for f in fs])
    lines.append(f"#   {'column':<{w}} {'o(us)':>8} {'alpha(us)':>10} {'beta(ns/B)':>11} "
                 f"{'=GB/s':>7} {'gamma(ns/B)':>12} {'rms err':>8}  fitted")
    for f in fs:
        bw = 1e-9 / f["beta"] if f["beta"] > 0 else float("inf")
        lines.append(f"#   {f['column']:<{w}} {f['o'] * 1e6:8.2f} {f['alpha'] * 1e6:10.2f} "
                     f"{f['beta'] * 1e9:11.4f} {bw:7.2f} {f['gamma'] * 1e9:12.4f} "
                     f"{f['rms_rel_err']:7.1%}  {','.join(f['fitted'])}"
                     + (f"  ({f['note']})" if f.get("note") else ""))
    return lines


def _prediction_lines(names: list[str], predictions: list[dict]) -> list[str]:
    """The table of predicted times: a heading, then one line per (world size, size)."""
    widths = {k: max(12, len(k)) for k in names}
    lines = ["#   predicted time (us) at larger world sizes (features counted "
             "from the schedules):",
             f"#   {'ranks':>6} {'size':>10} " + " ".join(f"{n:>{widths[n]}}" for n in names)
             + "   best"]
    for pr in predictions:
        ts = pr["time_us"]
        lines.append(f"#   {pr['world_size']:>6} {format_size(pr['size']):>10} "
                     + " ".join(f"{ts[k]:{widths[k]}.1f}" for k in names) + f"   {pr['best']}")
    return lines


def _crossover_line(c: dict) -> str:
    if c["changes"]:
        txt = f"{c['first']} first; " + "; ".join(
            f"{b} faster from {format_size(n)}" for n, b in c["changes"])
    elif c["first"] != "tie":
        txt = f"{c['first']} faster at every size"
    else:
        txt = "no crossover: within 2% of each other from 1 B to 64 GiB"
    return f"#   ring/tree crossover at {c['world_size']} ranks (model): {txt}"


def _crossover(tree: cost_model.Fit, ring: cost_model.Fit, p: int) -> tuple[str, list]:
    """Which of tree and ring is faster first on ``p`` ranks ("tie": neither), and
    ``[size, faster from there]`` for each change."""
    xs = cost_model.crossovers(tree, ring, p)
    if xs:
        return xs[0][1], [[n, b] for n, _, b in xs]
    grid = [1 << k for k in range(0, 37, 2)]
    faster = {"tree" if tree.predict(p, n) < ring.predict(p, n) else "ring" for n in grid}
    return (faster.pop() if len(faster) == 1 else "tie"), []


def model_report(fits: list[dict], predict_ranks: Sequence[int],
                 predict_sizes: Sequence[int]) -> tuple[str, dict]:
    """Text for the fitted models, predictions at other world sizes and ring/tree
    crossovers; and the same as a JSON-ready dict."""
    lines = list(_MODEL_HEADER)
    out: dict = {"fits": fits, "predictions": [], "crossovers": []}
    for (coll, dt, op), fs in _by_group(fits).items():
        lines += _fit_lines(coll, dt, op, fs)
        models = {f["column"]: _fit_obj(f) for f in fs
                  if f["algorithm"] and cost_model.has_model(coll, f["algorithm"])}
        if models and predict_ranks:
            preds = []
            for p in predict_ranks:
                for n in predict_sizes:
                    ts = {name: m.predict(p, n) for name, m in models.items()}
                    preds.append({"collective": coll, "dtype": dt, "redop": op,
                                  "world_size": p, "size": n,
                                  "time_us": {k: v * 1e6 for k, v in ts.items()},
                                  "best": min(ts, key=ts.get)})
            lines += _prediction_lines(list(models), preds)
            out["predictions"] += preds
        if "ring" in models and "tree" in models:
            for p in sorted({p for f in fs for p in f["world_sizes"]} | set(predict_ranks)):
                first, changes = _crossover(models["tree"], models["ring"], p)
                c = {"collective": coll, "dtype": dt, "redop": op, "world_size": p,
                     "source": "model", "first": first, "changes": changes}
                lines.append(_crossover_line(c))
                out["crossovers"].append(c)
    return "\n".join(lines), out


def model_text(report: dict) -> str:
    """The text of :func:`model_report` from its dict, as saved in a run's
    ``analysis.cost_model`` (no refit, no simulation)."""
    lines = list(_MODEL_HEADER)
    for key, fs in _by_group(report["fits"]).items():
        lines += _fit_lines(*key, fs)

        def mine(rec: dict) -> bool:
            return (rec["collective"], rec["dtype"], rec["redop"]) == key

        preds = [pr for pr in report["predictions"] if mine(pr)]
        if preds:
            lines += _prediction_lines(list(preds[0]["time_us"]), preds)
        lines += [_crossover_line(c) for c in report["crossovers"] if mine(c)]
    return "\n".join(lines)


def analyse(docs: list[dict], args: argparse.Namespace, out: Callable[[str], None]) -> dict:
    """Cost model, targets and tuning over result documents; prints through ``out``."""
    analysis: dict = {}
    results = docs[-1]["results"]
    p = int(docs[-1]["meta"]["world_size"])
    if args.targets:  # one run's side-by-side numbers (the last file's, offline)
        text, recs = check_targets(results, p, load_targets(args.targets))
        if text:
            out(text)
        analysis["targets"] = recs
    if not args.no_model:
        try:
            fits = fit_models(docs)
            text, summary = model_report(fits, args.predict_rank_list, args.predict_size_list)
            out(text)
            analysis["cost_model"] = summary
        except ValueError as e:
            out(f"# cost model: not fitted: {e}")
    table = measured_tuning(docs, args.tuning_tolerance)
    if table:
        out(tuning_report(table))
        analysis["measured_tuning"] = table
    if args.write_tuning:
        written, left_out = write_tuning(args.write_tuning, table)
        out(f"# wrote tuning for {', '.join(written) or 'nothing'} to {args.write_tuning}"
            + (f" (left out {', '.join(left_out)}: ringcomm's tuning has no such collective)"
               if left_out else ""))
    return analysis
