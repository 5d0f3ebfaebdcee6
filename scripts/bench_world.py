#!/usr/bin/env python3
"""How long a world of N ranks takes to form under torchrun, where every process
starts as an MPI singleton and ringcomm joins them (launch/bootstrap.py,
``merge_rounds``: ceil(log2 N) rounds of merges).

    python scripts/bench_world.py --ranks 4,8,16,32 --json docs/data/world_formation.json

Per N, best of ``--repeat`` launches: from the moment the last rank had imported
torch and ringcomm to the last rank's first allreduce, the time a job waits for its
slowest rank to be ready. On a machine with fewer cores than ranks the ranks
are oversubscribed: the time grows with the import work as well. Also: the rounds
the protocol takes for N up to 16,384 (computed, as tests/test_units.py checks).
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


def launch(n: int) -> float:
    """Seconds from the last rank's import to the last rank's first allreduce."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={n}", str(ROOT / "tests" / "ranks" / "world_timing.py")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    rows, start, decoder = [], 0, json.JSONDecoder()
    while (i := p.stdout.find("timing: {", start)) >= 0:  # the ranks share one pipe
        doc, start = decoder.raw_decode(p.stdout, i + len("timing: "))
        rows.append(doc)
    if p.returncode or len(rows) != n:
        raise SystemExit(f"bench_world: {n} ranks failed (exit {p.returncode}):\n"
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
        times = [launch(n) for _ in range(a.repeat)]
        runs.append({"ranks": n, "rounds": len(merge_rounds(n)), "seconds": round(min(times), 2),
                     "all_seconds": [round(t, 2) for t in times]})
        print(f"{n:6d} ranks: {len(merge_rounds(n))} rounds, {min(times):.2f} s "
              f"(best of {a.repeat})", flush=True)
    rounds = {str(n): len(merge_rounds(n)) for n in (2, 16, 128, 1024, 4096, 16384)}
    print("rounds:", rounds)
    if a.json:
        Path(a.json).write_text(json.dumps({
            "schema": "ringcomm.bench_world/1",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "launcher": "torchrun",
            "cores": os.cpu_count(), "runs": runs, "rounds_by_ranks": rounds}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
