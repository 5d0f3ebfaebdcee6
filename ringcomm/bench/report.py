"""How results are shown and saved: the nccl-tests style table on stdout (header,
per-group heading, one row per size, footer), the Markdown tables, the CSV, the
plot, and :func:`finish`, rank 0's report after a run (analysis, files, exit
status).

Everything here works from result dicts and the run's metadata (see
:mod:`ringcomm.bench.results`), so saved JSON renders the same way as a live run.
"""
from __future__ import annotations

import argparse
import csv
import json

from ringcomm.bench import styles
from ringcomm.bench.analysis import analyse
from ringcomm.bench.columns import Column
from ringcomm.bench.links import text as links_text
from ringcomm.bench.results import Point, group_keys, ok_points, points
from ringcomm.bench.sizes import Shape, format_size


# ----------------------------------------------------------------------------
# the table on stdout
# ----------------------------------------------------------------------------
def header_text(meta: dict, columns: list[Column], args: argparse.Namespace) -> str:
    """The lines above the tables: world, versions, device, settings, timing, columns."""
    v, d = meta["versions"], meta["device"]
    hosts = ", ".join(f"{h} x{n}" for h, n in meta["hosts"].items())
    runs = [c for c in columns if not c.skipped]
    skipped = [f"{c.name} ({c.skipped})" for c in columns if c.skipped]
    a = args
    iters = (f"-n {a.iters}" + (f" or more to fill {a.min_time:g} s (at most {a.max_iters})"
                                if a.min_time > 0 else ""))
    lines = [
        "# ringcomm compare_collectives " + meta["started"],
        f"# world: {meta['world_size']} ranks on {len(meta['hosts'])} host(s): {hosts}; "
        f"launcher {meta['launcher']}",
        *([links_text(meta["links"])] if meta.get("links") else []),
        f"# versions: ringcomm {v['ringcomm']}, torch {v['torch']}, mpi4py {v['mpi4py']}, "
        f"{v['mpi_library']}, numpy {v['numpy']}, python {v['python']}"
        + (f", cupy {v['cupy']}, NCCL {v['nccl']}" if v["cupy"] else ""),
        f"# device: {d['cpu']}, {d['cores']} cores, torch threads per rank "
        f"{d['torch_threads_per_rank']}" + (f"; CUDA {d['cuda']}" if d["cuda"] else "; no CUDA"),
        f"# ringcomm: segment {format_size(meta['ringcomm']['segment_bytes'])}, auto tuning "
        f"{meta['ringcomm']['tuning_file'] or 'built-in'}, "
        f"{meta['ringcomm'].get('num_channels', 1)} channel(s)",
        f"# timing: warm-up {a.warmup}, {iters}, in {a.rounds} rounds across the columns; "
        "time = max over ranks of each rank's median; algbw = size/time; "
        "busbw = algbw * nccl-tests factor",
        *([f"# concurrent: {a.concurrent} collectives in flight per timed call (each on its "
            "own buffers); time = all of them, algbw and busbw aggregate"]
          if a.concurrent > 1 else []),
        *(["# before each timed call: an MPI barrier (untimed)"
           + (f", then {gap_text(a.gap)} (untimed)" if a.gap else "")]
          if a.barrier_each or a.gap else []),
        "# load average at start: " + " ".join(f"{x:.2f}"
                                               for x in (meta["load_average"]["start"] or [])),
        "# columns: " + "; ".join(f"{c.name} = {c.describe()}" for c in runs),
    ]
    if skipped:
        lines.append("# skipped: " + "; ".join(skipped))
    return "\n".join(lines)


def gap_text(gap: dict) -> str:
    """What ``--gap`` pauses with, in words."""
    if "matmul" in gap:
        n = gap["matmul"]
        return f"a {n}x{n} fp32 matmul"
    if "busy_us" in gap:
        return f"a {gap['busy_us']:g} us busy wait"
    return f"a {gap['sleep_us']:g} us sleep"


def _width(c: Column, pick_width: int) -> int:
    return 10 + 1 + 7 + 1 + 7 + 1 + 6 + (pick_width + 1 if c.algo == "auto" else 0)


def table_heading(columns: list[Column], coll: str, dt: str, op: str, p: int,
                  pick_width: int) -> str:
    """The heading of one (collective, dtype, op) table: column names and units."""
    cols = [c for c in columns if not c.skipped]
    left = f"{'':>12} {'':>12} {'':>8} {'':>6} {'':>5} "
    pw = pick_width
    groups = "".join(f" {c.name + (' (pick)' if c.algo == 'auto' else ''):^{_width(c, pw)}}"
                     for c in cols)
    sub1 = "".join(f" {'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6}" +
                   (f" {'pick':>{pw}}" if c.algo == "auto" else "") for c in cols)
    sub2 = "".join(f" {'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}" +
                   (f" {'':>{pw}}" if c.algo == "auto" else "") for c in cols)
    return "\n".join([
        f"#\n# {coll}  dtype {dt}  op {op}  ({p} ranks)",
        "#" + left[1:] + groups,
        f"# {'size':>10} {'count':>12} {'type':>8} {'redop':>6} {'root':>5}" + sub1,
        f"# {'(B)':>10} {'(elements)':>12} {'':>8} {'':>6} {'':>5}" + sub2,
    ])


def table_row(columns: list[Column], sh: Shape, dt: str, op: str, root: int,
              row: dict[str, Point], pick_width: int) -> str:
    """One size: every column's time, algbw, busbw, wrong count (and auto's pick)."""
    out = f"  {sh.size:>10} {sh.count:>12} {dt:>8} {op:>6} {root:>5}"
    for c in columns:
        if c.skipped:
            continue
        pt = row[c.name]
        if pt.status == "ok":
            t = f"{pt.time_us:10.2f}" if pt.time_us < 1e6 else f"{pt.time_us:10.0f}"
            w = "N/A" if pt.wrong is None else str(pt.wrong)
            out += f" {t} {pt.algbw:7.3f} {pt.busbw:7.3f} {w:>6}"
        else:
            label = {"unsupported": "unsupp", "error": "ERROR"}.get(pt.status, pt.status)
            out += f" {label:>10} {'--':>7} {'--':>7} {'--':>6}"
        if c.algo == "auto":
            out += f" {(pt.auto_choice or '--'):>{pick_width}}"
    return out


def table_footer(columns: list[Column], results: list[dict], coll: str, dt: str,
                 op: str) -> str:
    """Under one table: why columns did not run, the wrong-value total, average busbw."""
    lines = []
    wrong_total, checked = 0, False
    for c in columns:
        if c.skipped:
            continue
        pts = points(results, coll, dt, op, c.name)
        bad = [r for r in pts if r["status"] in ("unsupported", "error")]
        if bad:
            lines.append(f"# {c.name}: {bad[0]['status']}: {bad[0]['reason']}")
        for r in pts:
            if r["wrong"] is not None:
                checked = True
                wrong_total += r["wrong"]
    if checked:
        lines.append(f"# wrong values in total: {wrong_total} "
                     f"{'OK' if wrong_total == 0 else 'FAILED'}")
    avg = []
    for c in columns:
        bws = [r["busbw"] for r in points(results, coll, dt, op, c.name) if r["status"] == "ok"]
        if bws:
            avg.append(f"{c.name} {sum(bws) / len(bws):.3f}")
    if avg:
        lines.append("# average busbw (GB/s): " + ", ".join(avg))
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------
def write_csv(path: str, results: list[dict]) -> None:
    """One row per (collective, size, dtype, op, column)."""
    fields = ["collective", "size", "count", "dtype", "redop", "root", "column", "status",
              "time_us", "algbw", "busbw", "wrong", "iters", "auto_choice", "reason"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerow(r)


def markdown_tables(doc: dict, heading: str = "####") -> str:
    """One Markdown table per (collective, dtype, op): time (us) and busbw (GB/s) of
    every column by size, and what auto ran; each under a ``heading`` line."""
    results = doc["results"]
    columns = [c["name"] for c in doc["meta"]["columns"] if not c["skipped"]]
    out = []
    for coll, dt, op in group_keys(results):
        rows = [r for r in results if (r["collective"], r["dtype"], r["redop"]) == (coll, dt, op)]
        cols = [c for c in columns if any(r["column"] == c and r["status"] == "ok" for r in rows)]
        missing = [c for c in columns if c not in cols]
        has_auto = "auto" in cols
        out.append(f"{heading} {coll}, {dt}" + (f", {op}" if op != "none" else "")
                   + f", {doc['meta']['world_size']} ranks\n")
        head = (["size"] + [f"{c} us" for c in cols] + [f"{c} GB/s" for c in cols]
                + (["auto ran"] if has_auto else []))
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join("---:" for _ in head) + "|")
        for size in sorted({r["size"] for r in rows}):
            cell = {r["column"]: r for r in rows if r["size"] == size}
            ok = {c: cell[c] for c in cols if c in cell and cell[c]["status"] == "ok"}
            t = [f"{ok[c]['time_us']:.1f}" if c in ok else "--" for c in cols]
            bw = [f"{ok[c]['busbw']:.3f}" if c in ok else "--" for c in cols]
            pick = [ok["auto"].get("auto_choice") or "--"] if has_auto and "auto" in ok else (
                ["--"] if has_auto else [])
            out.append("| " + " | ".join([format_size(size), *t, *bw, *pick]) + " |")
        if missing:
            reasons = {r["column"]: r["reason"] for r in rows if r["status"] != "ok"}
            out.append("\nNot measured: " + "; ".join(f"{c} ({reasons.get(c, 'no data')})"
                                                       for c in missing) + ".")
        out.append("")
    return "\n".join(out)


def write_markdown(path: str, doc: dict) -> None:
    """Write :func:`markdown_tables` of ``doc`` to ``path``."""
    with open(path, "w") as f:
        f.write(markdown_tables(doc))


#: what the plot's caption says of a peer column, where one ran
_CAPTIONS = {
    "floor": "floor: dist.all_reduce into a do-nothing process group plus MPI's own "
             "allreduce, the least a collective written in Python can take",
    "deepspeed": "deepspeed: DeepSpeed's shared-memory allreduce op, called without "
                 "torch's dispatch",
    "mpi": "mpi: the MPI library's own collective",
}


def plot(path: str, doc: dict) -> None:
    """busbw vs size and time vs size, one panel pair per (collective, dtype, op); one
    legend below the panels (it covers no line) and a caption saying how the calls
    were timed and what the peers are."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, meta = doc["results"], doc["meta"]
    keys = group_keys(results)
    columns = [c["name"] for c in meta["columns"] if not c["skipped"]]
    columns_drawn = [c for c in columns if any(ok_points(results, *k, c) for k in keys)]
    notes_h = 0.17 * (1 + sum(1 for n in _CAPTIONS if n in columns_drawn)) + 0.05
    legend_h = 0.25 * -(-len(columns_drawn) // 8)
    bottom = notes_h + legend_h + 0.15  # inches below the panels: legend, then caption
    height = 4.2 * len(keys) + 0.3 + bottom
    fig, axes = plt.subplots(len(keys), 2, figsize=(12, height), squeeze=False)
    p = meta["world_size"]
    drawn: dict[str, object] = {}
    for (coll, dt, op), (ax_bw, ax_t) in zip(keys, axes):
        sizes = []
        for c in columns:
            pts = ok_points(results, coll, dt, op, c)
            if not pts:
                continue
            x = [r["size"] for r in pts]
            sizes += x
            # the column's own look (by name), the same in every panel and figure
            style = dict(markersize=4, linewidth=1.5, **styles.style(c))
            drawn[c], = ax_bw.plot(x, [r["busbw"] for r in pts], label=c, **style)
            ax_t.plot(x, [r["time_us"] for r in pts], label=c, **style)
        title = f"{coll} {dt}" + (f" {op}" if op != "none" else "") + f", {p} ranks"
        for ax, ylab in ((ax_bw, "bus bandwidth (GB/s)"), (ax_t, "time per call (us)")):
            styles.size_axis(ax, sizes)
            ax.set_ylabel(ylab)
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
        ax_t.set_yscale("log")
    timing = meta.get("timing", {})
    how = ("each call after " + gap_text(timing["gap"]) if timing.get("gap") else
           "each call after an MPI barrier" if timing.get("barrier_each") else
           "calls back to back")
    notes = [f"time: max over ranks of each rank's median, {how}"]
    notes += [text for name, text in _CAPTIONS.items() if name in drawn]
    fig.suptitle(f"compare_collectives: {meta['device']['cpu']}, {meta['started']}", fontsize=9)
    fig.legend(list(drawn.values()), list(drawn), loc="lower center",
               ncol=max(1, min(len(drawn), 8)), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, notes_h / height))
    fig.text(0.5, 0.02 / height, "\n".join(notes), ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, (bottom + 0.1) / height, 1, 1 - 0.3 / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finish(doc: dict, args: argparse.Namespace) -> int:
    """Rank 0 after the run: analysis, files. Returns the exit status (1: wrong values
    or errors)."""
    doc["analysis"] = analyse([doc], args, lambda s: print(s, flush=True))
    wrong = sum(r["wrong"] or 0 for r in doc["results"])
    errors = [r for r in doc["results"] if r["status"] == "error"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.csv:
        write_csv(args.csv, doc["results"])
    if args.plot:
        plot(args.plot, doc)
    if args.markdown:
        write_markdown(args.markdown, doc)
    end = doc["meta"]["load_average"]["end"] or []
    print(f"# load average at end: {' '.join(f'{x:.2f}' for x in end)}", flush=True)
    if wrong:
        print(f"# FAILED: {wrong} wrong values", flush=True)
    if errors:
        print(f"# FAILED: {len(errors)} measurements ended in an error", flush=True)
    return 1 if wrong or errors else 0
