#!/usr/bin/env python3
"""What a proof costs at scale: every built-in and library schedule builder proved
by the checker (contents included) at the given world sizes, each in a process of
its own, timed, with its peak memory.

    python scripts/bench_proofs.py --ranks 1024 --json docs/data/proofs_1024.json
    python scripts/bench_proofs.py --ranks 4096 --collective allreduce --whole \
        --algorithms tree,recursive_doubling,... --json docs/data/proofs_4096.json

Per algorithm: every layout of ``ringcomm.execution.checker.shapes(collective, p, 1)``
(even, uneven, with empty chunks), one segment per chunk (``--whole``: each
message in one piece, so a pipelined tree has one segment, not p); ``one_shot``, which sends
every rank's whole buffer to every rank, gets a buffer of 3 elements in 3 segments
(at ``3p`` elements it would move ``3p^3``). ``hierarchical`` runs with 8 ranks a
host. A proof that fails, or runs out of ``--timeout``, is recorded as such.
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


def layouts(collective: str, name: str, p: int, whole: bool) -> list[tuple]:
    from ringcomm.execution.checker import shapes
    if name == "one_shot":
        return [((3,), 1), ((2,), 1)]
    if whole:  # the same layouts, each message in one piece
        return [(layout, 1 << 30) for layout, _ in shapes(collective, p, 1)]
    return shapes(collective, p, 1)


def one(collective: str, name: str, p: int, whole: bool) -> dict:
    """Prove one algorithm at ``p`` ranks (in this process); its times, counts and
    peak resident memory."""
    import ringcomm
    from ringcomm.execution import checker
    build = ringcomm.REGISTRY[collective][name]
    hosts = tuple(r // 8 for r in range(p)) if name == "hierarchical" else ()
    out = []
    for layout, seg in layouts(collective, name, p, whole):
        t = time.perf_counter()
        st = checker.check(build, collective, p, layout, seg=seg, hosts=hosts)
        out.append({"seconds": round(time.perf_counter() - t, 2), "seg": seg,
                    "elements": sum(_leaves(layout)), "steps_max": st.steps_max,
                    "messages": st.messages, "rounds": st.rounds})
    return {"layouts": out}


def _leaves(layout) -> list[int]:
    return [y for x in layout for y in (_leaves(x) if isinstance(x, tuple) else [x])]


def measure(collective: str, name: str, p: int, timeout: float, whole: bool) -> dict:
    """:func:`one` in a child process of its own (so that its peak memory is its own)."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--one", collective, name, str(p)]
                            + ["--whole"] * whole,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"proved": False, "error": f"over the {timeout:g} s limit"}
    row = {"seconds": round(time.perf_counter() - t, 2)}
    if proc.returncode:
        return {**row, "proved": False, "error": (err.strip().splitlines() or ["?"])[-1]}
    return {**row, **json.loads(out.strip().splitlines()[-1]), "proved": True}


def algorithms(collective: str | None) -> list[tuple[str, str]]:
    import ringcomm
    from ringcomm.algorithms import is_schedule
    return [(c, n) for c, algos in ringcomm.REGISTRY.items() for n, b in algos.items()
            if is_schedule(b) and collective in (None, c)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1024")
    ap.add_argument("--collective")
    ap.add_argument("--algorithms", help="comma-separated names (default: every one)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--whole", action="store_true",
                    help="every message in one piece (no pipeline segments): the proofs "
                         "that reach 4,096 ranks")
    ap.add_argument("--json")
    ap.add_argument("--merge", action="store_true",
                    help="replace these runs' rows in --json, keep its others")
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        import resource
        row = one(a.one[0], a.one[1], int(a.one[2]), a.whole)
        row["peak_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps(row))
        return 0
    runs = []
    for p in (int(x) for x in a.ranks.split(",")):
        for c, n in algorithms(a.collective):
            if a.algorithms and n not in a.algorithms.split(","):
                continue
            row = {"collective": c, "algorithm": n, "ranks": p, **measure(c, n, p, a.timeout, a.whole)}
            if "peak_kib" in row:
                row["peak_mib"] = round(row.pop("peak_kib") / 1024, 1)
            runs.append(row)
            print(f"{c:15s} {n:20s} {p:6d} ranks: "
                  + (f"proved in {row['seconds']:.1f} s, {row['peak_mib']:.0f} MiB"
                     if row["proved"] else f"NOT PROVED: {row['error']}"), flush=True)
    if a.json:
        doc = {"schema": "ringcomm.bench_proofs/1",
               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "cores": os.cpu_count(), "segments": "whole" if a.whole else "one a chunk",
               "runs": runs}
        if a.merge and Path(a.json).exists():
            old = json.loads(Path(a.json).read_text())
            if old.get("segments", "one a chunk") != doc["segments"]:
                raise SystemExit(f"bench_proofs: {a.json} holds other segments")
            key = (lambda r: (r["collective"], r["algorithm"], r["ranks"]))
            new = {key(r): r for r in runs}
            doc["runs"] = [new.pop(key(r), r) for r in old["runs"]] + list(new.values())
            doc["started"] = old["started"]
            now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            doc["remeasured"] = {**old.get("remeasured", {}),
                                 **{" ".join(map(str, key(r))): now for r in runs}}
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(r["proved"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
