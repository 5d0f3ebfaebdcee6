#!/usr/bin/env python3
"""How long the simulator takes: a ring allreduce at 1,024 and 16,384 ranks.

    python scripts/bench_sim.py --json docs/data/sim_speed.json

Each case is simulated ``--repeat`` times in one process, the best kept (the first
run also makes the routes, which later runs of one topology reuse; every run
builds and samples the schedules again). The targets (docs/simulator.md): 5 s at
1,024 ranks, 60 s at 16,384. Also, for comparison, the 1,024-rank ring timed event
by event (``engine="events"``) rather than round by round.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ringcomm.algorithms import REGISTRY  # noqa: E402
from ringcomm.sim import load, simulate  # noqa: E402

TOPOLOGIES = ROOT / "examples" / "topologies"
#: (topology file, message bytes, engine, target seconds or None)
CASES = [("fat_tree_1024.json", 16 << 20, "auto", 5.0),
         ("fat_tree_16k.json", 16 << 20, "auto", 60.0),
         ("fat_tree_1024.json", 16 << 20, "events", None)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the runs here")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args(argv)
    runs = []
    for name, nbytes, engine, target in CASES:
        topo = load(TOPOLOGIES / name)
        best = None
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            r = simulate("allreduce", "ring", REGISTRY["allreduce"]["ring"], topo, nbytes,
                         engine=engine, budget_s=600)
            took = time.perf_counter() - t0
            if r.refused:
                print(f"{name}: {r.refused}", file=sys.stderr)
                return 1
            best = took if best is None else min(best, took)
        row = {"topology": f"examples/topologies/{name}", "ranks": topo.size, "bytes": nbytes,
               "algorithm": "ring", "engine": r.engine, "source": r.source,
               "seconds": round(best, 2), "target_s": target,
               "met": None if target is None else best <= target,
               "predicted_us": round(r.seconds * 1e6, 1), "messages": r.messages,
               "events": r.events}
        runs.append(row)
        print(f"{topo.size:>6} ranks, {r.engine:>6}: {best:6.2f} s "
              f"(target {target or '-'}), predicted {r.seconds * 1e3:.2f} ms, "
              f"{r.messages:,} messages, {r.events:,} events")
    doc = {"schema": "ringcomm.bench_sim/1",
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cores": os.cpu_count(),
           "repeat": a.repeat, "runs": runs}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(r["met"] is not False for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
