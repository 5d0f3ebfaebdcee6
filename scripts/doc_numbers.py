"""Write the benchmark numbers in README.md and docs/benchmarks.md from committed
result JSON, so the docs never state a number that no file backs; and README.md's
settings table from ``ringcomm/settings.py``.

    python scripts/doc_numbers.py                  # rewrite the generated blocks
    python scripts/doc_numbers.py --check          # exit 1 if a block is stale

README.md's block sits between ``<!-- bench:begin -->`` and ``<!-- bench:end -->``
and is made by :func:`render`. docs/benchmarks.md has several blocks, each
between ``<!-- generated:NAME begin -->`` and ``<!-- generated:NAME end -->``,
made by :func:`benchmarks_blocks`. Both come from ``docs/data/compare_2ranks.json``
(a ``python -m ringcomm.bench --json`` result, rendered with the benchmark's own
report functions); the layer table comes from ``docs/data/layers_2ranks.json``
(``scripts/bench_layers.py --json``), the concurrent table from
``docs/data/concurrent_2ranks.json`` (``--concurrent`` runs, one per number of
channels) and the list of shipped speed targets from
``ringcomm/bench/targets.json``. The settings table sits between
``<!-- settings:begin -->`` and ``<!-- settings:end -->``
(:func:`ringcomm.settings.render_into`). docs/paper-reproduction.md (``--paper``;
``none`` skips it) has ``generated:paper-*`` blocks made by
:func:`ddp.bench.paper.blocks` from ``docs/data/bench_ddp_2ranks.json``
(``python -m ddp.bench --json``), its round-robin blocks (``generated:paper-rr-*``,
``generated:paper-roundrobin``) from ``docs/data/bench_ddp_roundrobin_2ranks.json``
(a run of the roundrobin section alone, ``--sections roundrobin``), and its
cost-model predictions from the ring fit in ``docs/data/compare_2ranks.json``.
docs/multi-node.md's ``generated:multinode-*`` blocks come from
``docs/data/multinode.json`` and ``docs/data/bench_ddp_2hosts.json``
(``scripts/bench_hosts.py [--ddp]``: runs across namespace hosts).
docs/msccl.md's ``generated:msccl-run`` block comes from
``docs/data/msccl_2ranks.json`` (``python -m ringcomm.bench --msccl ...``), its
``generated:msccl-tools`` block from ``docs/data/msccl_tools.json``
(``scripts/msccl_tools_check.py``). docs/simulator.md's ``generated:sim-*`` blocks
come from ``ringcomm/sim/software.json``, ``docs/data/sim_speed.json``
(``scripts/bench_sim.py``) and ``docs/data/sim_published.json``
(``scripts/sim_published.py``).
Needs ringcomm importable (an installed checkout, or ``PYTHONPATH`` set to it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this checkout's ddp/ (ddp.bench renders the paper's blocks)
    sys.path.insert(0, str(ROOT))

import ringcomm  # noqa: E402
from ringcomm import library, settings  # noqa: E402
from ringcomm.bench.analysis import model_text  # noqa: E402
from ringcomm.bench.columns import Column  # noqa: E402
from ringcomm.bench.report import markdown_tables, table_heading, table_row  # noqa: E402
from ringcomm.bench.results import Point  # noqa: E402
from ringcomm.bench.sizes import Shape, format_size  # noqa: E402
from ringcomm.bench.targets import (DEFAULT_TARGETS, check_targets, load_targets,  # noqa: E402
                                    recorded_targets)
from ringcomm.bench.tuning import tuning_report  # noqa: E402

from ddp.bench import paper  # noqa: E402
from ddp.bench.report import graph_text, hooks_text  # noqa: E402

DATA = ROOT / "docs" / "data" / "compare_2ranks.json"
LAYERS = ROOT / "docs" / "data" / "layers_2ranks.json"
#: scripts/bench_layers.py --algo shm_direct at three sizes: where one host's allreduce
#: time goes above the program
LAYERS_SHM = [ROOT / "docs" / "data" / f"layers_shm_direct_{n}B_2ranks.json"
              for n in (4096, 262144, 1048576)]
CONCURRENT = ROOT / "docs" / "data" / "concurrent_2ranks.json"
ONE_HOST_BARRIER = ROOT / "docs" / "data" / "allreduce_one_host_2ranks_barrier.json"
#: the allreduce timed four ways (ringcomm.bench without a pause, --barrier-each,
#: --gap 100, --gap compute), and layer by layer without and with a pause
PAUSE_MODES = (("back to back", "back_to_back"), ("barrier before each", "barrier"),
               ("100 us sleep before each", "gap100"), ("256x256 matmul before each", "compute"))
PAUSE = {key: ROOT / "docs" / "data" / f"pause_2ranks_{key}.json" for _, key in PAUSE_MODES}
LAYERS_PAUSE = {(algo, gap): ROOT / "docs" / "data" / f"layers_pause_{algo}_{gap}_2ranks.json"
                for algo in ("recursive_doubling", "shm_direct")
                for gap in ("none", "busy100", "100", "compute")}
#: scripts/bench_barrier.py's JSON: barriers' exit skew and release beside MPI's and gloo's
BARRIER = ROOT / "docs" / "data" / "barrier_2ranks.json"
#: scripts/bench_steps.py's JSON: single steps of the short path, back to back and
#: after a pause
STEPS = ROOT / "docs" / "data" / "steps_pause.json"
#: scripts/bench_cuda_path.py's JSON: the CUDA lane's Python per collective
CUDA_PATH = ROOT / "docs" / "data" / "cuda_path.json"
AUTO_AT_SCALE = ROOT / "docs" / "data" / "auto_at_scale.json"
DDP_DATA = ROOT / "docs" / "data" / "bench_ddp_2ranks.json"
DDP_RR_DATA = ROOT / "docs" / "data" / "bench_ddp_roundrobin_2ranks.json"
#: the latency breakdown of every ddp.bench model, the short path's DDP measurement
DDP_SHORT_DATA = ROOT / "docs" / "data" / "bench_ddp_short_path.json"
#: the paper's models, ddp/ against torch's DDP, 40 interleaved iterations, checked
#: against the shipped ddp/bench/targets.json
DDP_LOOP_DATA = ROOT / "docs" / "data" / "bench_ddp_loop_2ranks.json"
#: the same command run twice before it: the DDP targets read the median of the three
DDP_LOOP_RUNS = [*(ROOT / "docs" / "data" / f"bench_ddp_loop_2ranks_run{k}.json" for k in (1, 2)),
                 DDP_LOOP_DATA]
DDP_HOOKS_DATA = ROOT / "docs" / "data" / "bench_ddp_hooks_2ranks.json"
DDP_SHM_DATA = ROOT / "docs" / "data" / "bench_ddp_shm_2ranks.json"
MULTINODE = ROOT / "docs" / "data" / "multinode.json"
MULTINODE_DDP = ROOT / "docs" / "data" / "bench_ddp_2hosts.json"
#: python -m ringcomm.bench --msccl ...: imported MSCCL algorithms next to the built-ins
MSCCL_RUN = ROOT / "docs" / "data" / "msccl_2ranks.json"
#: scripts/msccl_tools_check.py: msccl-tools' own examples loaded, proven and run
MSCCL_TOOLS = ROOT / "docs" / "data" / "msccl_tools.json"
#: scripts/bench_sim.py: what the simulator itself takes at 1,024 and 16,384 ranks
SIM_SPEED = ROOT / "docs" / "data" / "sim_speed.json"
SIM_SOFTWARE = ROOT / "ringcomm" / "sim" / "software.json"
#: python -m ringcomm.sim on the 1,024-GPU fat tree: which algorithm wins where
SIM_STUDY = ROOT / "docs" / "data" / "sim_fat_tree_1024.json"
#: scripts/validate_sim.py: predicted against measured on emulated clusters
SIM_VALIDATION = ROOT / "docs" / "data" / "sim_validation.json"
#: scripts/sim_published.py: the simulator beside published measurements
SIM_PUBLISHED = ROOT / "docs" / "data" / "sim_published.json"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _pick(results: list[dict], size: int, column: str) -> dict | None:
    for r in results:
        if (r["collective"] == "allreduce" and r["size"] == size and r["column"] == column
                and r["dtype"] == "float" and r.get("status") == "ok"):
            return r
    return None


def render(doc: dict, source: str) -> str:
    """The README block: 4 KiB latency and 1 MiB / 64 MiB bus bandwidth of allreduce
    for ringcomm's auto choice, its ring, gloo, MPI's own collective and the floor."""
    res = doc["results"]
    cols = [("ringcomm auto", "auto"), ("ringcomm ring", "ring"), ("gloo", "gloo"),
            ("MPICH `Allreduce`", "mpi"), ("floor", "floor")]
    cols = [(label, c) for label, c in cols if any(r["column"] == c for r in res)]

    def cell(size: int, column: str, what: str) -> str:
        r = _pick(res, size, column)
        if r is None or (column == "floor" and what != "time"):  # a latency bound only
            return "-"
        if what == "time":
            return f"{r['time_us']:.1f} us"
        return f"{r['busbw']:.2f} GB/s"

    meta = doc.get("meta", {})
    lines = [f"| allreduce, fp32, {meta.get('world_size', 2)} ranks | "
             + " | ".join(label for label, _ in cols) + " |",
             "|---|" + "---:|" * len(cols),
             "| 4 KiB time per call | " + " | ".join(cell(4096, c, "time") for _, c in cols) + " |",
             "| 1 MiB bus bandwidth | " + " | ".join(cell(1 << 20, c, "bw") for _, c in cols)
             + " |",
             "| 64 MiB bus bandwidth | " + " | ".join(cell(64 << 20, c, "bw") for _, c in cols)
             + " |"]
    targets = doc.get("analysis", {}).get("targets") or []
    if isinstance(targets, dict):
        targets = targets.get("targets", [])
    verdicts = []
    for t in targets:
        if not isinstance(t, dict) or not t.get("name"):
            continue
        met = t.get("met")
        verdict = "not measured" if met is None else "met" if met else "missed"
        detail = ""
        if met is not None and t.get("value") is not None:
            unit = "x" if t.get("versus") else (" us" if t.get("metric") == "time_us" else " GB/s")
            detail = f" ({t['value']:.2f}{unit}"
            if t.get("worst_size") is not None and len(t.get("sizes", [])) > 1:
                detail += f", worst at {format_size(t['worst_size'])}"
            detail += ")"
        verdicts.append(f"{t['name']}: **{verdict}**{detail}")
    out = "\n".join(lines)
    if verdicts:
        out += "\n\nSpeed targets of this run: " + "; ".join(verdicts) + "."
    started = meta.get("started", "?")
    return (f"{out}\n\n(Generated by `scripts/doc_numbers.py` from `{source}`, measured "
            f"{started}; `floor` = `dist.all_reduce` into a do-nothing process group plus "
            "MPI's own Allreduce.)")


# ----------------------------------------------------------------------------
# docs/benchmarks.md
# ----------------------------------------------------------------------------
def _example(doc: dict) -> str:
    """An excerpt of a run's table on stdout: allreduce at 4 KiB and 64 MiB, ring and auto."""
    meta = doc["meta"]
    columns = [Column(**c) for c in meta["columns"] if c["name"] in ("ring", "auto")]
    pick_width = max([5] + [len(n) for n in ringcomm.REGISTRY["allreduce"]])
    fields = {f.name for f in dataclasses.fields(Point)}
    p = meta["world_size"]
    lines = [table_heading(columns, "allreduce", "float", "sum", p, pick_width)]
    for size in (4096, 64 << 20):
        cells = [r for r in doc["results"] if (r["collective"], r["dtype"], r["redop"],
                                               r["size"]) == ("allreduce", "float", "sum", size)]
        row = {r["column"]: Point(**{k: v for k, v in r.items() if k in fields}) for r in cells}
        if all(c.name in row for c in columns):
            shape = Shape("allreduce", size, cells[0]["count"], cells[0]["count"])
            lines.append(table_row(columns, shape, "float", "sum", -1, row, pick_width))
    return "```\n" + "\n".join(lines) + "\n```"


def _run(doc: dict, source: str) -> str:
    """How and where the committed run was made."""
    meta = doc["meta"]
    v, d, rc = meta["versions"], meta["device"], meta["ringcomm"]
    p = meta["world_size"]
    launch = (f"torchrun --nproc-per-node {p}" if meta["launcher"] == "torchrun"
              else f"mpiexec -n {p} python")
    hosts = (f"{len(meta['hosts'])} host(s) ("
             + ", ".join(f"{h}: {n} ranks" for h, n in meta["hosts"].items()) + ")")
    wrong = sum(r["wrong"] or 0 for r in doc["results"])
    checked = any(r["wrong"] is not None for r in doc["results"])
    load = meta["load_average"]
    return "\n".join([
        f"Measured {meta['started']} with (the command line is the JSON's `meta.argv`)",
        "",
        "```sh",
        f"{launch} -m ringcomm.bench {shlex.join(meta['argv'])}",
        "```",
        "",
        f"* Machine: {d['cpu']}, {d['cores']} cores, {p} ranks on {hosts}; "
        f"{d['torch_threads_per_rank']} torch thread(s) per rank"
        + (f"; CUDA {d['cuda']}" if d["cuda"] else "") + ".",
        f"* Versions: ringcomm {v['ringcomm']}, torch {v['torch']}, mpi4py {v['mpi4py']}, "
        f"{' '.join(v['mpi_library'].split())}, numpy {v['numpy']}, python {v['python']}.",
        f"* ringcomm: {format_size(rc['segment_bytes'])} segments, "
        f"{'tuning file ' + rc['tuning_file'] if rc['tuning_file'] else 'built-in tuning'}.",
        ("* Results checked (`-c`): " + f"{wrong} wrong values in all columns." if checked
         else "* Results not checked (no `-c`).")
        + f" Load average {' '.join(f'{x:.2f}' for x in load['start'] or [])} at the start, "
        f"{' '.join(f'{x:.2f}' for x in load['end'] or [])} at the end.",
        f"* Source: `{source}` (generated by `scripts/doc_numbers.py`).",
    ])


def _targets(doc: dict) -> str:
    """The speed-target lines of the run, recomputed from its results and the targets
    it recorded (``analysis.targets``)."""
    recs = doc.get("analysis", {}).get("targets") or []
    if not recs:
        return "This run checked no speed targets."
    text, _ = check_targets(doc["results"], doc["meta"]["world_size"], recorded_targets(recs))
    return "```\n" + text + "\n```"


def _model(doc: dict) -> str:
    """The cost model and measured tuning as the run printed them (from its ``analysis``)."""
    analysis = doc.get("analysis", {})
    parts = []
    if analysis.get("cost_model"):
        parts.append(model_text(analysis["cost_model"]))
    if analysis.get("measured_tuning"):
        parts.append(tuning_report(analysis["measured_tuning"]))
    if not parts:
        return "This run fitted no cost model."
    return "```\n" + "\n".join(parts) + "\n```"


def _layers(layers: dict, source: str) -> str:
    """The layer-by-layer table of ``scripts/bench_layers.py``."""
    head = (f"| layer ({format_size(layers['bytes'])} allreduce, "
            f"{layers['algorithm'].replace('_', ' ')}, {layers['world_size']} ranks) "
            "| time per call |")
    rows = [f"| {r['layer']} | {r['time_us']:.1f} us |" for r in layers["rows"]]
    return "\n".join([head, "|---|---:|", *rows, "",
                      f"(From `{source}`, measured {layers['started']}.)"])


def _flight_cost(layers: dict, source: str) -> str:
    """What the flight recorder costs ``dist.all_reduce`` (the last two rows of
    ``scripts/bench_layers.py``)."""
    off, on = layers["rows"][-2], layers["rows"][-1]
    if "flight recorder" not in on["layer"]:
        return (f"(`{source}` has no row with the flight recorder on: run "
                "scripts/bench_layers.py --flight)")
    return (f"| {format_size(layers['bytes'])} allreduce, {layers['world_size']} ranks | "
            "time per call |\n|---|---:|\n"
            f"| `dist.all_reduce` | {off['time_us']:.1f} us |\n"
            f"| {on['layer']} | {on['time_us']:.1f} us "
            f"({on['time_us'] / off['time_us'] - 1:+.0%}) |\n\n"
            f"(From `{source}`, measured {layers['started']}.)")


def _layers_sizes(runs: list[tuple[dict, str]]) -> str:
    """``scripts/bench_layers.py`` of one algorithm at several sizes: the program's
    time (its messages and local work), each layer above it, and what they add
    together (torch's dispatch and the group's per-call Python)."""
    algo = runs[0][0]["algorithm"]
    heads = [format_size(doc["bytes"]) for doc, _ in runs]
    per = [{r["layer"].split(" (")[0]: r["time_us"] for r in doc["rows"]} for doc, _ in runs]
    program = next(k for k in per[0] if k.startswith("the program"))
    names = list(per[0])
    peers = []  # every run's peers, in order, each once
    for doc, _ in runs:
        for x in doc.get("peers", names[:1]):
            if x.split(" (")[0] not in peers:
                peers.append(x.split(" (")[0])
    rows = [f"| layer ({algo} allreduce, 2 ranks) | " + " | ".join(heads) + " |",
            "|---" + "|---:" * len(heads) + "|"]
    for name in [*peers, *names[names.index(program):]]:
        rows.append(f"| {name} | " + " | ".join(_us(p[name]) if name in p else "-"
                                                for p in per) + " |")
    rows.append("| above the program: dispatch and per-call Python | "
                + " | ".join(_us(p[names[-1]] - p[program]) for p in per) + " |")
    sources = ", ".join(f"`{src}` ({doc['started']})" for doc, src in runs)
    return "\n".join([*rows, "", f"(From {sources}.)"])


def _shipped_targets() -> str:
    """The targets in the package's targets file: name, what they apply to, why."""
    return "\n".join(f"* **{t['name']}** ({t['collective']} {t['dtype']} {t['redop']}"
                     + (f", stated for {t['ranks']} ranks" if t.get("ranks") else "") + ")"
                     + (f": {t['why']}" if t.get("why") else "")
                     for t in load_targets(DEFAULT_TARGETS))


def _concurrent(conc: dict, source: str) -> str:
    """The ``--concurrent`` table: per size, the time of the N collectives and their
    aggregate bus bandwidth, for each run's number of channels K."""
    runs = sorted(conc["runs"].items(), key=lambda kv: int(kv[0]))
    first = runs[0][1]
    n = first["meta"]["timing"]["concurrent"]
    cols = [(f"ringcomm auto, K={k}", doc, "auto") for k, doc in runs]
    cols += [(f"gloo, K={k} groups", doc, "gloo") for k, doc in runs]
    cols.append(("MPICH non-blocking", first, "mpi"))
    sizes = sorted({r["size"] for r in first["results"] if r["collective"] == "allreduce"})
    rows = [f"| allreduce, fp32, {n} at once | " + " | ".join(c[0] for c in cols) + " |",
            "|---" + "|---:" * len(cols) + "|"]
    for size in sizes:
        cells = []
        for _, doc, column in cols:
            r = _pick(doc["results"], size, column)
            cells.append("-" if r is None else f"{r['time_us'] / 1e3:.2f} ms, {r['busbw']:.2f} GB/s")
        rows.append(f"| {format_size(size)} | " + " | ".join(cells) + " |")
    wrong = sum(r.get("wrong") or 0 for _, doc in runs for r in doc["results"])
    started = ", ".join(doc["meta"]["started"] for _, doc in runs)
    rows.append("")
    rows.append(f"Each cell: the time of all {n} collectives and their aggregate bus "
                f"bandwidth; wrong values: {wrong}. (Generated by `scripts/doc_numbers.py` "
                f"from `{source}`, runs started {started}.)")
    return "\n".join(rows)


# ----------------------------------------------------------------------------
# docs/multi-node.md
# ----------------------------------------------------------------------------
_FLAT = ("ring", "tree", "recursive_doubling", "rabenseifner")


def _ms(us: float) -> str:
    return f"{us / 1e3:.2f} ms" if us >= 1000 else f"{us:.0f} us"


def _multinode_run(run: dict) -> str:
    """One setup of scripts/bench_hosts.py: its links, then allreduce time per size for
    each column, the fastest ringcomm algorithm in bold."""
    doc = run["result"]
    res = doc["results"]
    cols = [c["name"] for c in doc["meta"]["columns"] if not c["skipped"]]
    ours = [c for c in cols if c not in ("mpi", "gloo", "auto")]
    links = "; ".join(f"{x['link']}: {x['latency_us']:.0f} us, {x['bandwidth_GBps']:.2f} GB/s"
                      for x in doc["meta"].get("links") or [])
    env = " ".join(f"{k}={v}" for k, v in run["environment"].items())
    lines = [f"**{run['name']}** ({run['hosts'] * run['ranks_per_host']} ranks"
             + (f"; set by hand: `{env}`" if env else "") + f"). Links: {links}.", "",
             "| size | " + " | ".join(c if c != "auto" else "auto (pick)" for c in cols)
             + " |", "|---:" + "|---:" * len(cols) + "|"]
    for size in sorted({r["size"] for r in res}):
        got = {c: _pick(res, size, c) for c in cols}
        best = min((got[c]["time_us"], c) for c in ours if got[c])[1]
        cells = []
        for c in cols:
            r = got[c]
            if r is None:
                cells.append("-")
                continue
            text = _ms(r["time_us"])
            if c == best:
                text = f"**{text}**"
            if c == "auto":
                text += f" ({r['auto_choice']})"
            cells.append(text)
        lines.append(f"| {format_size(size)} | " + " | ".join(cells) + " |")
    wrong = sum(r.get("wrong") or 0 for r in res)
    lines += ["", f"Started {doc['meta']['started']}; wrong values: {wrong}."]
    return "\n".join(lines)


def _crossover(run: dict) -> str:
    """Where hierarchical is the fastest of ringcomm's allreduces on a multi-host run,
    and its time against the best flat algorithm at each size."""
    res = run["result"]["results"]
    parts, ratios = [], []
    for size in sorted({r["size"] for r in res}):
        h = _pick(res, size, "hierarchical")
        flat = [(r["time_us"], c) for c in _FLAT if (r := _pick(res, size, c))]
        if h is None or not flat:
            continue
        t, c = min(flat)
        ratio = h["time_us"] / t
        parts.append(f"{format_size(size)} {ratio:.2f}x ({c})")
        ratios.append((size, ratio))
    # from where on hierarchical is the fastest, or within 2% of it, at every size
    start = None
    for size, ratio in reversed(ratios):
        if ratio > 1.02:
            break
        start = size
    where = (f"It is the fastest, or within 2% of the fastest, at every size from "
             f"{format_size(start)} on." if start is not None else
             "It is not the fastest at the largest size.")
    return (f"On **{run['name']}**, hierarchical's time over the fastest flat algorithm "
            f"(ring, tree, recursive doubling, Rabenseifner): {'; '.join(parts)}. {where}")


def _multinode_ddp(run: dict, source: str) -> str:
    """ddp.bench's header lines about the world and links, and its breakdown section
    as it printed them, for each model."""
    from ddp.bench.report import SECTION_TEXT, header_text

    doc = run["result"]
    head = [ln for ln in header_text(doc["meta"]).splitlines()
            if ln.startswith(("# world", "# hosts", "# links", "# model"))]
    body = [SECTION_TEXT["breakdown"](m, part, doc["meta"]) for m, part in doc["breakdown"].items()]
    return ("```\n" + "\n".join(head) + "\n" + "\n".join(body) + "\n```\n\n"
            f"(Generated by `scripts/doc_numbers.py` from `{source}`, written by "
            f"`scripts/bench_hosts.py --ddp`; started {doc['meta']['started']}.)")


#: the cross-host target (issue 24): from MIN to MAX bytes over a shaped link, auto
#: at most GOAL x the time of MPI's own allreduce and of gloo's
CROSS_HOST_MIN, CROSS_HOST_MAX, CROSS_HOST_GOAL = 256 << 10, 8 << 20, 1.1


def _cross_host_target(runs: list[dict]) -> str:
    """For each run over a shaped link: auto's time over MPI's and gloo's, the worst
    size in the target's range, and whether the target holds at every size."""
    lines = [f"| setup | auto / MPI's own (worst size) | auto / gloo (worst size) | "
             f"auto <= {CROSS_HOST_GOAL:g}x both |", "|---|---:|---:|---|"]
    for run in runs:
        if not run["link_rate"]:
            continue
        res = run["result"]["results"]
        sizes = sorted({r["size"] for r in res if CROSS_HOST_MIN <= r["size"] <= CROSS_HOST_MAX})
        cells, met = [], bool(sizes)
        for peer in ("mpi", "gloo"):
            ratios = [(a["time_us"] / q["time_us"], size) for size in sizes
                      if (a := _pick(res, size, "auto")) and (q := _pick(res, size, peer))]
            if not ratios:
                cells.append("-")
                met = False
                continue
            worst, at = max(ratios)
            met = met and worst <= CROSS_HOST_GOAL
            cells.append(f"{worst:.2f}x ({format_size(at)})")
        lines.append(f"| {run['name']} | {cells[0]} | {cells[1]} | {'met' if met else 'missed'} |")
    return "\n".join(lines)


WORLD = ROOT / "docs" / "data" / "world_formation.json"


#: the ways scripts/bench_world.py forms a world, as the table names them
WORLD_WAYS = {"torchrun": "torchrun", "torchrun_tree": "torchrun, tree of merges",
              "mpiexec": "mpiexec"}


def _world_formation(doc: dict, source: str) -> str:
    """scripts/bench_world.py's runs: torchrun (MPI started whole from the store),
    torchrun with the tree of merges, and mpiexec, measured in turn in one run."""
    head = " | ".join(WORLD_WAYS[w] for w in doc["ways"])
    rows = [f"| {r['ranks']} | " + " | ".join(f"{r['seconds'][w]:.2f} s" for w in doc["ways"])
            + f" | {r['torchrun_over_mpiexec']:.2f}x | {r['rounds']} |" for r in doc["runs"]]
    return "\n".join([
        f"| ranks | {head} | torchrun / mpiexec | rounds of the tree |",
        "|---:|" + "---:|" * (len(doc["ways"]) + 2), *rows, "",
        f"(Generated by `scripts/doc_numbers.py` from `{source}`, measured {doc['started']} "
        f"on {doc['cores']} cores, written by `scripts/bench_world.py`.)"])


PROOFS = [ROOT / "docs" / "data" / "proofs_1024.json", ROOT / "docs" / "data" / "proofs_4096.json"]
PLANS = ROOT / "docs" / "data" / "plans.json"


def _proofs(docs: list[tuple[dict, str]]) -> str:
    """scripts/bench_proofs.py's runs: per algorithm and size, the proof's time (its
    layouts', without the process's start) and peak memory, or why it was not proved."""
    if not docs:
        return "(Not measured yet: `scripts/bench_proofs.py --json docs/data/proofs_1024.json`.)"
    rows = ["| collective | algorithm | ranks | segments | layouts | proof | peak memory |",
            "|---|---|---:|---|---:|---:|---:|"]
    for doc, _ in docs:
        for r in doc["runs"]:
            head = (f"| {r['collective']} | {r['algorithm']} | {r['ranks']:,} | "
                    f"{doc.get('segments', 'one a chunk')} |")
            if r["proved"]:
                secs = sum(x["seconds"] for x in r["layouts"])
                rows.append(f"{head} {len(r['layouts'])} | {secs:.1f} s | "
                            f"{r['peak_mib']:,.0f} MiB |")
            else:
                rows.append(f"{head} - | not proved: {r['error']} | - |")
    again = [f"{k} at {t}" for doc, _ in docs for k, t in doc.get("remeasured", {}).items()]
    rows.append("")
    rows.append("(Generated by `scripts/doc_numbers.py` from "
                + "; ".join(f"`{src}`, measured {doc['started']} on {doc['cores']} cores"
                            for doc, src in docs) + ", written by `scripts/bench_proofs.py`"
                + (f"; measured again alone: {', '.join(again)}" if again else "") + ".)")
    return "\n".join(rows)


def _plans(doc: dict, source: str) -> str:
    """scripts/bench_plans.py's runs: per allreduce algorithm, build time and bytes
    held at each size; then the cache's bound."""
    sizes = sorted({r["ranks"] for r in doc["runs"]})
    names = list(dict.fromkeys(r["algorithm"] for r in doc["runs"]))
    at = {(r["algorithm"], r["ranks"]): r for r in doc["runs"]}
    head = ["allreduce"] + [f"p = {p:,}: steps, build + plan, held" for p in sizes]
    rows = ["| " + " | ".join(head) + " |", "|---" + "|---:" * len(sizes) + "|"]
    for name in names:
        cells = []
        for p in sizes:
            r = at[(name, p)]
            cells.append(f"{r['steps']:,}, {(r['build_s'] + r['plan_s']) * 1e3:,.1f} ms, "
                         f"{r['bytes'] / 2**20:,.2f} MiB")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    c = doc["cache"]
    rows += ["", f"A group's plan cache holds at most {c['plans_at_most']} plans and "
             f"{c['bytes_at_most'] / 2**20:,.0f} MiB of them, as `Plan.nbytes` counts (what "
             f"tracemalloc saw these plans hold is at most {c['held_per_counted_at_most']}x "
             "that count); the newest plan stays whatever its size.", "",
             f"(Generated by `scripts/doc_numbers.py` from `{source}`, measured "
             f"{doc['started']}, written by `scripts/bench_plans.py`: a "
             f"{doc['elements'] * 4 // 2**20} MiB float32 allreduce in "
             f"{doc['seg'] * 4 // 2**20} MiB segments, on rank p/3.)"]
    return "\n".join(rows)


def architecture_blocks() -> dict:
    """The generated blocks of docs/architecture.md: the world's rounds, the proofs'
    costs and the plans' costs at scale, and the library's table of algorithms."""
    world = json.loads(WORLD.read_text())
    rounds = " | ".join(f"{int(p):,}: {n}" for p, n in world["rounds_by_ranks"].items())
    return {"scale-rounds": f"| ranks: rounds | {rounds} |\n|---|" + "---|" * len(
                world["rounds_by_ranks"]) + f"\n\n(From `{_relative(WORLD)}`.)",
            "scale-proofs": _proofs([(json.loads(p.read_text()), _relative(p))
                                     for p in PROOFS if p.exists()]),
            "scale-plans": _plans(json.loads(PLANS.read_text()), _relative(PLANS)),
            "library-algorithms": library.markdown()
            + "\n\n(Generated by `scripts/doc_numbers.py` from each module's `ROWS`.)"}


def multinode_blocks(doc: dict, source: str, ddp_doc: dict, ddp_source: str) -> dict:
    """The generated blocks of docs/multi-node.md, by name."""
    runs = doc["runs"]
    shaped = next(r for r in runs if r["ranks_per_host"] > 1 and r["link_rate"])
    tail = (f"\n\n(Generated by `scripts/doc_numbers.py` from `{source}`, written by "
            f"`scripts/bench_hosts.py`.)")
    world = {"world-formation": _world_formation(json.loads(WORLD.read_text()),
                                                 _relative(WORLD))}
    return {**world, "multinode-crossover": _crossover(shaped) + tail,
            "multinode-target": _cross_host_target(runs) + tail,
            "multinode-runs": "\n\n".join(_multinode_run(r) for r in runs) + tail,
            "multinode-ddp": _multinode_ddp(ddp_doc, ddp_source)}


def _generated_from(runs: list[tuple[str, dict, str]]) -> str:
    """The line under a table of several runs: each run's label, file and start."""
    return ("(Generated by `scripts/doc_numbers.py` from "
            + "; ".join(f"{label}: `{source}`, measured {run['meta']['started']}"
                        for label, run, source in runs) + ".)")


def _one_host(runs: list[tuple[str, dict, str]]) -> str:
    """auto against DeepSpeed's shared-memory allreduce, MPI's own and the floor, per
    size and per run (``(label, run, source)``: back to back, barrier before each
    call): auto's time and the algorithm it ran, then auto's time over each peer's
    (< 1: auto is faster)."""
    peers = (("deepspeed", "DeepSpeed SHM"), ("mpi", "MPI"), ("floor", "floor"))
    head = ["allreduce, fp32, 2 ranks"]
    for label, _, _ in runs:
        head += [f"auto, {label}"] + [f"auto / {name}, {label}" for _, name in peers]
    rows = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    sizes = sorted({r["size"] for _, run, _ in runs for r in run["results"]
                    if r["collective"] == "allreduce" and r["size"] >= 4096})
    for size in sizes:
        cells = []
        for _, run, _ in runs:
            auto = _pick(run["results"], size, "auto")
            cells.append("-" if auto is None else _us(auto["time_us"])
                         + (f" ({auto['auto_choice']})" if auto.get("auto_choice") else ""))
            for column, _ in peers:
                peer = _pick(run["results"], size, column)
                cells.append("-" if auto is None or peer is None
                             else f"{auto['time_us'] / peer['time_us']:.2f}x")
        rows.append(f"| {format_size(size)} | " + " | ".join(cells) + " |")
    rows += ["", _generated_from([(label, run, source) for label, run, source in runs])]
    return "\n".join(rows)


def _pause(runs: list[tuple[str, dict, str]]) -> str:
    """The allreduce after a pause: per size, auto's time in each run (back to back,
    barrier, sleep, matmul) and its ratio to DeepSpeed's in that run; then what the
    sleep and the matmul add to each implementation over its back-to-back time, and
    auto's addition over MPI's."""
    label = {k: lab for lab, k in PAUSE_MODES}
    by = {k: run for k, run, _ in runs}
    sizes = sorted({r["size"] for _, run, _ in runs for r in run["results"]})
    head = ["allreduce, fp32, 2 ranks"] + [f"auto, {label[k]} (/ DeepSpeed)" for k, _, _ in runs]
    rows = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for size in sizes:
        cells = []
        for k, run, _ in runs:
            auto, ds = _pick(run["results"], size, "auto"), _pick(run["results"], size, "deepspeed")
            cells.append("-" if auto is None else _us(auto["time_us"]) + (
                f" ({auto['time_us'] / ds['time_us']:.2f}x)" if ds else ""))
        rows.append(f"| {format_size(size)} | " + " | ".join(cells) + " |")
    rows += ["", "| what the pause adds to a call | " + " | ".join(
        f"{name}, {how}" for how in ("sleep", "matmul")
        for name in ("auto", "DeepSpeed SHM", "MPI", "floor", "auto / MPI")) + " |",
        "|---" + "|---:" * 10 + "|"]
    for size in sizes:
        cells = []
        for after in ("gap100", "compute"):
            add = {}
            for col in ("auto", "deepspeed", "mpi", "floor"):
                a, b = _pick(by[after]["results"], size, col), _pick(by["back_to_back"]["results"],
                                                                     size, col)
                add[col] = None if a is None or b is None else a["time_us"] - b["time_us"]
                cells.append("-" if add[col] is None else f"{add[col]:+.1f} us")
            cells.append(f"{add['auto'] / add['mpi']:.2f}x" if add["auto"] is not None
                         and add["mpi"] and add["mpi"] > 0 else "-")
        rows.append(f"| {format_size(size)} | " + " | ".join(cells) + " |")
    rows += ["", _generated_from([(label[k], run, source) for k, run, source in runs])]
    return "\n".join(rows)


def _layers_pause(runs: dict) -> str:
    """scripts/bench_layers.py without a pause and with one (``--gap busy:100``, ``--gap
    100``, ``--gap compute``), per algorithm: every layer's time per call, and what the
    pause adds."""
    out = []
    for algo in ("recursive_doubling", "shm_direct"):
        docs = {gap: runs[algo, gap] for gap in ("none", "busy100", "100", "compute")}
        per = {gap: {r["layer"]: r["time_us"] for r in doc["rows"]}
               for gap, (doc, _) in docs.items()}
        names = [r["layer"] for r in docs["none"][0]["rows"]]
        size = format_size(docs["none"][0]["bytes"])
        out += [f"| {size} allreduce, {algo.replace('_', ' ')}, 2 ranks: layer | back to back "
                "| after 100 us busy | added | after a 100 us sleep | added "
                "| after a 256x256 matmul | added |", "|---" + "|---:" * 7 + "|"]
        for name in names:
            b = per["none"][name]
            cells = [_us(b)]
            for gap in ("busy100", "100", "compute"):
                x = per[gap].get(name)
                cells += ["-", "-"] if x is None else [_us(x), f"{x - b:+.1f} us"]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        last = names[-1]
        late = [(label, next(r for r in docs[gap][0]["rows"] if r["layer"] == last))
                for gap, label in (("busy100", "busy"), ("100", "sleep"), ("compute", "matmul"))]
        out += ["", f"{last}, from the last rank's start of a call to its end, against the "
                "time per call: " + "; ".join(f"after the {label} {_us(r['from_last_start_us'])}"
                                              f" ({_us(r['time_us'])})" for label, r in late)
                + ".", ""]
    out += [_dispatch_floor(runs["shm_direct", "100"][0]), ""]
    sources = ", ".join(f"`{src}` ({doc['started']})" for (doc, src) in runs.values())
    return "\n".join([*out, f"(From {sources}.)"])


def _dispatch_floor(doc: dict) -> str:
    """What any backend reached through ``dist.all_reduce`` into a Python process group
    starts from after the pause, if its round were DeepSpeed's native op itself:
    torch's dispatch alone plus that op, against the op."""
    rows = {r["layer"]: r["time_us"] for r in doc["rows"]}
    dispatch = next(v for k, v in rows.items() if k.startswith("torch's dispatch alone"))
    op = next(v for k, v in rows.items() if k.startswith("DeepSpeed's shared-memory"))
    return (f"After the sleep, torch's dispatch alone plus DeepSpeed's op come to "
            f"{_us(dispatch)} + {_us(op)} = {_us(dispatch + op)}, "
            f"{(dispatch + op) / op:.2f}x DeepSpeed's op ({format_size(doc['bytes'])}): what a "
            "backend behind `dist.all_reduce` in a Python process group would take with "
            "DeepSpeed's native round in place of its own and no code of its own between.")


def _one_host_others(doc: dict, source: str) -> str:
    """shm_direct's broadcast, allgather and reduce_scatter against MPI's own and the
    best schedule of the same run, per size: times, and shm_direct over MPI (< 1:
    shm_direct is faster)."""
    rows = ["| collective | size | shm_direct | best schedule | MPI | shm_direct / MPI |",
            "|---|---|---:|---:|---:|---:|"]
    res = [r for r in doc["results"] if r.get("status") == "ok"]
    kinds = {c["name"]: c["kind"] for c in doc["meta"]["columns"]}
    for coll in ("broadcast", "allgather", "reduce_scatter"):
        for size in sorted({r["size"] for r in res if r["collective"] == coll
                            and r["size"] >= 4096}):
            at = [r for r in res if r["collective"] == coll and r["size"] == size]
            cols = {r["column"]: r for r in at}
            direct, mpi = cols.get("shm_direct"), cols.get("mpi")
            sched = [r for r in at if kinds.get(r["column"]) == "ringcomm"
                     and r["column"] not in ("auto", "shm_direct", "native")]
            if direct is None or mpi is None:
                continue
            best = min(sched, key=lambda r: r["time_us"]) if sched else None
            rows.append(f"| {coll} | {format_size(size)} | {_us(direct['time_us'])} | "
                        + ("-" if best is None else f"{_us(best['time_us'])} ({best['column']})")
                        + f" | {_us(mpi['time_us'])} | {direct['time_us'] / mpi['time_us']:.2f}x |")
    rows += ["", f"(Generated by `scripts/doc_numbers.py` from `{source}`, measured "
                 f"{doc['meta']['started']}.)"]
    return "\n".join(rows)


def _ddp_shm(doc: dict, source: str) -> str:
    """ddp.bench on ringcomm with shared memory (the default) and without it
    (``ringcomm-mpi``), per model and configuration: exposed communication (the
    flat allreduce where overlap is off) and the iteration."""
    rows = ["| model | configuration | comm over shm (ms) | comm over MPI (ms) | iteration "
            "over shm (ms) | iteration over MPI (ms) | shm / MPI |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for model, part in doc["breakdown"].items():
        got = part["rows"]
        for impl in ("ours", "torch", "off"):
            shm, mpi = got.get(f"{impl}/ringcomm"), got.get(f"{impl}/ringcomm-mpi")
            if shm is None or mpi is None:
                continue
            key = "comm_ms" if impl == "off" else "exposed_comm_ms"
            rows.append(f"| {model} | `{impl}` | {shm[key]:.1f} | {mpi[key]:.1f} | "
                        f"{shm['total_ms']:.1f} | {mpi['total_ms']:.1f} | "
                        f"{shm['total_ms'] / mpi['total_ms']:.3f}x |")
    argv = " ".join(doc["meta"].get("argv") or [])
    rows += ["", f"Made with `mpiexec -n 2 python scripts/bench_ddp.py {argv}`.", "",
             "(`ours`: this project's DDP; `torch`: torch's DDP; `off`: no overlap, one "
             "flat allreduce after backward, whose time is the comm column. Generated by "
             f"`scripts/doc_numbers.py` from `{source}`, measured {doc['meta']['started']}.)"]
    return "\n".join(rows)


def _us(us: float) -> str:
    return f"{us / 1e3:.2f} ms" if us >= 1000 else f"{us:.1f} us"


def _barrier(doc: dict, source: str) -> str:
    """docs/benchmarks.md's barrier table: each run (the ranks arriving together, one
    late) a row per implementation, medians with their 90th percentiles."""
    names = {"exit_skew_us": "exit skew", "release_us": "release",
             "next_call_us": f"ringcomm's next {doc['bytes']} B allreduce"}
    rows = []
    for late, results in doc["runs"].items():
        how = "arriving together" if float(late) == 0 else f"one rank {late} us late"
        if not rows:
            rows += [f"| barrier, {doc['world_size']} ranks | " + " | ".join(names.values())
                     + " |", "|---|" + "---:|" * len(names)]
        for name, r in results.items():
            cells = " | ".join(f"{_us(r[k]['median'])} (p90 {_us(r[k]['p90'])})" for k in names)
            rows.append(f"| {name}, {how} | {cells} |")
    rows += ["", f"(Medians of {doc['calls']} barriers each, 90th percentiles in brackets; "
             f"{' '.join(doc['mpi'].split())}, torch {doc['torch']}. Generated by `scripts/doc_numbers.py` from "
             f"`{source}`, measured {doc['started']}.)"]
    return "\n".join(rows)


def _steps(doc: dict, source: str) -> str:
    """scripts/bench_steps.py's rows: each step back to back, after the pause, and
    what the pause adds."""
    gap = f"{doc['gap_us']:.0f} us"
    rows = [f"| one step (one process) | back to back | after a {gap} sleep | added |",
            "|---|---:|---:|---:|"]
    for r in doc["rows"]:
        b2b, after = r["back_to_back_us"], r["after_sleep_us"]
        rows.append(f"| {r['name']} | {b2b:.2f} us | {after:.2f} us | {after - b2b:+.2f} us |")
    rows += ["", f"(Medians of {doc['calls'] * doc['rounds']} calls of each step; numpy "
             f"{doc['numpy']}, torch {doc['torch']}, Python {doc['python']}. Generated by "
             f"`scripts/doc_numbers.py` from `{source}`, measured {doc['started']}.)"]
    return "\n".join(rows)


def benchmarks_blocks(doc: dict, source: str, layers: dict, layers_source: str,
                      conc: dict, conc_source: str) -> dict:
    """The generated blocks of docs/benchmarks.md, by name."""
    return {"example": _example(doc), "shipped-targets": _shipped_targets(),
            "run": _run(doc, source),
            "tables": markdown_tables(doc, heading="###").rstrip(),
            "targets": _targets(doc), "model": _model(doc),
            "layers": _layers(layers, layers_source),
            "layers-shm": _layers_sizes([(json.loads(f.read_text()), _relative(f))
                                         for f in LAYERS_SHM]),
            "concurrent": _concurrent(conc, conc_source),
            "one-host-others": _one_host_others(doc, source),
            "one-host": _one_host([("back to back", doc, source),
                                   ("barrier before each", json.loads(ONE_HOST_BARRIER.read_text()),
                                    _relative(ONE_HOST_BARRIER))]),
            "pause": _pause([(k, json.loads(PAUSE[k].read_text()), _relative(PAUSE[k]))
                             for _, k in PAUSE_MODES]),
            "pause-targets": _targets(json.loads(PAUSE["gap100"].read_text())),
            "layers-pause": _layers_pause({key: (json.loads(f.read_text()), _relative(f))
                                           for key, f in LAYERS_PAUSE.items()}),
            "barrier": _barrier(json.loads(BARRIER.read_text()), _relative(BARRIER)),
            "steps": _steps(json.loads(STEPS.read_text()), _relative(STEPS)),
            "cuda-path": _cuda_path(json.loads(CUDA_PATH.read_text()), _relative(CUDA_PATH)),
            "auto-at-scale": _auto_at_scale(json.loads(AUTO_AT_SCALE.read_text()),
                                            _relative(AUTO_AT_SCALE))}


#: short names for the auto-at-scale table's cells
_SHORT = {"recursive_doubling": "rd", "tree": "tree", "rabenseifner": "rab",
          "double_tree": "dt", "ring": "ring", "hierarchical": "hier"}


def _auto_at_scale(doc: dict, source: str) -> str:
    """scripts/auto_at_scale.py's cells: per ranks a host, auto's pick by world size and
    message size, and the model's cheapest where auto is predicted slower by more
    than the margin."""
    sizes = sorted({c["bytes"] for c in doc["cells"]})
    out = []
    for per_host in sorted({c["per_host"] for c in doc["cells"]}):
        cells = {(c["ranks"], c["bytes"]): c for c in doc["cells"] if c["per_host"] == per_host}
        out += [f"{per_host} rank{'s' if per_host > 1 else ''} a host:", "",
                "| ranks | " + " | ".join(format_size(n) for n in sizes) + " |",
                "|---:|" + "---|" * len(sizes)]
        for p in sorted({p for p, _ in cells}):
            row = []
            for n in sizes:
                c = cells[p, n]
                text = _SHORT.get(c["auto"], c["auto"])
                if c["ratio"] > 1 + doc["margin"]:
                    best = _SHORT.get(c["cheapest"], c["cheapest"])
                    text += f" (model: {best} x{c['ratio']:.1f})"
                row.append(text)
            out.append(f"| {p:,} | " + " | ".join(row) + " |")
        out.append("")
    prm = doc["params"]
    out.append(f"(Generated by `scripts/doc_numbers.py` from `{source}`, computed "
               f"{doc['started']} by `scripts/auto_at_scale.py`: alpha "
               f"{prm['alpha'] * 1e6:.2f} us, beta {prm['beta'] * 1e9:.3f} ns/B, gamma "
               f"{prm['gamma'] * 1e9:.4f} ns/B, segments of {format_size(prm['segment_bytes'])}; "
               f"rd recursive doubling, rab rabenseifner, dt double_tree, hier hierarchical; "
               f"\"model: X xR\": the model's cheapest is X, auto's pick is predicted R times "
               f"its time.)")
    return "\n".join(out)


def _cuda_path(doc: dict, source: str) -> str:
    """The table of ``scripts/bench_cuda_path.py``: the CUDA lane's Python per call."""
    rows = [f"| `dist.all_reduce` into a do-nothing group | | | {doc['dispatch_us']:.1f} us |"]
    rows += [f"| ringcomm {r['algorithm']} | {r['ranks']} | {r['steps']} | {r['time_us']:.1f} us |"
             for r in doc["rows"]]
    return "\n".join([
        f"| {format_size(doc['bytes'])} allreduce over FakeNccl (recording) | ranks | "
        "NCCL groups | time per call |", "|---|---:|---:|---:|", *rows, "",
        f"A 2-rank ring allreduce takes {doc['ring_2ranks_over_dispatch']:.2f}x the "
        f"do-nothing dispatch; each further step {doc['us_per_step']:.2f} us. (From "
        f"`{source}`, measured {doc['started']}.)", "", _round_robin(doc.get("round_robin"))])


def _round_robin(r: dict | None) -> str:
    """What keeping issue order per tensor costs DDP's round robin over channels."""
    if not r:
        return "Round robin over channels: not measured in this run."
    return (f"Round robin over {r['channels']} channels ({r['ranks']} ranks, ring, "
            f"{r['buckets']} bucket tensors in turn, as DDP's buckets): "
            f"{r['ordered_us']:.1f} us a call with issue order kept per tensor across the "
            f"channels, {r['unordered_us']:.1f} us without it "
            f"({r['ordered_us'] - r['unordered_us']:+.1f} us).")


# ----------------------------------------------------------------------------
# docs/msccl.md
# ----------------------------------------------------------------------------
def _msccl_table(doc: dict) -> str:
    """Allreduce time per call of every column of the run, size by size."""
    cols = [c["name"] for c in doc["meta"]["columns"] if not c.get("skipped")]
    res = [r for r in doc["results"] if (r["collective"], r["dtype"], r["redop"])
           == ("allreduce", "float", "sum") and r.get("status") == "ok"]
    lines = ["| allreduce, fp32, time per call | " + " | ".join(f"`{c}`" for c in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for size in sorted({r["size"] for r in res}):
        by = {r["column"]: r for r in res if r["size"] == size}
        lines.append(f"| {format_size(size)} | " + " | ".join(
            f"{by[c]['time_us']:.1f} us" if c in by else "-" for c in cols) + " |")
    return "\n".join(lines)


def _msccl_tools(doc: dict, source: str) -> str:
    """msccl-tools' examples by world size: loaded and proven, run against gloo, or why not."""
    ranks = doc["ranks"]
    rows: dict[str, dict] = {}
    for r in doc["rows"]:
        if not r["generated"]:
            cell = "its script fails"
        elif not r.get("loaded"):
            cell = "refused"
        elif "vs_gloo" in r:
            cell = "proven, = gloo" if r["vs_gloo"]["ok"] else "proven, **differs from gloo**"
        else:
            cell = "proven"
        rows.setdefault(r["example"], {})[r["ranks"]] = cell
    lines = ["| msccl-tools example | " + " | ".join(f"{n} ranks" for n in ranks) + " |",
             "|---|" + "---|" * len(ranks)]
    for name, cells in rows.items():
        lines.append(f"| {name} | " + " | ".join(cells.get(n, "-") for n in ranks) + " |")
    fails = sorted({r["why"].split(": ", 1)[-1] for r in doc["rows"] if not r["generated"]})
    note = (f"\n\n(\"its script fails\": msccl-tools' own script raised at that world size: "
            f"{'; '.join(fails)}.)" if fails else "")
    return ("\n".join(lines) + note + f"\n\n(Generated by `scripts/doc_numbers.py` from "
            f"`{source}`: msccl-tools {doc.get('msccl_tools') or '?'}, run "
            f"{doc['started']}.)")


def msccl_blocks(run: dict, run_source: str, tools: dict, tools_source: str) -> dict:
    return {"msccl-run": _run(run, run_source) + "\n\n" + _msccl_table(run) + "\n\n"
            + _targets(run),
            "msccl-tools": _msccl_tools(tools, tools_source)}


def ddp_hooks_blocks(doc: dict, source: str) -> dict:
    """docs/ddp.md's blocks of the hooks and graph sections: the run, and each
    section's table as ddp.bench prints it."""
    meta = doc["meta"]
    tables = [text(model, part, meta).removeprefix("#\n")
              for section, text in (("hooks", hooks_text), ("graph", graph_text))
              for model, part in doc[section].items()]
    return {"ddp-hooks-run": paper.run(doc, source),
            "ddp-hooks": "```\n" + "\n".join(tables) + "\n```"}


def simulator_blocks() -> dict:
    """The generated blocks of docs/simulator.md: the software's default costs and
    the simulator's own speed."""
    sw = json.loads(SIM_SOFTWARE.read_text())
    src = sw["fitted_from"]
    software = (
        "| `call_us` | `step_us` | `message_us` | `reduce_gbps` | `copy_gbps` |\n"
        "|---:|---:|---:|---:|---:|\n"
        f"| {sw['call_us']} | {sw['step_us']} | {sw['message_us']} | {sw['reduce_gbps']} | "
        f"{sw['copy_gbps']} |\n\n(From `{src['file']}`, measured {src['started']} under "
        f"{src['launcher']} at {', '.join(map(str, src['world_sizes']))} ranks, through "
        f"`{_relative(SIM_SOFTWARE)}`.)")
    speed = json.loads(SIM_SPEED.read_text())
    rows = ["| topology | ranks | engine | schedules | messages | simulator time | target |",
            "|---|---:|---|---|---:|---:|---|"]
    for r in speed["runs"]:
        target = "-" if r["target_s"] is None else (
            f"{r['target_s']:g} s: {'met' if r['met'] else 'MISSED'}")
        rows.append(f"| `{r['topology']}` | {r['ranks']:,} | {r['engine']} | "
                    f"{r['source']} | {r['messages']:,} | {r['seconds']:.2f} s | {target} |")
    rows.append(f"\n(Ring allreduce of {format_size(speed['runs'][0]['bytes'])}, best of "
                f"{speed['repeat']}, from `{_relative(SIM_SPEED)}`, measured {speed['started']} "
                f"on {speed['cores']} cores.)")
    pub = json.loads(SIM_PUBLISHED.read_text())
    lines = ["| measurement | ranks | size | published busbw | simulated: links alone | "
             "simulated: ringcomm's ring | links alone / published |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in pub["rows"]:
        lines.append(f"| [{r['name']}]({r['source']}) | {r['ranks']} | "
                     f"{format_size(r['bytes'])} | {r['published_busbw_gbps']:.1f} GB/s | "
                     f"{r['simulated_links_busbw_gbps']:.1f} GB/s | "
                     f"{r['simulated_ringcomm_busbw_gbps']:.1f} GB/s | "
                     f"{r['links_over_published']:.2f}x |")
    lines.append(f"\n(From `{_relative(SIM_PUBLISHED)}`, written by `scripts/sim_published.py` "
                 f"{pub['started']}.)")
    return {"sim-software": software, "sim-speed": "\n".join(rows),
            "sim-published": "\n".join(lines),
            "sim-study": _sim_study(json.loads(SIM_STUDY.read_text()), _relative(SIM_STUDY)),
            "sim-validation": _sim_validation(json.loads(SIM_VALIDATION.read_text()),
                                              _relative(SIM_VALIDATION))}


def _sim_study(doc: dict, source: str) -> str:
    """A ``python -m ringcomm.sim --json`` run as a table: time per size and
    algorithm (ms), the best in bold, and what the best's time is made of."""
    cells = {(r["algorithm"], r["nbytes"]): r for r in doc["results"]}
    algos = list(dict.fromkeys(r["algorithm"] for r in doc["results"]))
    sizes = sorted({r["nbytes"] for r in doc["results"]})
    out = ["| size | " + " | ".join(f"`{a}`" for a in algos) + " | best: made of, busiest link |",
           "|---:|" + "---:|" * len(algos) + "---|"]
    for n in sizes:
        done = [cells[a, n] for a in algos if cells[a, n]["seconds"] is not None]
        best = min(done, key=lambda r: r["seconds"])
        row = []
        for a in algos:
            r = cells[a, n]
            t = "refused" if r["seconds"] is None else f"{r['seconds'] * 1e3:,.3g}"
            row.append(f"**{t}**" if r is best else t)
        total = sum(best["critical"].values())
        parts = ", ".join(f"{k} {v / total:.0%}" for k, v in best["critical"].items()
                          if v / total >= 0.005)
        out.append(f"| {format_size(n)} | " + " | ".join(row) + f" | {parts}; "
                   f"{best['busiest_link']} ({best['busiest_utilisation']:.0%} busy) |")
    return ("\n".join(out) + f"\n\n(Simulated ms per call on {doc['description']}; from "
            f"`{source}`, written by `python -m ringcomm.sim {doc['topology']} --json`.)")


def _sim_validation(doc: dict, source: str) -> str:
    """scripts/validate_sim.py's runs: the summary against the targets, then per
    topology its calibration and every cell's predicted against measured time."""
    s = doc["summary"]
    t = s["targets"]
    met = (s["within_20"] >= t["within_20_share"], s["max_error"] <= t["every_within"],
           s["best_within_10"] >= 1.0)
    out = [f"**{s['cells']} cells**: {s['within_20']:.0%} within 20% (target "
           f"{t['within_20_share']:.0%}: {'met' if met[0] else 'MISSED'}), the worst "
           f"{s['max_error']:.0%} off (target {t['every_within']:.0%}: "
           f"{'met' if met[1] else 'MISSED'}), geometric mean {s['geomean_error']:.1%}; the "
           f"predicted best algorithm measured best or within 10% of it at "
           f"{s['best_within_10']:.0%} of the sizes (target all: "
           f"{'met' if met[2] else 'MISSED'}).", ""]
    for run in doc["runs"]:
        sw = run["software"]
        out += [f"**{run['name']}** (`{run['topology']}`: {run['ranks']} ranks on "
                f"{run['hosts']} hosts, shaped with {run['qdisc']}; fitted: call "
                f"{sw['call_us']} us, step {sw['step_us']} us)", "",
                "| algorithm | size | measured | predicted | error |",
                "|---|---:|---:|---:|---:|"]
        for c in run["cells"]:
            out.append(f"| `{c['algorithm']}` | {format_size(c['bytes'])} | "
                       f"{c['measured_us'] / 1e3:,.2f} ms | {c['predicted_us'] / 1e3:,.2f} ms | "
                       f"{c['error']:+.1%} |")
        picks = "; ".join(f"{format_size(b['bytes'])}: predicted `{b['predicted_best']}`, "
                          f"measured `{b['measured_best']}`"
                          + ("" if b["predicted_best"] == b["measured_best"] else
                             f" ({b['predicted_best_over_measured_best']:.2f}x)")
                          for b in run["best"])
        out += ["", f"Best per size: {picks}.", ""]
    how = (f"ringcomm's {doc['transport']} transport, each call after a barrier"
           if doc.get("transport") else "ringcomm's mpi transport, calls back to back")
    out.append(f"(From `{source}`, measured {doc['started']} on {doc['cores']} cores over "
               f"{how}, written by `scripts/validate_sim.py`.)")
    return "\n".join(out)


def replace_blocks(text: str, blocks: dict, where: str) -> str:
    """``text`` with each ``<!-- generated:NAME begin -->`` ... ``end`` block replaced.

    Raises:
        ValueError: a block's markers are missing or appear more than once.
    """
    for name, body in blocks.items():
        begin, end = f"<!-- generated:{name} begin -->", f"<!-- generated:{name} end -->"
        if text.count(begin) != 1 or text.count(end) != 1:
            raise ValueError(f"{where}: needs exactly one {begin} ... {end} block")
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
        text = pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text)
    return text


def _relative(path: Path) -> str:
    full = path.resolve()
    return full.relative_to(ROOT).as_posix() if full.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="only check that the generated blocks are current")
    ap.add_argument("--data", default=str(DATA), help="the benchmark's result JSON")
    ap.add_argument("--layers", default=str(LAYERS), help="scripts/bench_layers.py's JSON")
    ap.add_argument("--concurrent-data", default=str(CONCURRENT),
                    help="the --concurrent runs' JSON (one run per number of channels)")
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    ap.add_argument("--benchmarks", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--paper", default=str(ROOT / "docs" / "paper-reproduction.md"),
                    help="the DDP paper's reproduction doc; 'none' to leave it out")
    ap.add_argument("--ddp-data", default=str(DDP_DATA),
                    help="python -m ddp.bench's result JSON (for --paper)")
    ap.add_argument("--ddp-rr-data", default=str(DDP_RR_DATA),
                    help="python -m ddp.bench --sections roundrobin's result JSON (for "
                         "--paper's round-robin blocks)")
    ap.add_argument("--multinode-data", default=str(MULTINODE),
                    help="scripts/bench_hosts.py's JSON (for docs/multi-node.md)")
    ap.add_argument("--multinode-ddp-data", default=str(MULTINODE_DDP),
                    help="scripts/bench_hosts.py --ddp's JSON (for docs/multi-node.md)")
    ap.add_argument("--multinode", default=str(ROOT / "docs" / "multi-node.md"))
    ap.add_argument("--ddp-doc", default=str(ROOT / "docs" / "ddp.md"))
    ap.add_argument("--ddp-short-data", default=str(DDP_SHORT_DATA),
                    help="python -m ddp.bench --sections breakdown --model all's JSON")
    ap.add_argument("--ddp-hooks-data", default=str(DDP_HOOKS_DATA),
                    help="python -m ddp.bench --sections hooks,graph's JSON (for docs/ddp.md)")
    ap.add_argument("--msccl-doc", default=str(ROOT / "docs" / "msccl.md"))
    ap.add_argument("--msccl-data", default=str(MSCCL_RUN),
                    help="python -m ringcomm.bench --msccl's JSON (for docs/msccl.md)")
    ap.add_argument("--msccl-tools-data", default=str(MSCCL_TOOLS),
                    help="scripts/msccl_tools_check.py's JSON (for docs/msccl.md)")
    a = ap.parse_args(argv)
    readme, bench = Path(a.readme), Path(a.benchmarks)
    doc = json.loads(Path(a.data).read_text())
    layers = json.loads(Path(a.layers).read_text())
    source = _relative(Path(a.data))
    new: dict[Path, str] = {}
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        print(f"{readme}: no {BEGIN} ... {END} block", file=sys.stderr)
        return 2
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    try:
        new[readme] = settings.render_into(f"{head}{BEGIN}\n{render(doc, source)}\n{END}{tail}")
        new[bench] = replace_blocks(bench.read_text(), benchmarks_blocks(
            doc, source, layers, _relative(Path(a.layers)),
            json.loads(Path(a.concurrent_data).read_text()),
            _relative(Path(a.concurrent_data))), str(bench))
        new[Path(a.multinode)] = replace_blocks(Path(a.multinode).read_text(), multinode_blocks(
            json.loads(Path(a.multinode_data).read_text()), _relative(Path(a.multinode_data)),
            json.loads(Path(a.multinode_ddp_data).read_text()),
            _relative(Path(a.multinode_ddp_data))), a.multinode)
        new[Path(a.msccl_doc)] = replace_blocks(Path(a.msccl_doc).read_text(), msccl_blocks(
            json.loads(Path(a.msccl_data).read_text()), _relative(Path(a.msccl_data)),
            json.loads(Path(a.msccl_tools_data).read_text()),
            _relative(Path(a.msccl_tools_data))), a.msccl_doc)
        architecture = ROOT / "docs" / "architecture.md"
        new[architecture] = replace_blocks(architecture.read_text(), architecture_blocks(),
                                           str(architecture))
        simulator = ROOT / "docs" / "simulator.md"
        new[simulator] = replace_blocks(simulator.read_text(), simulator_blocks(),
                                        str(simulator))
        debugging = ROOT / "docs" / "debugging-a-hang.md"
        new[debugging] = replace_blocks(debugging.read_text(), {
            "flight-cost": _flight_cost(layers, _relative(Path(a.layers)))}, str(debugging))
        short = json.loads(Path(a.ddp_short_data).read_text())
        short_source = _relative(Path(a.ddp_short_data))
        loop = json.loads(DDP_LOOP_DATA.read_text())
        new[Path(a.ddp_doc)] = replace_blocks(Path(a.ddp_doc).read_text(), {
            "ddp-short-run": paper.run(short, short_source),
            "ddp-short-breakdown": paper.breakdown(short),
            "ddp-short-targets": paper.targets(short),
            "ddp-shm": _ddp_shm(json.loads(DDP_SHM_DATA.read_text()), _relative(DDP_SHM_DATA)),
            "ddp-loop-run": paper.run(loop, _relative(DDP_LOOP_DATA)),
            "ddp-loop-breakdown": paper.breakdown(loop),
            "ddp-loop-targets": paper.targets(loop),
            "ddp-loop-runs": paper.median_of_runs(
                [(json.loads(f.read_text()), _relative(f)) for f in DDP_LOOP_RUNS],
                [("ours/ringcomm", "torch/ringcomm", 1.0), ("ours/ringcomm", "torch/gloo", 0.9)]),
            **ddp_hooks_blocks(json.loads(Path(a.ddp_hooks_data).read_text()),
                               _relative(Path(a.ddp_hooks_data)))}, a.ddp_doc)
        if a.paper.strip().lower() != "none":
            doc_ddp = json.loads(Path(a.ddp_data).read_text())
            doc_rr = json.loads(Path(a.ddp_rr_data).read_text())
            new[Path(a.paper)] = replace_blocks(Path(a.paper).read_text(), paper.blocks(
                doc_ddp, _relative(Path(a.ddp_data)), doc, source, doc_rr,
                _relative(Path(a.ddp_rr_data))), a.paper)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    stale = [path for path, content in new.items() if content != path.read_text()]
    if a.check:
        for path in stale:
            print(f"{path} is stale: run python scripts/doc_numbers.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:  # only what changed is written
        path.write_text(new[path])
    return 0


if __name__ == "__main__":
    sys.exit(main())
