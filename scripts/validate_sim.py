#!/usr/bin/env python3
"""The simulator against measured runs: one topology file builds an emulated
cluster (scripts/nscluster.py: namespaces, bridges, cables shaped with tc) and
drives the prediction of the same cells.

    sudo python scripts/validate_sim.py examples/topologies/one_switch.json \\
        examples/topologies/two_racks.json examples/topologies/host_ring.json \\
        examples/topologies/two_hosts_2x2.json --json docs/data/sim_validation.json \\
        --plot docs/img/sim_validation.png

Per topology:

1. **Measured**: ``python -m ringcomm.bench`` under torchrun on every host (its
   ranks as the file gives them) times each algorithm at the calibration sizes and
   the validated sizes (the largest over ranks of each rank's median).
2. **Calibrated**: what the emulation cannot take from the file is fitted on the
   calibration sizes only (4 and 16 KiB by default, the two below the validated
   ones), never on the validated ones:
   the software's per-call and per-step costs (``call_us``, ``step_us``: least
   squares over every algorithm's calibration cells, each cell's dependence on
   them found by simulating it), which also hold the cables' latency, since this
   kernel's ``tc`` has no ``netem`` and the emulation cannot delay anything. So the
   file's latencies are set to 0 for the prediction; its bandwidths stay, times
   TCP's payload share of a full frame (1448 of 1514 bytes: the shaper counts
   Ethernet, IP and TCP headers, the messages do not).
3. **Predicted**: every (algorithm, size) cell simulated on the file with the
   calibrated software, in the order of the executor that ran (ringcomm's on MPI:
   ``order="mpi"``), and its error against the measured time.

The JSON keeps every cell; ``--plot`` draws predicted against measured per
topology. Targets (docs/simulator.md): within 20% for at least 90% of the cells
of 64 KiB-16 MiB, within 35% for every cell, and per topology and size the
predicted best algorithm measured best or within 10% of the best.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
import nscluster  # noqa: E402
import nshosts  # noqa: E402
from ringcomm.algorithms import REGISTRY  # noqa: E402
from ringcomm.bench.sizes import format_size, parse_size  # noqa: E402
from ringcomm.sim import load, simulate  # noqa: E402
from ringcomm.sim.topology import Topology  # noqa: E402

#: TCP's payload in a full Ethernet frame (MTU 1500, timestamps on), over the bytes
#: the shaper counts
TCP_SHARE = 1448 / 1514
ALGOS = "ring,tree,recursive_doubling,rabenseifner,double_tree,hierarchical"
TARGET_20, TARGET_SHARE, TARGET_35, TARGET_BEST = 0.20, 0.90, 0.35, 0.10


def emulated(topo: Topology, software: dict) -> Topology:
    """``topo`` as the emulation has it: no latencies, TCP's share of each cable,
    ``software`` for the software costs."""
    links = [dataclasses.replace(ln, latency=0.0, bandwidth=ln.bandwidth * TCP_SHARE)
             for ln in topo.links]
    return dataclasses.replace(topo, links=links, intra_latency=0.0, software=dict(software))


def measure(topo_path: Path, algos: str, sizes: list[int], timeout: float, out: Path,
            transport: str) -> dict:
    """The benchmark's JSON of ``algos`` at ``sizes`` on the emulated cluster, over
    ``transport``."""
    lo, hi = min(sizes), max(sizes)
    args = ["-m", "ringcomm.bench", "-b", str(lo), "-e", str(hi), "-f", "4", "--algos", algos,
            "--peers", "none", "-w", "1", "-n", "5", "--min-time", "0", "--rounds", "1",
            "--links", "off", "--no-model", "--threads", "1", "--timeout", "300",
            "--barrier-each",
            "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RINGCOMM_TRANSPORT": transport,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with nscluster.Cluster(topo_path) as cluster:
        print(cluster.describe(), file=sys.stderr, flush=True)
        codes = cluster.run_torchrun(args, timeout, env=env, cwd=ROOT)
        qdisc = cluster.qdisc
    if any(codes):
        raise SystemExit(f"validate_sim: the benchmark failed on {topo_path} (exit codes "
                         f"{codes})")
    doc = json.loads(out.read_text())
    doc["qdisc"] = qdisc
    return doc


def _sim(topo: Topology, algo: str, nbytes: int) -> float:
    # the order of the executor that runs here: ringcomm's on MPI
    r = simulate("allreduce", algo, REGISTRY["allreduce"][algo], topo, nbytes, order="mpi")
    if r.seconds is None:
        raise SystemExit(f"validate_sim: {algo} at {nbytes} B: {r.refused}")
    return r.seconds


def calibrate(topo: Topology, measured: dict, sizes: list[int]) -> dict:
    """``call_us`` and ``step_us`` (non-negative least squares over the calibration
    cells), with the file's reduction and copy speeds."""
    base = {k: v for k, v in topo.software.items() if k not in ("call_us", "step_us")}
    rows, ys = [], []
    for (algo, n), t in measured.items():
        if n not in sizes:
            continue
        zero = _sim(emulated(topo, {**base, "call_us": 0, "step_us": 0}), algo, n)
        per_step = _sim(emulated(topo, {**base, "call_us": 0, "step_us": 1}), algo, n) - zero
        rows.append([1e-6, per_step])
        ys.append(t - zero)
    a, y = np.array(rows), np.array(ys)
    best = None
    for cols in ([0, 1], [1], [0]):  # both, else the one that stays non-negative
        x, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if np.all(x >= 0):
            full = np.zeros(2)
            full[cols] = x
            err = float(np.sum((a @ full - y) ** 2))
            if best is None or err < best[1]:
                best = (full, err)
    (call, step), _ = best
    return {**base, "call_us": round(float(call), 3), "step_us": round(float(step), 3)}


def validate(topo_path: Path, algos: list[str], calib: list[int], sizes: list[int],
             timeout: float, tmp: Path, earlier: dict | None = None,
             transport: str = "tcp") -> dict:
    """One topology: measured over ``transport`` (or ``earlier``'s measurements of
    it), calibrated, predicted."""
    topo = load(topo_path)
    if earlier is None:
        run = measure(topo_path, ",".join(algos), calib + sizes, timeout, tmp / "bench.json",
                      transport)
        qdisc, started = run["qdisc"], run["meta"]["started"]
        measured = {(r["column"], r["size"]): r["time_us"] * 1e-6 for r in run["results"]
                    if r["status"] == "ok" and r["column"] in algos}
    else:
        qdisc, started = earlier["qdisc"], earlier["measured_started"]
        measured = {(c["algorithm"], c["bytes"]): c["measured_us"] * 1e-6
                    for c in earlier["calibration"] + earlier["cells"]
                    if c["algorithm"] in algos}
    software = calibrate(topo, measured, calib)
    model = emulated(topo, software)
    cells = []
    for algo in algos:
        for n in sizes:
            if (algo, n) not in measured:
                continue
            pred = _sim(model, algo, n)
            meas = measured[algo, n]
            cells.append({"algorithm": algo, "bytes": n, "measured_us": round(meas * 1e6, 1),
                          "predicted_us": round(pred * 1e6, 1),
                          "error": round(pred / meas - 1, 4)})
    best = []
    for n in sizes:
        here = [c for c in cells if c["bytes"] == n]
        if not here:
            continue
        m = min(here, key=lambda c: c["measured_us"])
        p = min(here, key=lambda c: c["predicted_us"])
        best.append({"bytes": n, "measured_best": m["algorithm"], "predicted_best": p["algorithm"],
                     "predicted_best_over_measured_best": round(
                         p["measured_us"] / m["measured_us"], 4)})
    calibration = [{"algorithm": a, "bytes": n, "measured_us": round(t * 1e6, 1)}
                   for (a, n), t in sorted(measured.items()) if n in calib]
    return {"topology": topo_path.relative_to(ROOT).as_posix() if topo_path.is_relative_to(ROOT)
            else str(topo_path), "name": topo.name, "ranks": topo.size,
            "hosts": len(topo.hosts), "qdisc": qdisc, "software": software,
            "measured_started": started, "calibration": calibration,
            "cells": cells, "best": best}


def summary(runs: list[dict]) -> dict:
    errs = np.array([abs(c["error"]) for r in runs for c in r["cells"]])
    picks = [b["predicted_best_over_measured_best"] for r in runs for b in r["best"]]
    return {"cells": int(len(errs)),
            "within_20": round(float(np.mean(errs <= TARGET_20)), 4) if len(errs) else None,
            "max_error": round(float(errs.max()), 4) if len(errs) else None,
            "geomean_error": round(float(np.exp(np.mean(np.log(np.maximum(errs, 1e-4))))), 4)
            if len(errs) else None,
            "best_within_10": round(float(np.mean(np.array(picks) <= 1 + TARGET_BEST)), 4)
            if picks else None,
            "targets": {"within_20_share": TARGET_SHARE, "every_within": TARGET_35,
                        "best_within": TARGET_BEST}}


def plot(runs: list[dict], path: str, transport: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 4.2), squeeze=False)
    for ax, run in zip(axes[0], runs):
        algos = sorted({c["algorithm"] for c in run["cells"]})
        for a in algos:
            pts = [(c["measured_us"] / 1e3, c["predicted_us"] / 1e3) for c in run["cells"]
                   if c["algorithm"] == a]
            ax.scatter(*zip(*pts), label=a, s=18)
        lo = min(min(c["measured_us"], c["predicted_us"]) for c in run["cells"]) / 1e3
        hi = max(max(c["measured_us"], c["predicted_us"]) for c in run["cells"]) / 1e3
        xs = np.array([lo / 1.5, hi * 1.5])
        ax.plot(xs, xs, color="black", lw=0.8)
        ax.fill_between(xs, xs / 1.2, xs * 1.2, color="grey", alpha=0.3, lw=0)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured (ms)")
        ax.set_ylabel("predicted (ms)")
        ax.set_title(f"{run['name']}\n{run['ranks']} ranks, {run['hosts']} hosts", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"allreduce, 64 KiB-16 MiB: simulated against measured on emulated clusters "
                 f"over ringcomm's {transport} transport (grey: within 20%)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("topologies", nargs="+", type=Path)
    ap.add_argument("--algos", default=ALGOS)
    ap.add_argument("--sizes", default="64K,256K,1M,4M,16M",
                    help="validated sizes (powers of 4 apart, as the benchmark steps)")
    ap.add_argument("--calibrate", default="4K,16K",
                    help="sizes the software costs are fitted on (the two below the validated)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per topology's run")
    ap.add_argument("--json", help="write every cell here")
    ap.add_argument("--plot", metavar="OUT.png")
    ap.add_argument("--transport", choices=("tcp", "mpi"), default="tcp",
                    help="ringcomm's transport in the measured runs: tcp (its sockets, both "
                         "directions of a connection at full rate) or mpi (MPICH over "
                         "libfabric's TCP, which loses 15-30%% when messages cross; "
                         "docs/simulator.md)")
    ap.add_argument("--measured", metavar="JSON",
                    help="take the measurements from this earlier run's JSON (calibrate and "
                         "predict again, after a change to the simulator; no root needed)")
    a = ap.parse_args(argv)
    earlier = {}
    if a.measured:
        old = json.loads(Path(a.measured).read_text())
        earlier = {r["topology"]: r for r in old["runs"]}
        a.transport = old.get("transport", "mpi")
        missing = [r["topology"] for r in old["runs"] if "calibration" not in r]
        if missing:
            ap.error(f"--measured {a.measured}: no calibration cells for {missing} (a run "
                     "before they were kept)")
    why = None if a.measured else nshosts.unavailable()
    if why:
        print(f"validate_sim: {why}", file=sys.stderr)
        return 2
    algos = [x for x in a.algos.split(",") if x]
    unknown = [x for x in algos if x not in REGISTRY["allreduce"]]
    if unknown:
        ap.error(f"--algos: {unknown} are no allreduce algorithms")
    sizes = [parse_size(x) for x in a.sizes.split(",")]
    calib = [parse_size(x) for x in a.calibrate.split(",")]
    runs = []
    began = time.time()
    for path in a.topologies:
        key = path.resolve().relative_to(ROOT).as_posix() if path.resolve().is_relative_to(
            ROOT) else str(path)
        if a.measured and key not in earlier:
            ap.error(f"--measured {a.measured} has no run of {key}")
        with tempfile.TemporaryDirectory() as tmp:
            run = validate(path.resolve(), algos, calib, sizes, a.timeout, Path(tmp),
                           earlier.get(key), a.transport)
        runs.append(run)
        for c in run["cells"]:
            print(f"{run['name']:>32} {c['algorithm']:>20} {format_size(c['bytes']):>8}: "
                  f"measured {c['measured_us'] / 1e3:9.2f} ms, predicted "
                  f"{c['predicted_us'] / 1e3:9.2f} ms ({c['error']:+.0%})", flush=True)
    doc = {"schema": "ringcomm.validate_sim/1", "order": "mpi", "transport": a.transport,
           "started": time.strftime(
        "%Y-%m-%dT%H:%M:%S%z", time.localtime(began)), "cores": os.cpu_count(),
        "tcp_share": round(TCP_SHARE, 4), "calibration_sizes": calib, "runs": runs,
        "summary": summary(runs)}
    print(json.dumps(doc["summary"], indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    if a.plot:
        plot(runs, a.plot, a.transport)
    return 0


if __name__ == "__main__":
    sys.exit(main())
