"""Where the algorithm library (``ringcomm/library``) beats ringcomm's built-in
schedules, by the cost model (:mod:`ringcomm.bench.cost_model`): the source of the
library's rows in ``ringcomm/algorithms/select.py``'s ``DEFAULT_TUNING``.

    python scripts/library_tuning.py                         # print the bands
    python scripts/library_tuning.py --json docs/data/library_tuning.json

The library's algorithms have no measurements, so every candidate of a
collective is predicted with one set of parameters: alpha and beta fitted
jointly to the measured ringcomm schedules of that collective in
``docs/data/compare_2ranks.json`` (for allreduce: ring, tree and recursive
doubling together; at one world size the per-call overhead ``o`` cannot be told
from alpha, so alpha absorbs it, as :func:`ringcomm.bench.cost_model.fit` does),
gamma as that run measured it. The model counts messages, bytes on the busiest
link and bytes reduced, not local copies; Bruck copies the whole output once more
than the ring (its final rotation), so copies are charged too, at gamma (one
local pass over the bytes), counted from the schedules.

At each size the algorithm ``auto`` chose before the library (the built-in
rows of ``DEFAULT_TUNING``) is compared with the library's candidates; a library
algorithm takes the size only when it is predicted faster than that choice by
more than ``--margin`` (10%): within that, the built-in, which is measured and
tested under real launchers far more, stays.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import ringcomm  # noqa: E402,F401  (registers the library)
from ringcomm.execution import checker  # noqa: E402
from ringcomm.algorithms import REGISTRY, is_schedule, select  # noqa: E402
from ringcomm.bench import cost_model  # noqa: E402
from ringcomm.bench.sizes import format_size  # noqa: E402
from ringcomm.schedule import Context, Copy  # noqa: E402

#: collective -> (built-in candidates, library candidates)
CANDIDATES = {
    "allreduce": (("recursive_doubling", "tree", "ring"), ("rabenseifner", "double_tree")),
    "allgather": (("ring",), ("bruck",)),
    "alltoall": (("linear",), ("pairwise",)),
}
RANKS = (3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 64, 128, 256)


def joint_fit(doc: dict, collective: str) -> dict:
    """alpha, beta (least squares on relative error, o folded into alpha) over the
    measured ringcomm schedules of ``collective``; gamma as measured."""
    seg = int(doc["meta"]["ringcomm"]["segment_bytes"])
    gamma = float(doc["meta"].get("gamma_s_per_byte", {}).get("float/sum", 0.0))
    rows, used = [], set()
    for r in doc["results"]:
        build = REGISTRY.get(r["collective"], {}).get(r["column"])
        if (r["collective"] != collective or r["status"] != "ok" or r["time_us"] is None
                or build is None or not is_schedule(build)
                or r["column"] in CANDIDATES[collective][1]):
            continue
        p = int(doc["meta"]["world_size"])
        A, B, G = cost_model.features_for(collective, r["column"])(p, r["size"], seg)
        rows.append((A, B, G if collective in ("allreduce",) else 0.0, r["time_us"] * 1e-6))
        used.add(r["column"])
    a = np.array(rows)
    t = a[:, 3]
    y = (t - gamma * a[:, 2]) / t
    m = a[:, :2] / t[:, None]
    scale = np.abs(m).max(axis=0)
    x, *_ = np.linalg.lstsq(m / scale, y, rcond=None)
    alpha, beta = (max(0.0, v) for v in x / scale)
    pred = alpha * a[:, 0] + beta * a[:, 1] + gamma * a[:, 2]
    rms = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
    return {"alpha": alpha, "beta": beta, "gamma": gamma, "segment_bytes": seg,
            "rms_rel_err": rms, "samples": len(rows), "fitted_on": sorted(used)}


def copied(collective: str, algorithm: str, p: int, n: int, seg: int) -> int:
    """Bytes rank 0 copies locally (one byte per element, as the model counts)."""
    layout = checker.local_layout(collective, cost_model.layout_for(collective, p, n), 0, 0)
    sched = REGISTRY[collective][algorithm](Context(collective, p, 0, layout, seg=seg))
    return sum(op.dst.n for st in sched.steps for op in st.local if isinstance(op, Copy))


def predict(collective: str, algorithm: str, params: dict, p: int, n: int) -> float:
    seg = params["segment_bytes"]
    A, B, G = cost_model.features_for(collective, algorithm)(p, n, seg)
    t = params["alpha"] * A + params["beta"] * B + params["gamma"] * G
    if collective == "allgather":  # the one collective whose candidates copy differently
        t += params["gamma"] * copied(collective, algorithm, p, n, seg)
    return t


def builtin_table() -> dict:
    """``DEFAULT_TUNING`` without the rows that name library algorithms: what ``auto``
    chose before the library (first match wins, so the next row covers the gap)."""
    library = {name for _, names in CANDIDATES.values() for name in names} | {"hierarchical"}
    return {coll: {k: [row for row in rows if row[1] not in library]
                   for k, rows in by_size.items() if k != "hosts"}
            for coll, by_size in select.DEFAULT_TUNING.items()}


def bands(collective: str, params: dict, p: int, sizes: list[int], margin: float) -> list:
    """``[(first size, last size, choice, speedup)]``: at each size the built-in that
    ``auto`` chose before the library, or the best library algorithm where that is
    predicted faster than it by more than ``margin``; adjacent sizes with the same
    choice merged; speedup: the median over the band of (time of the built-in choice)
    / (time of the choice)."""
    table = builtin_table()
    _, library = CANDIDATES[collective]
    out: list = []
    for n in sizes:
        current = select.choose(table, collective, n, p)
        times = {a: predict(collective, a, params, p, n) for a in (current, *library)}
        best = min(library, key=times.get)
        win = best if times[best] * (1 + margin) < times[current] else current
        ratio = times[current] / times[win]
        if out and out[-1][2] == win:
            out[-1][1] = n
            out[-1][3].append(ratio)
        else:
            out.append([n, n, win, [ratio]])
    return [(a, b, w, round(float(np.median(r)), 2)) for a, b, w, r in out]


def table_check(collective: str, params: dict, p: int, sizes: list[int], band: list) -> dict:
    """How far ``auto``'s choice with the shipped ``DEFAULT_TUNING`` is from the
    model's choice (``band``, from :func:`bands`): sizes where they differ and the
    worst predicted slowdown there."""
    table = select.load_tuning(None)
    want = {n: w for a, b, w, _ in band for n in sizes if a <= n <= b}
    differ, worst = 0, 1.0
    for n in sizes:
        # the table's bytes: the whole buffer for allreduce, one chunk for allgather
        got = select.choose(table, collective, n if collective == "allreduce" else -(-n // p), p)
        if got != want[n]:
            differ += 1
            worst = max(worst, predict(collective, got, params, p, n)
                        / predict(collective, want[n], params, p, n))
    return {"sizes_differing": differ, "worst_slowdown": round(worst, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(ROOT / "docs" / "data" / "compare_2ranks.json"),
                    help="python -m ringcomm.bench --json results to fit the parameters to")
    ap.add_argument("--ranks", default=",".join(map(str, RANKS)), help="world sizes")
    ap.add_argument("--collectives", default=",".join(CANDIDATES), help="comma list")
    ap.add_argument("--margin", type=float, default=0.10,
                    help="how much faster a library algorithm must be predicted to be")
    ap.add_argument("--max-bytes", type=int, default=1 << 30, help="largest size scanned")
    ap.add_argument("--json", help="write the parameters and bands here")
    args = ap.parse_args(argv)
    results = Path(args.results).resolve()
    doc = json.loads(results.read_text())
    octaves = int(math.log2(args.max_bytes))
    sizes = sorted({int(round(2 ** (k / 4))) for k in range(4 * octaves + 1)})
    source = str(results.relative_to(ROOT)) if ROOT in results.parents else str(results)
    report = {"source": source, "margin": args.margin, "collectives": {}}
    for coll in args.collectives.split(","):
        params = joint_fit(doc, coll)
        print(f"# {coll}: alpha {params['alpha'] * 1e6:.1f} us, beta "
              f"{params['beta'] * 1e9:.3f} ns/B, gamma {params['gamma'] * 1e9:.3f} ns/B "
              f"(fitted on {', '.join(params['fitted_on'])}: {params['samples']} timings, rms "
              f"relative error {params['rms_rel_err']:.2f})", flush=True)
        per_p = {}
        for p in map(int, args.ranks.split(",")):
            bs = bands(coll, params, p, sizes, args.margin)
            check = table_check(coll, params, p, sizes, bs)
            per_p[str(p)] = {"bands": [{"from": a, "to": b, "winner": w, "speedup": r}
                                       for a, b, w, r in bs], "shipped_table": check}
            print(f"  p={p:4d} [table: {check['sizes_differing']} sizes differ, worst "
                  f"x{check['worst_slowdown']}]: " + "; ".join(
                f"{format_size(a)}-{format_size(b)} {w}" + (f" (x{r})" if w in CANDIDATES[coll][1]
                                                            else "")
                for a, b, w, r in bs), flush=True)
        report["collectives"][coll] = {"params": params, "bands": per_p}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
