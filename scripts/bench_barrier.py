"""How closely a barrier lets its ranks leave together: ringcomm's ``dist.barrier``
against MPI's own ``Barrier`` and gloo's, on one host (one clock for every rank).

    mpiexec -n 2 python scripts/bench_barrier.py --json docs/data/barrier_2ranks.json

ringcomm's rows are one per ``--algos`` name (default ``auto,dissemination``),
each on a group of its own that runs that barrier algorithm.

Every timed barrier comes after an untimed MPI barrier and a busy wait of
``--late`` microseconds on one rank (a different rank each time), so which rank
arrives last is known; with 0 the ranks arrive together, as MPI's barrier left
them. Each ``--late`` value is a run of its own. For each barrier it records, on the shared clock:

* the exit skew: the last rank's exit minus the first rank's;
* the release: the last rank's exit minus the last rank's entry (what a barrier
  costs the rank everyone waited for);
* the next call: ringcomm's ``dist.all_reduce`` of ``--bytes`` right after the
  barrier, whichever barrier it was (the slowest rank's time): a barrier that
  leaves its ranks apart, or its caches cold, makes the first collective after it
  slower.

The implementations run in turn, ``--rounds`` times, so a slow spell of the
machine touches them all alike; each statistic is the median over every
barrier of an implementation, and its 90th percentile.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import ringcomm

#: the statistics, in the order of the table's columns
STATS = ("exit_skew_us", "release_us", "next_call_us")


def busy(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def timed(impls: dict, after, world, rank: int, p: int, late: float, calls: int,
          rounds: int) -> dict | None:
    """Every implementation's barriers, ``calls`` at a time in ``rounds`` turns: on
    rank 0 each one's stamps ``[rank, barrier, (entry, exit, next call's end)]``
    (ns, one clock); None on the others."""
    clock = time.perf_counter_ns
    stamps: dict[str, list] = {name: [] for name in impls}
    for _ in range(rounds):
        for name, barrier in impls.items():
            rows = stamps[name]
            for i in range(calls):
                world.Barrier()
                if rank == i % p:
                    busy(late)
                t0 = clock()
                barrier()
                t1 = clock()
                after()
                rows.append((t0, t1, clock()))
    gathered = {name: world.gather(np.array(rows, dtype=np.int64))
                for name, rows in stamps.items()}
    return {name: np.array(g) for name, g in gathered.items()} if rank == 0 else None


def summary(stamps: dict) -> dict:
    """Each implementation's statistics (:data:`STATS`): median and 90th percentile."""
    results = {}
    for name, s in stamps.items():
        entry, leave, done = s[:, :, 0], s[:, :, 1], s[:, :, 2]
        values = {
            "exit_skew_us": (leave.max(0) - leave.min(0)) / 1e3,
            "release_us": (leave.max(0) - entry.max(0)) / 1e3,
            "next_call_us": (done - leave).max(0) / 1e3,
        }
        results[name] = {k: {"median": float(np.median(v)), "p90": float(np.percentile(v, 90))}
                         for k, v in values.items()}
    return results


def show(results: dict, p: int, late: float, nbytes: int) -> None:
    how = f"one late by {late:g} us" if late else "arriving together"
    print(f"| barrier, {p} ranks, {how} | exit skew | release | ringcomm's next {nbytes} B "
          "allreduce |")
    print("|---|---:|---:|---:|")
    for name, r in results.items():
        cells = " | ".join(f"{r[k]['median']:.1f} us (p90 {r[k]['p90']:.1f})" for k in STATS)
        print(f"| {name} | {cells} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500, help="barriers per round and implementation")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--late", default="0,50",
                    help="microseconds the late rank waits (busy) before its barrier; "
                         "comma-separated, a run each")
    ap.add_argument("--bytes", type=int, default=4096, help="the allreduce after each barrier")
    ap.add_argument("--algos", default="auto,dissemination",
                    help="ringcomm's barrier algorithms, a row each (comma-separated)")
    ap.add_argument("--json", help="write the results here (rank 0)")
    a = ap.parse_args(argv)
    for flag in ("calls", "rounds", "bytes"):
        if getattr(a, flag) < 1:
            ap.error(f"--{flag} must be at least 1")
    try:
        lates = [float(x) for x in a.late.split(",")]
    except ValueError:
        ap.error(f"--late takes microseconds, comma-separated, not {a.late!r}")
    if any(x < 0 for x in lates):
        ap.error("--late must not be negative")
    dist.init_process_group("ringcomm")
    from mpi4py import MPI

    rank, p = dist.get_rank(), dist.get_world_size()
    world = ringcomm.launch.bootstrap.world_comm()
    if len(set(world.allgather(platform.node()))) != 1:
        raise SystemExit("bench_barrier: run it on one host (it compares the ranks' clocks)")
    gloo = dist.new_group(backend="gloo")
    comm = world.Dup()
    n = max(1, a.bytes // 4)
    t = torch.ones(n)
    impls: dict = {}
    for algo in a.algos.split(","):
        g = dist.new_group(pg_options=ringcomm.Options(algorithms={"barrier": algo}))
        impls[f"ringcomm {algo}"] = lambda g=g: dist.barrier(group=g)
    impls["mpi"] = comm.Barrier
    impls["gloo"] = lambda: dist.barrier(group=gloo)

    def after() -> None:
        dist.all_reduce(t)
    for barrier in impls.values():  # warm-up
        for _ in range(50):
            barrier()
            after()
    runs = {}
    for late in lates:
        stamps = timed(impls, after, world, rank, p, late, a.calls, a.rounds)
        if rank == 0:
            runs[f"{late:g}"] = summary(stamps)
            show(runs[f"{late:g}"], p, late, a.bytes)
    if rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump({"schema": "ringcomm.bench_barrier/2",
                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "world_size": p, "bytes": a.bytes, "calls": a.calls * a.rounds,
                       "torch": torch.__version__,
                       "mpi": MPI.Get_library_version().splitlines()[0],
                       "host": platform.processor() or platform.machine(),
                       "runs": runs}, f, indent=1)
    comm.Free()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
