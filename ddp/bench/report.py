"""The run's text on stdout: header, verification, one table per section."""
from __future__ import annotations

from typing import Any, Callable

from ringcomm.bench.links import text as links_text
from ringcomm.bench.sizes import format_size

from ddp.bench.constants import VERIFY_STEPS

def _over(meta: dict, k: int | None = None) -> str:
    k = k or meta["world_size"]
    return f" (OVERSUBSCRIBED: {k} ranks on {meta['cores']} cores)" if k > meta["cores"] else ""


def header_text(meta: dict) -> str:
    v = meta["versions"]
    lines = [
        f"# ringcomm bench_ddp {meta['started']}" + (" (quick)" if meta["quick"] else ""),
        f"# world: {meta['world_size']} ranks, launcher {meta['launcher']}, {meta['cores']} "
        f"cores ({meta['cpu']}), torch threads per rank {meta['torch_threads_per_rank']}"
        + _over(meta),
        *([f"# hosts: " + ", ".join(f"{h} x{n}" for h, n in meta["hosts"].items()),
           links_text(meta["links"])] if meta.get("links") else []),
        f"# versions: ringcomm {v['ringcomm']}, torch {v['torch']}, mpi4py {v['mpi4py']}, "
        f"{v['mpi_library']}, numpy {v['numpy']}, python {v['python']}",
        f"# configurations: {', '.join(meta['configurations'])} (implementation/backend; "
        f"{meta['default_group_backend']} is the default group, the others dist.new_group)",
    ]
    for name, m in meta["models"].items():
        lines.append(f"# model {name}: {m['description']}; {m['parameters'] / 1e6:.2f} M "
                     f"parameters in {m['parameter_tensors']} tensors, gradients "
                     f"{format_size(m['gradient_bytes'])}; batch {m['batch_per_rank']} "
                     f"{m['sample']} per rank")
    t = meta["timing"]
    lines += [f"# timing: {t['clock']}; warm-up {t['warmup']}, {t['iters']} timed iterations "
              f"in {t['rounds']} rounds across configurations; {t['statistic']}",
              f"# {t['exposed_comm']}",
              f"# {meta['overlap_off']}",
              f"# optimizer: {meta['optimizer']}",
              "# load average at start: " + " ".join(
                  f"{x:.2f}" for x in meta["load_average"]["start"] or [])
              + f" (other processes on these {meta['cores']} cores skew every number)"]
    return "\n".join(lines)


def verification_text(ver: dict) -> str:
    worst = max(max(v for k, v in r.items() if k.startswith("max_abs")) for m in ver.values()
                for r in m.values())
    n = sum(len(m) for m in ver.values())
    return (f"# verification: after {VERIFY_STEPS} steps the parameters of all {n} "
            f"(model, configuration) pairs agree across ranks and configurations "
            f"(max |diff| {worst:.2g}): OK")


def breakdown_text(model: str, part: dict, meta: dict) -> str:
    lines = ["#", f"# 1. latency breakdown per iteration, {model}, {meta['world_size']} ranks "
                  f"(ms)" + _over(meta),
             f"# {'configuration':<16} {'forward':>8} {'backward':>9} {'compute':>8} "
             f"{'exposed':>8} {'comm':>7} {'optim':>7} {'total':>8} {'buckets':>7}"]
    for name, r in part["rows"].items():
        if r["impl"] == "off":
            lines.append(f"  {name:<16} {r['forward_ms']:8.1f} {r['backward_ms']:9.1f} "
                         f"{r['backward_ms']:8.1f} {'--':>8} {r['comm_ms']:7.1f} "
                         f"{r['optimizer_ms']:7.1f} {r['total_ms']:8.1f} {1:>7}")
        else:
            nb = "--" if r["buckets"] is None else str(r["buckets"])
            lines.append(f"  {name:<16} {r['forward_ms']:8.1f} {r['backward_ms']:9.1f} "
                         f"{r['backward_compute_ms']:8.1f} {r['exposed_comm_ms']:8.1f} "
                         f"{'--':>7} {r['optimizer_ms']:7.1f} {r['total_ms']:8.1f} {nb:>7}")
    lines.append("# (compute = backward under no_sync(); exposed = backward - compute; comm = "
                 "overlap off's flat allreduce)")
    for b, o in part["overlap"].items():
        per = "; ".join(f"{impl} {e['on_total_ms']:.1f} ms saves {e['saving_ms']:.1f} ms "
                        f"({e['saving_pct']:.1f}%), hides "
                        + (f"{100 * e['hidden_comm_fraction']:.0f}%" if e["hidden_comm_fraction"]
                           is not None else "--") + " of the allreduce"
                        for impl, e in o.items() if isinstance(e, dict))
        lines.append(f"# overlap on vs off, {b}: off {o['off_total_ms']:.1f} ms (allreduce "
                     f"{o['off_comm_ms']:.1f} ms, {100 * o['comm_share_off']:.0f}%); {per}")
    lines += trace_lines(part)
    return "\n".join(lines)


def trace_lines(part: dict) -> list[str]:
    """The trace overhead and the breakdown read from one traced iteration, next to
    the wall-clock one (empty when the breakdown has neither)."""
    lines = []
    t = part.get("trace_overhead")
    if t:
        lines.append(f"# trace overhead, {t['config']}: recording off {t['off_total_ms']:.1f} ms, "
                     f"on {t['on_total_ms']:.1f} ms per iteration: {t['overhead_ms']:+.1f} ms "
                     f"({t['overhead_pct']:+.1f}%)")
    b = part.get("trace_breakdown")
    if b and b.get("error"):
        lines.append(f"# breakdown from the trace: not available ({b['error']})")
    elif b:
        w, m = b["wall_clock_ms"], b["ms"]
        lines += [f"# breakdown of {b['config']} by two methods (ms): {'forward':>8} "
                  f"{'backward':>9} {'exposed':>8} {'optim':>7} {'total':>8}",
                  f"#   wall clock, no_sync difference (medians) {w['forward']:8.1f} "
                  f"{w['backward']:9.1f} {w['exposed_comm']:8.1f} {w['optimizer']:7.1f} "
                  f"{w['total']:8.1f}",
                  f"#   trace spans, one iteration               {m['forward']:8.1f} "
                  f"{m['backward']:9.1f} {m['exposed_comm']:8.1f} {m['optimizer']:7.1f} "
                  f"{m['total']:8.1f}",
                  "#   (backward leaves out the exposed communication in both: wall clock = "
                  "backward under no_sync(); trace = first gradient hook to end of backward, "
                  "exposed = from there to end of copy-back)"]
        off = b.get("off")
        if off:
            o = off["ms"]
            lines.append(f"#   trace of {off['config']}, one iteration: forward {o['forward']:.1f}, "
                         f"allreduce {o['allreduce']:.1f}, optimizer {o['optimizer']:.1f}, "
                         f"total {o['total']:.1f}")
    return lines


def cap_label(cap: Any) -> str:
    return "one" if cap == "all" else str(cap)


def buckets_text(model: str, part: dict, meta: dict) -> str:
    configs = list(dict.fromkeys(r["config"] for r in part["rows"]))
    caps = list(dict.fromkeys(r["bucket_cap_mb"] for r in part["rows"]))
    lines = ["#", f"# 2. time per iteration (ms) against bucket_cap_mb, {model} "
                  "(0: one bucket per parameter; one: a cap above the model size; "
                  "[n]: buckets used)" + _over(meta),
             f"# {'cap (MB)':>8} " + " ".join(f"{c:>22}" for c in configs)]
    for cap in caps:
        cells = []
        for c in configs:
            r = next(r for r in part["rows"] if r["config"] == c and r["bucket_cap_mb"] == cap)
            nb = f"[{r['buckets']}]" if r["buckets"] is not None else ""
            cells.append(f"{r['total_ms']:15.1f} {nb:>6}")
        lines.append(f"  {cap_label(cap):>8} " + " ".join(cells))
    return "\n".join(lines)


def scaling_text(model: str, part: dict, meta: dict) -> str:
    configs = list(dict.fromkeys(r["config"] for r in part["rows"]))
    worlds = sorted({r["world"] for r in part["rows"]})
    lines = ["#", f"# 3. scaling, {model}: samples/s over all ranks (fraction of linear), "
                  f"batch {part['batch_per_rank']} per rank",
             f"# {'ranks':>5} " + " ".join(f"{c:>22}" for c in configs)]
    for k in worlds:
        cells = []
        for c in configs:
            r = next(r for r in part["rows"] if r["config"] == c and r["world"] == k)
            cells.append(f"{r['samples_per_s']:13.1f} ({r['scaling_fraction']:5.2f})")
        lines.append(f"  {k:>5} " + " ".join(cells) + _over(meta, k))
    return "\n".join(lines)


def nosync_text(model: str, part: dict, meta: dict) -> str:
    configs = list(dict.fromkeys(r["config"] for r in part["rows"]))
    lines = ["#", f"# 4. skipping synchronization, {model}: amortized ms per iteration with "
                  "no_sync() for n-1 of every n (speed-up over n=1)" + _over(meta),
             f"# {'n':>5} " + " ".join(f"{c:>22}" for c in configs)]
    for n in sorted({r["n"] for r in part["rows"]}):
        cells = []
        for c in configs:
            r = next(r for r in part["rows"] if r["config"] == c and r["n"] == n)
            cells.append(f"{r['amortized_ms']:13.1f} ({r['speedup_vs_n1']:5.2f}x)")
        lines.append(f"  {n:>5} " + " ".join(cells))
    return "\n".join(lines)


VERDICT_MARK = {"faster": "+", "slower": "-", "no difference beyond noise": "=",
                "baseline": " "}


def roundrobin_text(model: str, part: dict, meta: dict) -> str:
    configs = list(dict.fromkeys(r["config"] for r in part["rows"]))
    ks = part["channels"]
    by = {(r["config"], r["bucket_cap_mb"], r["k"]): r for r in part["rows"]}
    lines = ["#", f"# 5. round robin, {model}: ms per iteration with K communicators used in "
                  f"turn, median [q1, q3] (speed-up over K={part['base_k']}; + faster, - "
                  "slower, = no difference beyond noise)" + _over(meta)]
    for b, m in part["mechanism"].items():
        lines.append(f"#   {b}: {m}; communicators per K: "
                     + ", ".join(f"K={k}: {n}" for k, n in part["communicators"][b].items()))
    for cap in part["caps"]:
        nb = {c: by[(c, cap, ks[0])]["buckets"] for c in configs}
        lines.append(f"# bucket_cap_mb {cap_label(cap)} (buckets: "
                     + ", ".join(f"{c} {'--' if n is None else n}" for c, n in nb.items()) + ")")
        lines.append(f"# {'configuration':<16} " + " ".join(f"{'K=' + str(k):>31}" for k in ks))
        for c in configs:
            cells = []
            for k in ks:
                r = by[(c, cap, k)]
                cells.append(f"{r['total_ms']:7.1f} [{r['q1_ms']:6.1f},{r['q3_ms']:6.1f}] "
                             f"({r['speedup_vs_k1']:4.2f}x{VERDICT_MARK[r['verdict']]})")
            lines.append(f"  {c:<16} " + " ".join(f"{x:>31}" for x in cells))
    t = part.get("trace")
    if t:
        lines.append(f"# {t['iterations']} traced iterations of {t['config']} per K, "
                     f"bucket_cap_mb {cap_label(t['bucket_cap_mb'])} (max over ranks, median "
                     "over iterations; ms):")
        lines.append(f"#   {'K':>3} {'allreduces':>10} {'in flight':>9} {'threads':>7} "
                     f"{'sum':>8} {'union':>8} {'queued':>8} {'backward':>8} {'exposed':>8} "
                     f"{'total':>8}")
        for k, e in t["per_k"].items():
            if "error" in e:
                lines.append(f"#   {k:>3} not available ({e['error']})")
                continue
            m = e["median"]
            lines.append(f"    {k:>3} {m['allreduces']:>10} {m['max_in_flight']:>9} "
                         f"{m['threads']:>7} {m['allreduce_sum_ms']:8.1f} "
                         f"{m['allreduce_union_ms']:8.1f} {m['queued_sum_ms']:8.1f} "
                         f"{m['backward_ms']:8.1f} {m['exposed_ms']:8.1f} {m['total_ms']:8.1f}")
        lines.append("#   (sum: of the allreduces' durations; union: time at least one ran; "
                     "queued: enqueue to start, summed)")
    return "\n".join(lines)


def hooks_text(model: str, part: dict, meta: dict) -> str:
    lines = ["#", f"# 6. communication hooks, {model}: ms per iteration and what one iteration "
                  "hands to collectives per rank (x the same configuration's allreduce hook)"
             + _over(meta),
             f"#   wire: {part['wire_method']}",
             f"# {'configuration':<16} {'hook':<22} {'ms':>8} {'x':>6} {'collectives':>11} "
             f"{'wire MB':>9} {'x':>7}"]
    for r in part["rows"]:
        if "skipped" in r:
            lines.append(f"  {r['config']:<16} {r['hook']:<22} skipped: {r['skipped']}")
            continue
        wx = r["wire_vs_allreduce"]
        lines.append(f"  {r['config']:<16} {r['hook']:<22} {r['total_ms']:8.1f} "
                     f"{r['time_vs_allreduce']:6.2f} {r['collectives']:>11} "
                     f"{r['wire_bytes'] / 1e6:9.3f} {'--' if wx is None else f'{wx:.4f}':>7}")
    return "\n".join(lines)


def graph_text(model: str, part: dict, meta: dict) -> str:
    variants = list(dict.fromkeys(r["variant"] for r in part["rows"]))
    by = {(r["config"], r["variant"]): r for r in part["rows"]}
    lines = ["#", f"# 7. static graph, {model}: ms per iteration by DDP arguments (static_graph's "
                  "saving over find_unused_parameters)" + _over(meta),
             f"# {'configuration':<16} " + " ".join(f"{v:>22}" for v in variants)
             + f" {'saving':>8}"]
    for c, s in part["static_vs_find_unused"].items():
        cells = " ".join(f"{by[(c, v)]['total_ms']:22.1f}" for v in variants)
        lines.append(f"  {c:<16} {cells} {s['static_saving_pct']:7.1f}%")
    return "\n".join(lines)


SECTION_TEXT: dict[str, Callable[[str, dict, dict], str]] = {
    "breakdown": breakdown_text, "buckets": buckets_text, "scaling": scaling_text,
    "nosync": nosync_text, "roundrobin": roundrobin_text, "hooks": hooks_text,
    "graph": graph_text}
