"""``python -m ringcomm.sim``: which algorithm wins where, on a described cluster.

    python -m ringcomm.sim examples/topologies/two_racks.json \\
        --algos ring,tree,recursive_doubling -b 64K -e 16M --json sim.json --plot sim.png

For every algorithm and size it proves the algorithm (a refusal is shown in place
of a time), times one call on the topology (:func:`ringcomm.sim.cell.simulate`),
and prints a table of times and bus bandwidth with the best per size marked, then
what the time of each size's best is made of and which link is busiest.
``--json`` writes every cell; ``--plot`` draws time against size per algorithm.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time

from ringcomm.bench.sizes import (BUSBW_FACTOR, DTYPE_ALIASES, ELEMENT_SIZE, format_size,
                                  message_sizes, parse_size)
from ringcomm.bench.styles import size_axis
from ringcomm.sim.cell import Result, simulate
from ringcomm.sim.layouts import SIZED
from ringcomm.sim.topology import TopologyError, load

SCHEMA = "ringcomm.sim/1"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ringcomm.sim",
        description="Simulate collective algorithms on a cluster described in a topology "
                    "file (docs/simulator.md).")
    p.add_argument("topology", help="the topology file (JSON; examples/topologies/)")
    p.add_argument("-c", "--collective", default="allreduce", choices=SIZED)
    p.add_argument("--algos", default="ring,tree,recursive_doubling",
                   help="comma list of registered algorithms, or 'all' (default: %(default)s)")
    p.add_argument("--sizes", default=None,
                   help="comma list of sizes (64K,1M); overrides -b/-e/-f")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("64K"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("16M"))
    p.add_argument("-f", "--stepfactor", type=float, default=4.0)
    p.add_argument("-d", "--dtype", default="float",
                   help="element type (its size splits the buffer; default: float)")
    p.add_argument("--segment-bytes", type=parse_size, default=parse_size("2M"),
                   help="pipeline segment of the pipelined algorithms (ringcomm's default)")
    p.add_argument("--root", type=int, default=0)
    p.add_argument("--mode", choices=("auto", "full", "rotated"), default="auto",
                   help="every rank's schedule (full), rank 0's rotated, or auto: full "
                        "unless that is large and the ranks are alike")
    p.add_argument("--order", choices=("nccl", "mpi"), default="nccl",
                   help="the step order timed: nccl (a step's messages one group, as on "
                        "GPUs) or mpi (ringcomm's executor on CPUs: sends as soon as their "
                        "data is final, receives posted ahead; every rank's schedule, by "
                        "events)")
    p.add_argument("--engine", choices=("auto", "events", "rounds"), default="auto",
                   help="time event by event, or round by round (rotated programs); auto: "
                        "rounds for rotated programs of over a million messages")
    p.add_argument("--budget", type=float, default=60.0, metavar="S",
                   help="seconds one cell may take (default: %(default)s)")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (it registers algorithms of its own)")
    p.add_argument("--msccl", action="append", default=[], metavar="FILE.xml",
                   help="register an MSCCL algorithm file (it serves one world size)")
    p.add_argument("--json", metavar="OUT", help="write every cell to OUT")
    p.add_argument("--plot", metavar="OUT.png", help="draw time against size to OUT.png")
    return p


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser()
    a = ap.parse_args(argv)
    a.dtype = DTYPE_ALIASES.get(a.dtype, a.dtype)
    if a.dtype not in ELEMENT_SIZE:
        ap.error(f"--dtype {a.dtype!r}: one of {', '.join(ELEMENT_SIZE)}")
    if a.budget <= 0:
        ap.error("--budget must be more than 0 seconds")
    if a.stepfactor <= 1:
        ap.error("-f/--stepfactor must be more than 1")
    if a.minbytes > a.maxbytes:
        ap.error("-b/--minbytes is more than -e/--maxbytes")
    try:
        a.size_list = ([parse_size(x) for x in a.sizes.split(",") if x.strip()] if a.sizes
                       else message_sizes(a.minbytes, a.maxbytes, a.stepfactor, None))
    except argparse.ArgumentTypeError as e:
        ap.error(f"--sizes: {e}")
    for module in a.imports:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any failure of the user's module
            ap.error(f"--import {module}: {type(e).__name__}: {e}")
    importlib.import_module("ringcomm.library")  # registers the library's algorithms
    from ringcomm.algorithms import REGISTRY, is_schedule
    extra = []
    for path in a.msccl:
        from ringcomm import msccl
        try:
            extra.append(msccl.register(path, replace=True))
        except (OSError, ValueError) as e:
            ap.error(f"--msccl {path}: {e}")
    known = {n: b for n, b in REGISTRY[a.collective].items() if is_schedule(b)}
    names = list(known) if a.algos == "all" else \
        [x.strip() for x in a.algos.split(",") if x.strip()] + extra
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"--algos: {', '.join(unknown)} is no algorithm with schedules for "
                 f"{a.collective}; known: {', '.join(known)} (a module of your own: --import)")
    a.builders = {n: known[n] for n in dict.fromkeys(names)}
    try:
        a.topo = load(a.topology)
    except (OSError, TopologyError) as e:
        ap.error(str(e))
    if not 0 <= a.root < a.topo.size:
        ap.error(f"--root {a.root}: the topology has ranks 0-{a.topo.size - 1}")
    return a


def busbw(r: Result) -> float | None:
    """nccl-tests' bus bandwidth of a cell, GB/s."""
    if r.seconds is None or r.seconds <= 0:
        return None
    factor = BUSBW_FACTOR.get(r.collective, lambda p: 1.0)(r.ranks)
    return r.nbytes / r.seconds * factor / 1e9


def table(results: list[Result], algos: list[str], sizes: list[int]) -> str:
    """Time (us) and bus bandwidth per size and algorithm, the best marked ``*``."""
    cell = {(r.algorithm, r.nbytes): r for r in results}
    head = ["size"] + [f"{a} us / GB/s" for a in algos] + ["best"]
    rows = [head]
    for n in sizes:
        done = [cell[a, n] for a in algos if cell[a, n].seconds is not None]
        best = min(done, key=lambda r: r.seconds).algorithm if done else "-"
        row = [format_size(n)]
        for a in algos:
            r = cell[a, n]
            row.append("refused" if r.refused and r.refused.startswith("refused") else
                       "over budget" if r.refused else
                       f"{r.seconds * 1e6:,.1f} / {busbw(r):.3g}{' *' if a == best else ''}")
        rows.append(row + [best])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def details(results: list[Result], sizes: list[int]) -> str:
    """Per size, its best cell: the critical path's shares and the busiest link."""
    out = []
    for n in sizes:
        done = [r for r in results if r.nbytes == n and r.seconds is not None]
        if not done:
            continue
        r = min(done, key=lambda x: x.seconds)
        sh = r.shares()
        out.append(f"{format_size(n):>9} {r.algorithm}: latency {sh['latency']:.0%}, "
                   f"bandwidth {sh['bandwidth']:.0%}, local {sh['local']:.0%}, software "
                   f"{sh['software']:.0%}; busiest link {r.busiest_link} "
                   f"({r.busiest_utilisation:.0%} busy)")
    return "\n".join(out)


def plot(results: list[Result], algos: list[str], path: str, title: str) -> None:
    """Time against size, one line per algorithm (left), and each algorithm's time
    over the best's at that size (right: the winner lies on 1), the sizes in bytes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, rel) = plt.subplots(1, 2, figsize=(12, 4.6))
    sizes = sorted({r.nbytes for r in results})
    best = {n: min((r.seconds for r in results if r.nbytes == n and r.seconds is not None),
                   default=None) for n in sizes}
    for a in algos:
        pts = sorted((r.nbytes, r.seconds) for r in results
                     if r.algorithm == a and r.seconds is not None)
        if not pts:
            continue
        line, = ax.plot([n for n, _ in pts], [t * 1e6 for _, t in pts], marker="o", label=a)
        rel.plot([n for n, _ in pts], [t / best[n] for n, t in pts], marker="o",
                 color=line.get_color(), label=a)
    for axis in (ax, rel):
        size_axis(axis, sizes)
        axis.grid(True, which="both", alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("simulated time per call (us)")
    rel.set_yscale("log")
    rel.set_ylabel("time / the best algorithm's at that size")
    rel.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    esize = ELEMENT_SIZE[a.dtype]
    print(f"# {a.topo.describe()}")
    results = []
    began = time.perf_counter()
    for name, build in a.builders.items():
        for n in a.size_list:
            results.append(simulate(a.collective, name, build, a.topo, n, esize=esize,
                                    segment_bytes=a.segment_bytes, root=a.root, mode=a.mode,
                                    engine=a.engine, order=a.order, budget_s=a.budget))
    algos = list(a.builders)
    print(table(results, algos, a.size_list))
    print(details(results, a.size_list))
    for r in results:
        if r.refused:
            print(f"{r.algorithm} at {format_size(r.nbytes)}: {r.refused}")
    sources = sorted({f"{r.algorithm}: {r.source}, by {r.engine}" for r in results
                      if r.source})
    print(f"# {len(results)} cells in {time.perf_counter() - began:.1f} s; schedules: "
          f"{'; '.join(sources)}")
    if a.json:
        doc = {"schema": SCHEMA, "topology": a.topology, "description": a.topo.describe(),
               "collective": a.collective, "dtype": a.dtype, "order": a.order,
               "segment_bytes": a.segment_bytes,
               "results": [{**dataclasses.asdict(r), "busbw_gbps": busbw(r)} for r in results]}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    if a.plot:
        plot(results, algos, a.plot, f"{a.collective} on {a.topo.describe()}")
    return 0 if all(r.refused is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
