#!/usr/bin/env python3
"""What one rank's plan costs at scale: for every allreduce schedule (built-in and
library) at p ranks, the time to build the schedule and compile it into a Plan,
and the bytes the cached Plan holds; and what the plan cache holds at most
(``PLAN_CACHE_SIZE`` plans and ``PLAN_CACHE_BYTES`` of them, as ``Plan.nbytes``
counts them).

    python scripts/bench_plans.py --ranks 64,1024,16384 --json docs/data/plans.json

The call: a 64 MiB float32 allreduce (16,777,216 elements) in the default 2 MiB
segments, on rank p/3 (neither an end of a ring nor the root of a tree);
``hierarchical`` with 8 ranks a host. Times are the best of ``--repeat`` builds;
bytes are what ``tracemalloc`` counts as held once the plan is built and its
schedule dropped, as in the cache.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ELEMENTS = 16 * 1024 * 1024
SEG = 2 * 1024 * 1024 // 4


def measure(name: str, p: int, repeat: int) -> dict:
    import ringcomm
    from ringcomm.execution.plan import Plan
    from ringcomm.schedule import Context
    build = ringcomm.REGISTRY["allreduce"][name]
    hosts = tuple(r // 8 for r in range(p)) if name == "hierarchical" else ()
    ctx = Context("allreduce", p, p // 3, (ELEMENTS,), 0, SEG, hosts)
    best_build = best_plan = float("inf")
    gc.collect()
    for _ in range(repeat):
        t = time.perf_counter()
        schedule = build(ctx)
        t1 = time.perf_counter()
        plan = Plan(schedule)
        t2 = time.perf_counter()
        best_build, best_plan = min(best_build, t1 - t), min(best_plan, t2 - t1)
        steps = len(schedule.steps)
        del schedule, plan
    gc.collect()
    tracemalloc.start()
    plan = Plan(build(ctx))
    gc.collect()
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    messages, nbytes = plan.nmessages, plan.nbytes
    del plan
    return {"algorithm": name, "ranks": p, "steps": steps, "messages": messages,
            "nbytes": nbytes,
            "build_s": round(best_build, 4), "plan_s": round(best_plan, 4),
            "bytes": held, "peak_bytes": peak}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="64,1024,16384")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    import ringcomm
    from ringcomm.algorithms import is_schedule
    from ringcomm.front.planner import PLAN_CACHE_BYTES, PLAN_CACHE_SIZE
    names = [n for n, b in ringcomm.REGISTRY["allreduce"].items() if is_schedule(b)]
    runs = []
    for p in (int(x) for x in a.ranks.split(",")):
        for name in names:
            row = measure(name, p, a.repeat)
            runs.append(row)
            print(f"{name:20s} {p:6d} ranks: {row['steps']:6d} steps, build "
                  f"{row['build_s'] * 1e3:8.1f} ms, plan {row['plan_s'] * 1e3:8.1f} ms, "
                  f"{row['bytes'] / 2**20:7.2f} MiB held", flush=True)
    # the cache counts Plan.nbytes; what tracemalloc saw held, as a share of it
    worst = max(r["bytes"] / r["nbytes"] for r in runs)
    cache = {"plans_at_most": PLAN_CACHE_SIZE, "bytes_at_most": PLAN_CACHE_BYTES,
             "held_per_counted_at_most": round(worst, 3)}
    print(f"plan cache: at most {PLAN_CACHE_SIZE} plans and {PLAN_CACHE_BYTES / 2**20:.0f} MiB "
          f"a group, as Plan.nbytes counts; what a plan holds is at most {worst:.3f}x that")
    if a.json:
        doc = {"schema": "ringcomm.bench_plans/2",
               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cores": os.cpu_count(),
               "elements": ELEMENTS, "seg": SEG, "runs": runs, "cache": cache}
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
