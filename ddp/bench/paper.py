"""The generated blocks of docs/paper-reproduction.md: Markdown renderings of a
``python -m ddp.bench --json`` result (schema ``ringcomm.bench_ddp/1``), and the
cost model's prediction of the gradient allreduce at larger world sizes from the
ring fit of a ``python -m ringcomm.bench`` result (``docs/data/compare_2ranks.json``).

:func:`blocks` returns them by name; ``scripts/doc_numbers.py`` writes them between
``<!-- generated:NAME begin -->`` and ``<!-- generated:NAME end -->``. Needs no
process group; results of older runs (without the trace parts) render too.
"""
from __future__ import annotations

import statistics

from typing import Sequence

from ringcomm.bench.analysis import model_report

from ddp.bench.report import cap_label

#: world sizes of the cost model's predictions (the paper went up to 256 GPUs)
PREDICT_RANKS = (8, 64, 256)


def _models(doc: dict, section: str) -> list[str]:
    return list(doc.get(section, {}))


def _table(head: Sequence[str], rows: list[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def run(doc: dict, source: str) -> str:
    m = doc["meta"]
    v, load = m["versions"], m["load_average"]
    models = "; ".join(f"{n}: {x['parameters'] / 1e6:.2f} M parameters, "
                       f"{x['gradient_mib']:.1f} MiB of gradients, batch {x['batch_per_rank']} "
                       "per rank" for n, x in m["models"].items())
    return "\n".join([
        f"Measured {m['started']}: {m['world_size']} ranks ({m['launcher']}) on {m['cores']} "
        f"cores ({m['cpu']}), {m['torch_threads_per_rank']} torch thread per rank; torch "
        f"{v['torch']}, {' '.join(v['mpi_library'].split())}. Models: {models}. "
        f"{m['timing']['iters']} timed iterations per configuration after "
        f"{m['timing']['warmup']} warm-up, interleaved in {m['timing']['rounds']} rounds. "
        "Load average (1, 5, 15 min) "
        + " ".join(f"{x:.2f}" for x in load["start"] or []) + " at the start, "
        + " ".join(f"{x:.2f}" for x in load["end"] or []) + " at the end"
        + (" (the whole run was recorded with `--trace`)" if m.get("trace") else "")
        + f". Source: `{source}`."])


def breakdown(doc: dict) -> str:
    parts = []
    for model in _models(doc, "breakdown"):
        rows = []
        for name, r in doc["breakdown"][model]["rows"].items():
            off = r["impl"] == "off"
            rows.append([f"`{name}`", f"{r['forward_ms']:.1f}",
                         f"{r['backward_ms' if off else 'backward_compute_ms']:.1f}",
                         "--" if off else f"{r['exposed_comm_ms']:.1f}",
                         f"{r['comm_ms']:.1f}" if off else "--", f"{r['optimizer_ms']:.1f}",
                         f"**{r['total_ms']:.1f}**",
                         "1" if off else "--" if r["buckets"] is None else str(r["buckets"])])
        parts.append(f"**{model}** (ms per iteration)\n\n" + _table(
            ["configuration", "forward", "backward compute", "exposed comm", "flat allreduce",
             "optimizer", "total", "buckets"], rows))
    return "\n\n".join(parts)


#: savings within this many percent count as no difference (run-to-run noise on a
#: shared 2-core machine is of this order)
NOISE_PCT = 2.0


def _verdict(saving_pct: float) -> str:
    if saving_pct >= NOISE_PCT:
        return "overlap helps"
    if saving_pct <= -NOISE_PCT:
        return "overlap hurts"
    return f"no difference beyond noise (±{NOISE_PCT:g}%)"


def overlap(doc: dict) -> str:
    lines = []
    for model in _models(doc, "breakdown"):
        for backend, o in doc["breakdown"][model]["overlap"].items():
            for impl, e in o.items():
                if not isinstance(e, dict):
                    continue
                verdict = _verdict(e["saving_pct"])
                hidden = ("" if e["hidden_comm_fraction"] is None else
                          f", {100 * e['hidden_comm_fraction']:.0f}% of the flat allreduce's "
                          "time hidden")
                lines.append(f"* {model}, `{impl}/{backend}`: {e['on_total_ms']:.1f} ms against "
                             f"{o['off_total_ms']:.1f} ms with overlap off (allreduce "
                             f"{o['off_comm_ms']:.1f} ms, {100 * o['comm_share_off']:.0f}% of "
                             f"it): {verdict} ({e['saving_pct']:+.1f}%{hidden}).")
    return "\n".join(lines)


def trace_parts(doc: dict) -> str:
    parts = []
    for model in _models(doc, "breakdown"):
        part = doc["breakdown"][model]
        t, b = part.get("trace_overhead"), part.get("trace_breakdown")
        if t:
            parts.append(f"* {model}: `{t['config']}` with a recording on "
                         f"{t['on_total_ms']:.1f} ms per iteration, off {t['off_total_ms']:.1f}"
                         f" ms: trace overhead {t['overhead_ms']:+.1f} ms "
                         f"({t['overhead_pct']:+.1f}%).")
        if b and not b.get("error"):
            w, m = b["wall_clock_ms"], b["ms"]
            keys = ("forward", "backward", "exposed_comm", "optimizer", "total")
            parts.append(f"\n**{model}**, `{b['config']}` (ms)\n\n" + _table(
                ["method", "forward", "backward", "exposed comm", "optimizer", "total"],
                [["wall clock: backward under no_sync(), exposed = the difference (medians)"]
                 + [f"{w[k]:.1f}" for k in keys],
                 ["trace spans, one iteration"] + [f"{m[k]:.1f}" for k in keys]]) + "\n")
    if not parts:
        return "This run has no trace overhead or trace-based breakdown (an older run)."
    return "\n".join(parts).strip()


def buckets(doc: dict) -> str:
    parts, pairs, smallest_slowest, inside = [], 0, 0, 0
    for model in _models(doc, "buckets"):
        rows = doc["buckets"][model]["rows"]
        configs = list(dict.fromkeys(r["config"] for r in rows))
        caps = list(dict.fromkeys(r["bucket_cap_mb"] for r in rows))
        by = {(r["config"], r["bucket_cap_mb"]): r for r in rows}
        best = {c: min((r for r in rows if r["config"] == c), key=lambda r: r["total_ms"])
                for c in configs}
        table = []
        for cap in caps:
            cells = []
            for c in configs:
                r = by[(c, cap)]
                nb = f" [{r['buckets']}]" if r["buckets"] is not None else ""
                val = f"{r['total_ms']:.1f}{nb}"
                cells.append(f"**{val}**" if r is best[c] else val)
            table.append([cap_label(cap)] + cells)
        for c in configs:
            mine = [r for r in rows if r["config"] == c]
            pairs += 1
            smallest_slowest += max(mine, key=lambda r: r["total_ms"])["bucket_cap_mb"] == caps[0]
            inside += best[c]["bucket_cap_mb"] not in (caps[0], caps[-1])
        optimum = "; ".join(f"`{c}` {cap_label(best[c]['bucket_cap_mb'])}" for c in configs)
        parts.append(f"**{model}** (ms per iteration; [buckets used]; fastest in bold)\n\n"
                     + _table(["bucket_cap_mb"] + [f"`{c}`" for c in configs], table)
                     + f"\n\nFastest cap: {optimum}.")
    if pairs:
        parts.append(f"Over the {pairs} (model, configuration) pairs: cap {cap_label(caps[0])} "
                     f"is the slowest for {smallest_slowest}, and the fastest cap lies strictly "
                     f"between the smallest and the largest for {inside}.")
    return "\n\n".join(parts)


def scaling(doc: dict) -> str:
    parts, fractions = [], []
    for model in _models(doc, "scaling"):
        rows = doc["scaling"][model]["rows"]
        configs = list(dict.fromkeys(r["config"] for r in rows))
        by = {(r["config"], r["world"]): r for r in rows}
        table = [[str(k)] + [f"{by[(c, k)]['samples_per_s']:.1f} "
                             f"({by[(c, k)]['scaling_fraction']:.2f})" for c in configs]
                 for k in sorted({r["world"] for r in rows})]
        top = max(r["world"] for r in rows)
        fractions += [by[(c, top)]["scaling_fraction"] for c in configs]
        parts.append(f"**{model}** (samples/s over all ranks, fraction of linear; batch "
                     f"{doc['scaling'][model]['batch_per_rank']} per rank)\n\n"
                     + _table(["ranks"] + [f"`{c}`" for c in configs], table))
    if fractions:
        parts.append(f"On {top} ranks: {min(fractions):.2f} to {max(fractions):.2f} of linear "
                     "scaling.")
    return "\n\n".join(parts)


def nosync(doc: dict) -> str:
    parts, speedups = [], []
    for model in _models(doc, "nosync"):
        rows = doc["nosync"][model]["rows"]
        configs = list(dict.fromkeys(r["config"] for r in rows))
        by = {(r["config"], r["n"]): r for r in rows}
        table = [[str(n)] + [f"{by[(c, n)]['amortized_ms']:.1f} "
                             f"({by[(c, n)]['speedup_vs_n1']:.2f}x)" for c in configs]
                 for n in sorted({r["n"] for r in rows})]
        last = max(r["n"] for r in rows)
        speedups += [by[(c, last)]["speedup_vs_n1"] for c in configs]
        parts.append(f"**{model}** (amortized ms per iteration, speed-up over n = 1)\n\n"
                     + _table(["n"] + [f"`{c}`" for c in configs], table))
    if speedups:
        parts.append(f"Synchronizing once every {last} iterations: speed-up "
                     f"{min(speedups):.2f}x to {max(speedups):.2f}x over every iteration, "
                     f"faster for {sum(x > 1 for x in speedups)} of {len(speedups)} "
                     "(model, configuration) pairs.")
    return "\n\n".join(parts)


def median_of_runs(runs: Sequence[tuple[dict, str]], ratios: Sequence[tuple[str, str, float]]
                   ) -> str:
    """Several runs of the breakdown side by side: per model, each run's ratio of one
    configuration's time per iteration to another's (``ratios``: of, versus, goal as
    an upper bound), then their median, which the verdict reads."""
    models = _models(runs[0][0], "breakdown")
    head = "| model | ratio | " + " | ".join(f"run {k + 1}" for k in range(len(runs))) \
        + " | median | goal |"
    rows = [head, "|---|---|" + "---:|" * (len(runs) + 2)]
    for model in models:
        for of, versus, goal in ratios:
            values = []
            for doc, _ in runs:
                r = doc["breakdown"][model]["rows"]
                values.append(r[of]["total_ms"] / r[versus]["total_ms"])
            mid = statistics.median(values)
            rows.append(f"| {model} | `{of}` / `{versus}` | "
                        + " | ".join(f"{v:.3f}x" for v in values)
                        + f" | **{mid:.3f}x** ({'met' if mid <= goal else 'missed'}) "
                          f"| <= {goal:g} |")
    rows += ["", "Runs: " + "; ".join(
        f"{k + 1}: `{source}` ({doc['meta']['started']})" for k, (doc, source) in enumerate(runs))
        + "."]
    return "\n".join(rows)


def targets(doc: dict, metrics: Sequence[str] = ("iteration_ratio", "overlap_saving")) -> str:
    """The run's target verdicts of the given metrics (a run of some sections only
    leaves the others' targets unmeasured: they are not listed)."""
    recs = [t for t in doc.get("targets", {}).get("results", []) if t["metric"] in metrics]
    if not recs:
        return "This run checked no speed targets."
    lines = []
    for t in recs:
        if t["met"] is None:
            lines.append(f"* {t['name']}: not measured.")
            continue
        e = t["per_model"][t["worst_model"]]
        shown = (f"saves {100 * e['value']:.1f}%" if t["metric"] == "overlap_saving"
                 else f"{e['value']:.3f}x")
        lines.append(f"* {t['name']}: **{'met' if t['met'] else 'missed'}** (worst model "
                     f"{t['worst_model']}: {e['of_ms']:.1f} ms against {e['versus_ms']:.1f} ms, "
                     f"{shown}; goal {t['bound']} {t['goal']:g}).")
    return "\n".join(lines)


#: what a verdict reads as in the round-robin tables
_MARK = {"faster": "faster", "slower": "slower", "no difference beyond noise": "same",
         "baseline": ""}


def roundrobin(doc: dict) -> str:
    """Per model and bucket cap: time per iteration against K for every configuration,
    median [q1, q3], speed-up over the smallest K and the verdict; then the counts."""
    parts, verdicts = [], []
    for model in _models(doc, "roundrobin"):
        part = doc["roundrobin"][model]
        rows, ks, base = part["rows"], part["channels"], part["base_k"]
        configs = list(dict.fromkeys(r["config"] for r in rows))
        by = {(r["config"], r["bucket_cap_mb"], r["k"]): r for r in rows}
        for cap in part["caps"]:
            table = []
            for c in configs:
                cells = []
                for k in ks:
                    r = by[(c, cap, k)]
                    cell = f"{r['total_ms']:.1f} [{r['q1_ms']:.1f}, {r['q3_ms']:.1f}]"
                    if k != base:
                        cell += f" {r['speedup_vs_k1']:.2f}x {_MARK[r['verdict']]}"
                        verdicts.append((model, cap, c, k, r["verdict"], r["speedup_vs_k1"]))
                    cells.append(cell)
                nb = by[(c, cap, base)]["buckets"]
                table.append([f"`{c}`", "--" if nb is None else str(nb)] + cells)
            parts.append(f"**{model}**, bucket_cap_mb {cap_label(cap)} (ms per iteration, "
                         f"median [q1, q3]; speed-up over K = {base}: faster, slower, or same "
                         "= no difference beyond noise)\n\n"
                         + _table(["configuration", "buckets"] + [f"K = {k}" for k in ks],
                                  table))
    if verdicts:
        n = len(verdicts)
        count = {v: sum(1 for x in verdicts if x[4] == v) for v in
                 ("faster", "slower", "no difference beyond noise")}
        sp = [x[5] for x in verdicts]
        parts.append(f"Over the {n} (model, bucket cap, configuration, K > {base}) cases: "
                     f"faster in {count['faster']}, slower in {count['slower']}, no difference "
                     f"beyond noise in {count['no difference beyond noise']}; speed-ups "
                     f"{min(sp):.2f}x to {max(sp):.2f}x. ("
                     + doc["roundrobin"][_models(doc, "roundrobin")[0]]["verdict_rule"] + ".)")
    return "\n\n".join(parts)


def roundrobin_mechanisms(doc: dict) -> str:
    """How each backend got its K communicators, and how many it really had."""
    models = _models(doc, "roundrobin")
    if not models:
        return "This run has no roundrobin section."
    part = doc["roundrobin"][models[0]]
    return "\n".join(f"* `{b}`: {m}. Communicators asked of each group: "
                     + ", ".join(f"K = {k}: {n}" for k, n in part["communicators"][b].items())
                     + "." for b, m in part["mechanism"].items())


def roundrobin_trace(doc: dict) -> str:
    """The traced iteration per K: how the bucket allreduces ran."""
    parts = []
    for model in _models(doc, "roundrobin"):
        t = doc["roundrobin"][model].get("trace")
        if not t:
            continue
        rows = []
        for k, e in t["per_k"].items():
            if "error" in e:
                rows.append([k, f"not available ({e['error']})"] + [""] * 8)
                continue
            m = e["median"]
            rows.append([k, str(m["allreduces"]), str(m["max_in_flight"]), str(m["threads"]),
                         f"{m['allreduce_sum_ms']:.1f}", f"{m['allreduce_union_ms']:.1f}",
                         f"{m['queued_sum_ms']:.1f}", f"{m['backward_ms']:.1f}",
                         f"{m['exposed_ms']:.1f}", f"{m['total_ms']:.1f}"])
        parts.append(f"**{model}**, `{t['config']}`, bucket_cap_mb "
                     f"{cap_label(t['bucket_cap_mb'])}, {t['iterations']} traced iterations "
                     "per K (ms; max over ranks, median over the iterations)\n\n" + _table(
                         ["K", "allreduces", "most in flight", "threads", "allreduce time "
                          "(sum)", "some allreduce running (union)", "queued (sum)", "backward",
                          "exposed", "iteration"], rows))
    if not parts:
        return "This run has no traced round-robin iteration."
    return "\n\n".join(parts)


def predictions(doc: dict, compare: dict, compare_source: str,
                ranks: Sequence[int] = PREDICT_RANKS) -> str:
    """Ring allreduce of each model's gradients (one flat buffer, as overlap off sends
    it) predicted by the cost model fitted to ``compare``, at ``ranks`` and at the
    measured world size, next to the measured flat allreduce and backward compute."""
    fits = [f for f in compare["analysis"]["cost_model"]["fits"]
            if f["collective"] == "allreduce" and f["column"] == "ring"
            and f["dtype"] == "float" and f["redop"] == "sum"]
    if not fits:
        return "The cost model has no ring allreduce fit."
    f = fits[0]
    p0 = doc["meta"]["world_size"]
    grads = {m: x["gradient_bytes"] for m, x in doc["meta"]["models"].items()}
    _, rep = model_report([f], [p0, *ranks], sorted(set(grads.values())))
    pred = {(pr["world_size"], pr["size"]): pr["time_us"]["ring"] / 1e3
            for pr in rep["predictions"]}
    models = list(grads)
    rows = []
    for p in (p0, *ranks):
        rows.append([str(p)] + [f"{pred[(p, grads[m])]:.1f}" for m in models])
    bd = doc.get("breakdown", {})
    b = doc["meta"]["default_group_backend"]
    off = f"off/{b}"
    if all(off in bd.get(m, {}).get("rows", {}) for m in models):
        rows.append([f"{p0}, measured: `{off}`'s flat allreduce (with flatten, copy-back)"]
                    + [f"{bd[m]['rows'][off]['comm_ms']:.1f}" for m in models])
        traced = [bd[m].get("trace_breakdown") or {} for m in models]
        if all("off" in t for t in traced):
            rows.append([f"{p0}, measured: `{off}`'s allreduce span in one traced iteration"]
                        + [f"{t['off']['ms']['allreduce']:.1f}" for t in traced])
        rows.append([f"{p0}, measured: `{off}`'s backward compute"]
                    + [f"{bd[m]['rows'][off]['backward_ms']:.1f}" for m in models])
    head = ["ranks"] + [f"{m} ({x / 2**20:.1f} MiB)" for m, x in grads.items()]
    return (_table(head, rows) + "\n\n"
            f"(ms; ring allreduce T = alpha*A + beta*B + gamma*G with A, B, G counted from "
            f"ringcomm's ring schedules; alpha = {f['alpha'] * 1e6:.1f} us, beta = "
            f"{f['beta'] * 1e9:.3f} ns/B ({1e-9 / f['beta']:.2f} GB/s), gamma = "
            f"{f['gamma'] * 1e9:.3f} ns/B, fitted at {', '.join(map(str, f['world_sizes']))} "
            f"ranks, {f['segment_bytes'] // 2**20} MiB segments, rms error "
            f"{100 * f['rms_rel_err']:.0f}%; from `{compare_source}`.)")


def blocks(doc: dict, source: str, compare: dict, compare_source: str,
           rr: dict | None = None, rr_source: str = "") -> dict[str, str]:
    """The generated blocks of docs/paper-reproduction.md, by name; with ``rr`` (a run
    of the roundrobin section, from ``rr_source``) also the round-robin blocks."""
    out = {"paper-run": run(doc, source), "paper-breakdown": breakdown(doc),
           "paper-overlap": overlap(doc), "paper-trace": trace_parts(doc),
           "paper-buckets": buckets(doc), "paper-scaling": scaling(doc),
           "paper-nosync": nosync(doc), "paper-targets": targets(doc),
           "paper-predictions": predictions(doc, compare, compare_source)}
    if rr is not None:
        out.update({"paper-rr-run": run(rr, rr_source),
                    "paper-rr-mechanisms": roundrobin_mechanisms(rr),
                    "paper-roundrobin": roundrobin(rr),
                    "paper-rr-trace": roundrobin_trace(rr),
                    "paper-rr-targets": targets(rr, ("roundrobin_ratio",))})
    return out
