"""The torch version x feature table of docs/integrations.md, from runs of the test
suite's per-rank programs on each torch.

For every interpreter given (default: each ``.venv*/bin/python`` here, one per
torch, as ``make install TORCH_SPEC=...`` makes them), runs under that
environment's ``mpiexec``:

* ``tests/ranks/contract_check.py`` (3 ranks, and 2 with ``device_id``): torch's
  backend contract against gloo, one ``feature:`` line per feature;
* the collectives, the rest of torch.distributed and torch's DDP against gloo, and
  ringcomm's DDP against one process (the programs ``make test-compat`` runs).

Writes ``docs/data/torch_compat.json`` and the table between the markers in
docs/integrations.md. Exits non-zero when any program failed on any torch.

    python scripts/torch_compat.py [--python .venv-torch-2.15.0/bin/python ...]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANKS = ROOT / "tests" / "ranks"
DATA = ROOT / "docs" / "data" / "torch_compat.json"
DOC = ROOT / "docs" / "integrations.md"
BEGIN, END = "<!-- torch-compat:begin -->", "<!-- torch-compat:end -->"

#: row name -> (program, ranks, arguments); its cell says whether every check passed
PROGRAMS = {
    "every collective vs gloo (3 ranks)": ("collectives_check.py", 3, ()),
    "the rest of torch.distributed vs gloo": ("more_collectives_check.py", 2, ()),
    "torch's DistributedDataParallel vs gloo": ("torch_ddp_check.py", 2, ()),
    "ringcomm's ddp/ vs one process": ("ddp_equivalence.py", 2, ("--quick",)),
}


def run(python: str, program: str, n: int, args: tuple, timeout: float = 600) -> dict:
    """One launch: exit status, checks passed per rank, rank 0's feature lines."""
    mpiexec = str(Path(python).parent / "mpiexec")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.monotonic()
    try:
        proc = subprocess.run([mpiexec, "-n", str(n), python, str(RANKS / program), *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired:
        out, rc = "", 124
    checks = [int(k) for _, k in sorted(re.findall(r"rank (\d+): (\d+) checks passed", out))]
    features = {}
    decoder = json.JSONDecoder()
    for m in re.finditer(r"feature: ", out):  # ranks' lines may run into each other
        try:
            f, _ = decoder.raw_decode(out, m.end())
        except ValueError:
            continue
        features.setdefault(f["feature"], f["outcome"])
    return {"program": program, "ranks": n, "exit_status": rc, "checks": checks,
            "ok": rc == 0 and len(checks) == n, "features": features,
            "seconds": round(time.monotonic() - t0, 1),
            "tail": "" if rc == 0 else out[-1500:]}


def version(python: str) -> str:
    return subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, check=True).stdout.strip()


def measure(python: str) -> dict:
    runs = [run(python, "contract_check.py", 3, ()), run(python, "contract_check.py", 2,
                                                          ("device_id",))]
    rows = {}
    for run_ in runs:
        for feat, outcome in run_["features"].items():
            rows[feat] = outcome if run_["ok"] else f"FAILED ({outcome})"
    for row, (program, n, args) in PROGRAMS.items():
        r = run(python, program, n, args)
        runs.append(r)
        rows[row] = f"same results ({sum(r['checks'])} checks)" if r["ok"] else "FAILED"
    front = subprocess.run([python, str(ROOT / "scripts" / "bench_front.py")],
                           capture_output=True, text=True, check=True).stdout
    return {"torch": version(python), "rows": rows, "runs": runs,
            "front": json.loads(front.strip().splitlines()[-1])}


def table(results: list[dict]) -> str:
    """Markdown: one row per feature, one column per torch (oldest first)."""
    results = sorted(results, key=lambda r: [int(x) for x in
                                             re.findall(r"\d+", r["torch"].split("+")[0])])
    names: list[str] = []
    for r in results:
        names += [n for n in r["rows"] if n not in names]
    head = "| feature | " + " | ".join(f"torch {r['torch']}" for r in results) + " |"
    lines = [head, "|---" * (len(results) + 1) + "|"]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(r["rows"].get(n, "not run") for r in results) + " |")
    return "\n".join(lines)


def rendered(text: str, data: dict) -> str:
    """``text`` (docs/integrations.md) with the table of ``data`` between its markers."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"the markers {BEGIN} ... {END} are missing")
    fronts = [r["front"] for r in data["results"] if "backend_us" in r.get("front", {})]
    cost = "".join(
        f"\n\nA do-nothing 4 KiB `all_reduce` through torch {f['torch']}'s dispatch "
        f"(`scripts/bench_front.py`): {f['process_group_us']:.1f} us into a Python "
        f"`ProcessGroup`, {f['backend_us']:.1f} us into a Python `Backend` under torch's "
        f"`ProcessGroup`." for f in fronts)
    body = (f"{BEGIN}\nGenerated by `scripts/torch_compat.py` from `docs/data/torch_compat.json` "
            f"({data['when']}, {data['machine']}): each cell is the outcome of the test "
            f"suite's per-rank program on that torch.\n\n{table(data['results'])}{cost}\n{END}")
    return text[:text.index(BEGIN)] + body + text[text.index(END) + len(END):]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", nargs="*", help="interpreters, one per torch (default: "
                    "every .venv*/bin/python here)")
    ap.add_argument("--render-only", action="store_true",
                    help="only write the table from the committed JSON")
    args = ap.parse_args()
    if args.render_only:
        DOC.write_text(rendered(DOC.read_text(), json.loads(DATA.read_text())))
        return 0
    pythons = args.python or sorted(str(p) for p in ROOT.glob(".venv*/bin/python"))
    if not pythons:
        raise SystemExit("no interpreters: make install TORCH_SPEC=... first, or pass --python")
    results = []
    for py in pythons:
        print(f"torch_compat: {py}", flush=True)
        results.append(measure(py))
        for name, cell in results[-1]["rows"].items():
            print(f"  {results[-1]['torch']}: {name}: {cell}", flush=True)
    data = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": f"{os.cpu_count()} cores, CPU only", "results": results}
    DATA.write_text(json.dumps(data, indent=1) + "\n")
    DOC.write_text(rendered(DOC.read_text(), data))
    failed = [f"{r['torch']}: {x['program']} {' '.join(x.get('args', ()))}".strip()
              for r in results for x in r["runs"] if not x["ok"]]
    for f in failed:
        print(f"torch_compat: FAILED on {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
