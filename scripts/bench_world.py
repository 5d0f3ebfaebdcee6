#!/usr/bin/env python3
"""How long a world of N ranks takes to form: under torchrun, where ringcomm starts
MPI itself, and under mpiexec, in the same run.

    python scripts/bench_world.py --ranks 4,8,16,32 --json docs/data/world_formation.json

Three ways, each N launched ``--repeat`` times in turn, best kept:

* ``torchrun``: ringcomm answers MPI's process-manager requests from the c10d store
  (launch/pmi.py), so one ``MPI_Init`` forms the world, as under mpiexec;
* ``torchrun, tree``: ``RINGCOMM_PMI=0``, every process starts as an MPI singleton
  and ringcomm joins them in ceil(log2 N) rounds of merges (launch/bootstrap.py,
  ``merge_rounds``);
* ``mpiexec``: MPICH's own launcher (hydra), the goal to match.

The time: from the moment the last rank had imported torch to the last rank's
first allreduce (ringcomm's import, which starts MPI under mpiexec, and
``init_process_group``, which starts it under torchrun, in between), the time a
job waits for its slowest rank to be ready. On a machine with fewer cores than ranks the ranks are oversubscribed: the
time grows with the import work as well. Also: the rounds the tree takes for N up
to 16,384 (computed, as tests/test_units.py checks).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ringcomm.launch.bootstrap import merge_rounds  # noqa: E402


#: how each way starts N ranks of tests/ranks/world_timing.py, and what it adds to
#: the environment
WAYS = {
    "torchrun": ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node={n}"], {}),
    "torchrun_tree": ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node={n}"], {"RINGCOMM_PMI": "0"}),
    "mpiexec": ([str(Path(sys.executable).parent / "mpiexec"), "-n", "{n}", sys.executable],
                {}),
}


def launch(way: str, n: int) -> float:
    """Seconds from the last rank's import of torch to the last rank's first allreduce."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "RINGCOMM_PMI")}
    command, extra = WAYS[way]
    env.update(extra, OMP_NUM_THREADS="1")
    p = subprocess.run([c.format(n=n) for c in command]
                       + [str(ROOT / "tests" / "ranks" / "world_timing.py")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    rows, start, decoder = [], 0, json.JSONDecoder()
    while (i := p.stdout.find("timing: {", start)) >= 0:  # the ranks share one pipe
        doc, start = decoder.raw_decode(p.stdout, i + len("timing: "))
        rows.append(doc)
    if p.returncode or len(rows) != n:
        raise SystemExit(f"bench_world: {way}, {n} ranks failed (exit {p.returncode}):\n"
                         f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return max(r["first"] for r in rows) - max(r["imported"] for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="4,8,16,32")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    runs = []
    for n in (int(x) for x in a.ranks.split(",")):
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for _ in range(a.repeat):  # the ways in turn, so that each sees the same machine
            for way in WAYS:
                times[way].append(launch(way, n))
        best = {way: round(min(t), 2) for way, t in times.items()}
        runs.append({"ranks": n, "rounds": len(merge_rounds(n)), "seconds": best,
                     "all_seconds": {w: [round(x, 2) for x in t] for w, t in times.items()},
                     "torchrun_over_mpiexec": round(best["torchrun"] / best["mpiexec"], 2)})
        print(f"{n:6d} ranks: " + ", ".join(f"{w} {s:.2f} s" for w, s in best.items())
              + f" (best of {a.repeat}); torchrun/mpiexec "
              f"{runs[-1]['torchrun_over_mpiexec']:.2f}x", flush=True)
    rounds = {str(n): len(merge_rounds(n)) for n in (2, 16, 128, 1024, 4096, 16384)}
    print("rounds:", rounds)
    if a.json:
        Path(a.json).write_text(json.dumps({
            "schema": "ringcomm.bench_world/2",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "ways": list(WAYS),
            "cores": os.cpu_count(), "runs": runs, "rounds_by_ranks": rounds}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
