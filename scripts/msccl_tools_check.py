"""msccl-tools' own example algorithms on ringcomm: generate them with msccl-tools'
scripts, load and prove each with ringcomm.msccl, and run them against gloo.

msccl-tools is not a dependency and none of its files are committed: point
``--tools`` at a checkout of it, and ``--python`` at an interpreter that has its
requirement (lxml). Each example script in :data:`EXAMPLES` writes an XML for
each world size of ``--ranks``. Each XML is then:

1. loaded and proven by ``ringcomm.msccl.load`` (the checker, before it runs);
2. with ``--run``, registered on every rank of an ``mpiexec -n N`` job on this
   machine and run through ``torch.distributed``, compared with gloo.

    python scripts/msccl_tools_check.py --tools ~/msccl-tools --python ~/mt/bin/python \\
        --ranks 2,3,4,5,6,7,8 --run --json docs/data/msccl_tools.json

The JSON lists, per example and world size, whether msccl-tools wrote it, and
whether ringcomm loaded, proved and ran it to gloo's results, or why not.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: (name, script under examples/mscclang, its arguments with {n} for the ranks)
EXAMPLES = [
    ("allreduce ring (simple)", "simple/allreduce_ring.py", "{n} 1"),
    ("allreduce ring", "allreduce_a100_ring.py", "{n} 1 1 --protocol Simple"),
    ("allreduce all-pairs", "allreduce_a100_allpairs.py", "{n} 1 --protocol Simple"),
    ("allreduce recursive halving-doubling", "allreduce_recursive_doubling_halving.py",
     "{n} 1 --protocol Simple"),
    ("allreduce binomial tree", "allreduce_binomial_tree.py", "{n} 1 1 --protocol Simple"),
    ("allreduce one step", "allreduce_1step.py", "{n} 1 --protocol Simple"),
    ("allgather ring", "allgather_ring.py", "{n} 1 1 --protocol Simple"),
    ("allgather all-pairs", "allgather_allpairs.py", "{n} 1 --protocol Simple"),
    ("allgather recursive doubling", "allgather_recursive_doubling.py", "{n} 1"),
    ("alltoall all-pairs", "alltoall_allpairs.py", "{n} 1"),
    ("reducescatter all-pairs", "reducescatter_allpairs.py", "{n} --protocol Simple"),
]


def generate(tools: pathlib.Path, python: str, script: str, args: str, n: int,
             out: pathlib.Path) -> str | None:
    """Run msccl-tools' ``script`` for ``n`` ranks into ``out``; None, or why it failed."""
    cmd = [python, str(tools / "examples" / "mscclang" / script), *args.format(n=n).split()]
    env = {**os.environ, "PYTHONPATH": str(tools)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0 or "<algo" not in proc.stdout:
        last = (proc.stderr.strip().splitlines() or ["no XML written"])[-1]
        return f"msccl-tools' script failed: {last[:300]}"
    out.write_text(proc.stdout)
    return None


def worker(folder: str) -> int:
    """Per rank, under mpiexec: every XML in ``folder`` against gloo; rank 0 prints
    one ``msccl-run: {...}`` line per file."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import ringcomm
    from ringcomm import msccl

    dist.init_process_group("ringcomm", timeout=timedelta(seconds=120))
    rank, p = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    g = torch.Generator().manual_seed(rank)
    for f in sorted(pathlib.Path(folder).glob("*.xml")):
        alg = msccl.load(f)
        name = ringcomm.register_msccl(f, name=f"tools_{f.stem}", replace=True)
        coll = alg.collective
        per = alg.chunks if coll == "allreduce" else alg.chunks // p
        worst, error = 0.0, None
        ringcomm.set_algorithm(coll, name)
        try:
            for k in (1, 37, 1000):
                n = per * k
                x = torch.randn(n * (1 if coll == "allreduce" else p), generator=g)
                if coll == "allreduce":
                    ours, ref = x.clone(), x.clone()
                    dist.all_reduce(ours)
                    dist.all_reduce(ref, group=gloo)
                elif coll == "allgather":
                    x = x[:n].contiguous()
                    ours, ref = torch.empty(n * p), torch.empty(n * p)
                    dist.all_gather_into_tensor(ours, x)
                    dist.all_gather_into_tensor(ref, x, group=gloo)
                elif coll == "reduce_scatter":
                    ours, ref = torch.empty(n), torch.empty(n)
                    dist.reduce_scatter_tensor(ours, x)
                    dist.reduce_scatter_tensor(ref, x, group=gloo)
                else:
                    ours, ref = torch.empty(n * p), torch.empty(n * p)
                    dist.all_to_all_single(ours, x)
                    dist.all_to_all_single(ref, x, group=gloo)
                diff = (ours - ref).abs().max().item() if ours.numel() else 0.0
                worst = max(worst, diff)
        except Exception as e:  # noqa: BLE001 - reported, the next file runs
            error = f"{type(e).__name__}: {e}"[:400]
        ringcomm.set_algorithm(coll, "auto")
        diffs = [None] * p
        dist.all_gather_object(diffs, (worst, error), group=gloo)
        if rank == 0:
            errors = [e for _, e in diffs if e]
            print("msccl-run: " + json.dumps({
                "file": f.name, "max_diff": max(d for d, _ in diffs),
                "ok": not errors and max(d for d, _ in diffs) <= 1e-4,
                "error": errors[0] if errors else None}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tools", help="a checkout of msccl-tools")
    ap.add_argument("--python", default=sys.executable,
                    help="an interpreter with msccl-tools' requirements (lxml)")
    ap.add_argument("--ranks", default="2,3,4,5,8", help="world sizes (comma list)")
    ap.add_argument("--run", action="store_true", help="also run each under mpiexec vs gloo")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--commit", help="the checkout's commit, when it is not a git work tree")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a.worker)
    if not a.tools:
        ap.error("--tools (a checkout of msccl-tools) is needed")
    tools = pathlib.Path(a.tools).expanduser()
    if not (tools / "examples" / "mscclang").is_dir():
        ap.error(f"--tools {tools}: no examples/mscclang in it")
    from ringcomm import msccl

    ranks = [int(x) for x in a.ranks.split(",") if x.strip()]
    rows = []
    work = pathlib.Path(tempfile.mkdtemp(prefix="msccl-tools-check-"))
    try:
        for name, script, args in EXAMPLES:
            for n in ranks:
                row = {"example": name, "script": script, "args": args.format(n=n), "ranks": n}
                xml = work / f"{n}" / f"{pathlib.Path(script).stem}.xml"
                xml.parent.mkdir(exist_ok=True)
                why = generate(tools, a.python, script, args, n, xml)
                row["generated"] = why is None
                if why is not None:
                    row["why"] = why
                    rows.append(row)
                    continue
                try:
                    alg = msccl.load(xml)
                    stats = alg.prove(multiple=3, seg=2)
                    row.update(loaded=True, collective=alg.collective, chunks=alg.chunks,
                               rounds=stats.rounds)
                except ValueError as e:
                    row.update(loaded=False, why=str(e)[:500])
                    xml.unlink()
                rows.append(row)
                print(f"{name:40s} {n} ranks: "
                      f"{'loaded, proven' if row.get('loaded') else row.get('why')}", flush=True)
        if a.run:
            mpiexec = shutil.which("mpiexec", path=str(pathlib.Path(sys.executable).parent)) \
                or "mpiexec"
            for n in ranks:
                folder = work / f"{n}"
                if not any(folder.glob("*.xml")):
                    continue
                t0 = time.monotonic()
                proc = subprocess.run([mpiexec, "-n", str(n), sys.executable, __file__,
                                       "--worker", str(folder)], capture_output=True,
                                      text=True, timeout=1800, cwd=ROOT)
                runs = {}
                for line in proc.stdout.splitlines():
                    if line.startswith("msccl-run: "):
                        r = json.loads(line[len("msccl-run: "):])
                        runs[r["file"]] = r
                for row in rows:
                    if row["ranks"] == n and row.get("loaded"):
                        r = runs.get(f"{pathlib.Path(row['script']).stem}.xml")
                        row["vs_gloo"] = (r if r is not None else
                                          {"ok": False, "error": proc.stderr[-400:]})
                print(f"ran {n} ranks in {time.monotonic() - t0:.0f} s: "
                      f"{sum(1 for r in runs.values() if r['ok'])} of {len(runs)} match gloo",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        head = subprocess.run(["git", "-C", str(tools), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip() or a.commit
        with open(a.json, "w") as f:
            json.dump({"schema": "ringcomm.msccl_tools_check/1",
                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "msccl_tools": head, "ranks": ranks, "rows": rows}, f, indent=1)
    bad = [r for r in rows if r["generated"] and (not r.get("loaded") or
                                                 not r.get("vs_gloo", {"ok": True})["ok"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
