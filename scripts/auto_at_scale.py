#!/usr/bin/env python3
"""What ``auto`` picks for allreduce at 8 to 16,384 ranks (one rank a host, and eight)
and 4 KiB to 1 GiB, beside the cost model's cheapest algorithm there.

    python scripts/auto_at_scale.py --json docs/data/auto_at_scale.json \\
        --plot docs/img/auto_at_scale.png

auto's pick is ``ringcomm.algorithms.select.choose`` with the shipped tuning. The
model is the one ``scripts/library_tuning.py`` uses for the library's rows: alpha and
beta fitted jointly to the measured ring, tree and recursive doubling of
``docs/data/compare_2ranks.json`` (2 ranks on one host), gamma as that run measured
it, and every candidate's features counted from its schedules at the cell's world
size (:func:`ringcomm.bench.cost_model.features_at`: the ring in closed form, the others
simulated under NCCL's rules). The model has one kind of link: with eight ranks a
host it does not know that the hosts' links are the slow ones, which is what
``hierarchical`` (auto's row for several hosts, measured across namespace hosts)
is for. A cell agrees when auto's pick is predicted within ``--margin`` (30%, as
tests/test_library.py holds the library's rows to the model) of the
cheapest; ``tests/test_costmodel.py`` holds the shipped table to this file.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import ringcomm  # noqa: E402,F401  (registers the library)
from ringcomm.algorithms import select  # noqa: E402
from ringcomm.bench import cost_model  # noqa: E402
from ringcomm.bench.sizes import format_size  # noqa: E402

#: the world sizes and message sizes of the table
RANKS = tuple(8 << k for k in range(12))           # 8 .. 16,384
SIZES = tuple(4096 << 2 * k for k in range(10))    # 4 KiB .. 1 GiB
#: ranks a host: 1 (every rank its own host) and 8
PER_HOST = (1, 8)
#: the allreduce algorithms compared: the built-in ones and the library's that run
#: on any number of ranks in O(log p) or O(p) steps (one_shot and two_shot send to
#: every rank at once: for a few ranks on one host); hierarchical with 8 a host
CANDIDATES = ("recursive_doubling", "tree", "rabenseifner", "double_tree", "ring")
MULTI_HOST = ("hierarchical",)
#: where the model's parameters were measured
MEASURED_AT = {"fit": "2 ranks on one host (docs/data/compare_2ranks.json)",
               "hosts_row": "2 hosts x 2 ranks across namespace hosts (docs/multi-node.md)"}


def hosts_of(p: int, per_host: int) -> tuple:
    """The host of every rank (() for one host, as the planner has it, and for one
    rank a host, which auto and the schedules treat alike)."""
    return tuple(r // per_host for r in range(p)) if 1 < per_host < p else ()


def cell(params: dict, table: dict, p: int, per_host: int, n: int) -> dict:
    """One cell: every candidate's predicted time, auto's pick and the cheapest."""
    hosts = hosts_of(p, per_host)
    names = CANDIDATES + (MULTI_HOST if per_host > 1 else ())
    seg = params["segment_bytes"]
    times = {}
    for name in names:
        A, B, G = cost_model.features_at(name, p, n, seg, hosts)
        times[name] = params["alpha"] * A + params["beta"] * B + params["gamma"] * G
    auto = select.choose(table, "allreduce", n, p, hosts)
    cheapest = min(times, key=times.get)
    return {"ranks": p, "per_host": per_host, "bytes": n, "auto": auto, "cheapest": cheapest,
            "ratio": round(times[auto] / times[cheapest], 3),
            "times_s": {k: float(f"{v:.4g}") for k, v in times.items()}}


def repick(doc: dict, table: dict) -> None:
    """Refresh ``doc``'s cells for the tuning ``table``: auto's pick and its ratio to
    the cheapest, from the predicted times the cells hold (no simulation)."""
    for c in doc["cells"]:
        c["auto"] = select.choose(table, "allreduce", c["bytes"], c["ranks"],
                                  hosts_of(c["ranks"], c["per_host"]))
        c["ratio"] = round(c["times_s"][c["auto"]] / c["times_s"][c["cheapest"]], 3)


def plot(doc: dict, path: str) -> None:
    """Per ranks-a-host panel: a grid of world size by message size coloured by auto's
    pick, a ring where the model's cheapest is another algorithm by more than the
    margin (its colour inside)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from ringcomm.bench.styles import style

    fig, axes = plt.subplots(1, len(PER_HOST), figsize=(12, 5.5), sharey=True)
    used = set()
    for ax, per_host in zip(axes, PER_HOST):
        cells = [c for c in doc["cells"] if c["per_host"] == per_host]
        for c in cells:
            x, y = SIZES.index(c["bytes"]), RANKS.index(c["ranks"])
            ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1,
                                       color=style(c["auto"])["color"], lw=0))
            used.add(c["auto"])
            if c["ratio"] > 1 + doc["margin"]:
                ax.scatter([x], [y], s=90, facecolor=style(c["cheapest"])["color"],
                           edgecolor="black", linewidth=1.2, zorder=3)
                used.add(c["cheapest"])
        ax.set_xlim(-0.5, len(SIZES) - 0.5)
        ax.set_ylim(-0.5, len(RANKS) - 0.5)
        ax.set_xticks(range(len(SIZES)), [format_size(n) for n in SIZES], rotation=45)
        ax.set_yticks(range(len(RANKS)), [f"{p:,}" for p in RANKS])
        ax.set_xlabel("allreduce size")
        ax.set_title(f"{per_host} rank{'s' if per_host > 1 else ''} a host")
    axes[0].set_ylabel("ranks")
    handles = [Patch(color=style(a)["color"], label=a) for a in
               (*CANDIDATES, *MULTI_HOST) if a in used]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    fig.suptitle(f"auto's allreduce (cells) and the cost model's cheapest where it is more "
                 f"than {doc['margin']:.0%} faster (dots)")
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    import library_tuning

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "docs" / "data" / "compare_2ranks.json"))
    ap.add_argument("--ranks", default=",".join(map(str, RANKS)))
    ap.add_argument("--margin", type=float, default=0.30)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--repick", help="a JSON this script wrote: refresh auto's picks from "
                    "the shipped tuning, keeping its predicted times (no simulation)")
    a = ap.parse_args(argv)
    table = select.load_tuning(None)
    if a.repick:
        doc = json.loads(Path(a.repick).read_text())
        doc["margin"] = a.margin
        repick(doc, table)
        off = [c for c in doc["cells"] if c["ratio"] > 1 + doc["margin"]]
        print(f"{len(off)} of {len(doc['cells'])} cells beyond the margin: " + "; ".join(
            f"{c['ranks']}/{c['per_host']} {format_size(c['bytes'])} {c['auto']} vs "
            f"{c['cheapest']} x{c['ratio']}" for c in off))
        if a.json:
            Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
        if a.plot:
            plot(doc, a.plot)
        return 0
    params = library_tuning.joint_fit(json.loads(Path(a.results).read_text()), "allreduce")
    cells = []
    began = time.time()
    for p in map(int, a.ranks.split(",")):
        t = time.perf_counter()
        for per_host in PER_HOST:
            for n in SIZES:
                cells.append(cell(params, table, p, per_host, n))
        row = [c for c in cells if c["ranks"] == p]
        off = [f"{format_size(c['bytes'])}/{c['per_host']}: {c['auto']} vs {c['cheapest']} "
               f"x{c['ratio']}" for c in row if c["ratio"] > 1 + a.margin]
        print(f"{p:6d} ranks ({time.perf_counter() - t:6.1f} s): "
              + ("; ".join(off) if off else "auto within the margin everywhere"), flush=True)
    doc = {"schema": "ringcomm.auto_at_scale/1",
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(began)),
           "cores": os.cpu_count(), "margin": a.margin, "params": params,
           "measured_at": MEASURED_AT, "cells": cells}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    if a.plot:
        plot(doc, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
