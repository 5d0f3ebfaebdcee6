#!/usr/bin/env python3
"""The one check of ringcomm's CUDA path, for a machine with one (or more) GPUs.

Run through ``scripts/gpu_check.sh``. It installs nothing: CUDA torch and CuPy
with NCCL must be there; MPI need not be (CUDA tensors do not use it).

1. Prints the versions (torch, CUDA, GPU, CuPy, NCCL as CuPy loads it and as torch
   has it) and picks how two ranks share one GPU: NCCL >= 2.30.3 allows it with
   ``NCCL_MULTI_RANK_GPU_ENABLE=1``; older NCCL gets a distinct ``NCCL_HOSTID`` per
   rank with ``NCCL_SOCKET_IFNAME=lo``, so the ranks look like two hosts to it.
2. At world size 1 and 2 (torchrun), on CUDA tensors: every collective with every
   algorithm against a single-process oracle (``ringcomm.testing.check_collectives``,
   fp32/bf16/fp16/int64 x sum/prod/min/max/avg), then allreduce, broadcast,
   allgather and reduce_scatter with every algorithm x dtype x op against torch's
   own ``nccl`` backend, then DDP equivalence (``ddp.DistributedDataParallel`` and
   torch's DDP over ringcomm, against one process on the whole batch).
3. A busbw table, 1 KiB to 256 MiB, of ring, tree, native and torch's nccl
   (``python -m ringcomm.bench --device cuda``).
4. Writes everything to ``docs/gpu-results.md`` (and JSON next to it).

Exit status: 0 when every check passed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = ("1K", "256M")
#: the whole check must end within this (gpu_check.sh kills it a little later)
BUDGET_S = 225.0
#: kept back at the end for writing the report
REPORT_S = 5.0


def versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "gpus": [], "cupy": None, "nccl_cupy": None,
           "nccl_torch": None}
    if torch.cuda.is_available():
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            v = torch.cuda.nccl.version()
            out["nccl_torch"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001
            out["nccl_torch"] = f"unknown ({e})"
    try:
        import cupy
        out["cupy"] = cupy.__version__
        sys.path.insert(0, str(ROOT))
        from ringcomm.transport import nccl
        out["nccl_cupy"] = nccl.version(nccl.load())
    except Exception as e:  # noqa: BLE001
        out["cupy_error"] = f"{type(e).__name__}: {e}"
    return out


def sharing(nccl_version: str | None) -> tuple[str, dict]:
    """How two ranks share one GPU with this NCCL, and the environment for it."""
    parts = tuple(int(x) for x in (nccl_version or "0.0.0").split(".")[:3])
    if parts >= (2, 30, 3):
        return ("NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30.3)",
                {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_SOCKET_IFNAME": "lo"})
    return ("a distinct NCCL_HOSTID per rank with NCCL_SOCKET_IFNAME=lo (NCCL < 2.30.3: "
            "the ranks look like two hosts, so NCCL uses its network transport)",
            {"RINGCOMM_NCCL_HOSTID_PER_RANK": "1", "NCCL_SOCKET_IFNAME": "lo"})


def run(cmd: list[str], env: dict, timeout: float, log: list[str]) -> int:
    """Run ``cmd`` in a process group of its own; on timeout the whole group (torchrun
    and its workers) is killed, so no worker is left spinning on the GPU."""
    print("$ " + " ".join(cmd), flush=True)
    log.append("$ " + " ".join(cmd))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=max(timeout, 1.0))
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        rc = 124
        text = (text or "") + f"\n(timed out after {timeout:.0f}s; killed)"
    print(text, flush=True)
    log.append(text.rstrip())
    log.append(f"(exit status {rc})")
    return rc


def driver(args: argparse.Namespace) -> int:
    start = time.monotonic()
    deadline = start + args.budget - REPORT_S

    def left(share: float) -> float:
        """Seconds for the next stage: ``share`` of what is left of the budget."""
        return max(5.0, (deadline - time.monotonic()) * share)

    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    # Queried in a child process: this one must not hold a CUDA context while the
    # workers run (a GPU in exclusive-process mode takes one process at a time).
    try:
        out = subprocess.run([sys.executable, str(Path(__file__)), "--versions"],
                             capture_output=True, text=True, timeout=60)
        v = json.loads(out.stdout)
    except (subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        v = {"gpus": [], "cupy_error": f"the version query failed: {e}"}
    print(json.dumps(v, indent=1), flush=True)
    out_dir = Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / "data"
    data.mkdir(exist_ok=True)
    log: list[str] = []
    mech, share_env = sharing(v.get("nccl_cupy"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                   os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    results: dict = {"started": started, "versions": v, "two_ranks_on_one_gpu": mech,
                     "worlds": {}, "bench": None}
    rc_all = 0
    if not v["gpus"] or v.get("cupy_error"):
        why = "no CUDA device" if not v.get("gpus") else v["cupy_error"]
        print(f"gpu_check: cannot run: {why}", flush=True)
        rc_all = 1
    else:
        for world, share in ((1, 0.25), (2, 0.45)):
            wenv = dict(env, **share_env) if world > 1 and len(v["gpus"]) < world else env
            js = data / f"gpu_check_world{world}.json"
            js.unlink(missing_ok=True)
            rc = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      f"--nproc-per-node={world}", str(Path(__file__)), "--worker",
                      "--json", str(js)], wenv, left(share), log)
            results["worlds"][str(world)] = (json.loads(js.read_text()) if js.exists()
                                            else {"error": f"exit status {rc}, no results"})
            results["worlds"][str(world)]["exit_status"] = rc
            rc_all |= rc != 0
        world = 2
        benv = dict(env, **share_env) if len(v["gpus"]) < world else env
        bj, bm = data / "gpu_bench.json", data / "gpu_bench.md"
        for f in (bj, bm):
            f.unlink(missing_ok=True)
        rc = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc-per-node={world}", "-m", "ringcomm.bench",
                  "--device", "cuda", "--algos", "ring,tree,native", "--peers", "nccl",
                  "-b", SIZES[0], "-e", SIZES[1], "-f", "4", "-c", "-w", "2", "-n", "3",
                  "--rounds", "2", "--min-time", "0", "--no-model", "--targets", "none",
                  "--json", str(bj), "--markdown", str(bm)], benv, left(1.0), log)
        skipped = bench_skips(bj)
        results["bench"] = {"exit_status": rc, "skipped": skipped,
                            "markdown": bm.read_text() if bm.exists() else None}
        rc_all |= rc != 0 or bool(skipped)
    results["passed"] = rc_all == 0
    (data / "gpu_check.json").write_text(json.dumps(results, indent=1))
    Path(args.out).write_text(report(results, log))
    print(f"gpu_check: {'PASSED' if rc_all == 0 else 'FAILED'}; wrote {args.out}", flush=True)
    return 1 if rc_all else 0


def bench_skips(path: Path) -> list[str]:
    """The benchmark's columns that did not run (a check that measured nothing fails)."""
    if not path.exists():
        return ["no results were written"]
    doc = json.loads(path.read_text())
    return sorted({f"{r['column']}: {r.get('reason')}" for r in doc.get("results", [])
                   if r.get("status") in ("skipped", "error")})


def report(r: dict, log: list[str]) -> str:
    v = r["versions"]
    lines = [
        "# ringcomm on a GPU: results of scripts/gpu_check.sh",
        "",
        f"Run {r['started']}: **{'all checks passed' if r['passed'] else 'FAILED'}**.",
        "",
        f"- GPU(s): {', '.join(v['gpus']) or 'none'}",
        f"- torch {v['torch']} (CUDA {v['torch_cuda']}, NCCL {v['nccl_torch']}), "
        f"CuPy {v['cupy']} (NCCL {v['nccl_cupy']}), Python {v['python']}",
        f"- two ranks on one GPU: {r['two_ranks_on_one_gpu']}",
        "",
        "## Checks",
        "",
        "| world size | checks passed | failures | DDP |",
        "|---|---|---|---|",
    ]
    for world, w in r["worlds"].items():
        if "error" in w:
            lines.append(f"| {world} | - | {w['error']} | - |")
            continue
        lines.append(f"| {world} | {w['checks']} | {len(w['failures'])} | "
                     f"{'; '.join(w.get('ddp', [])) or '-'} |")
    fails = [f"- world {k}: {f}" for k, w in r["worlds"].items() for f in w.get("failures", [])]
    if fails:
        lines += ["", "Failures:", "", *fails[:60]]
    lines += ["", "## Bus bandwidth (2 ranks)", ""]
    bench = r.get("bench") or {}
    if bench.get("skipped"):
        lines += ["Columns that did not run: " + "; ".join(bench["skipped"]), ""]
    lines.append(bench.get("markdown") or f"not measured (exit status {bench.get('exit_status')})")
    lines += ["", "## Log", "", "```", *("\n".join(log)[-20000:].splitlines()), "```", ""]
    return "\n".join(lines)


# -- the per-rank part ---------------------------------------------------------------

def worker(args: argparse.Namespace) -> int:
    rank = int(os.environ.get("RANK", "0"))
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests" / "ranks"))
    from ringcomm.bench.columns import host_id_per_rank

    host_id_per_rank()  # before NCCL starts
    import torch
    import torch.distributed as dist

    import ringcomm
    from ringcomm.testing import check_collectives

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    # torch's GPU idiom: the group bound to this rank's device, its NCCL
    # communicators made at once (eager_connect_single_device); every check below
    # runs on the bound group
    dist.init_process_group("ringcomm", device_id=device)
    nccl_group = dist.new_group(backend="nccl")
    world = dist.get_world_size()
    failures: list[str] = []
    checks = 1
    bound = dist.group.WORLD.bound_device_id
    if bound != device:
        failures.append(f"init_process_group(device_id={device}): bound_device_id is {bound}")
    t0 = time.monotonic()
    try:
        checks += check_collectives(ringcomm.get_group(), device)
    except AssertionError as e:
        failures += str(e).splitlines()[1:]
    # round-robin channels: two NCCL communicators on two streams, used in turn
    two = dist.new_group(backend="ringcomm", pg_options=ringcomm.Options(num_channels=2))
    try:
        checks += check_collectives(ringcomm.get_group(two), device, dtypes=(torch.float32,),
                                    reduce_ops=("SUM", "MAX"))
    except AssertionError as e:
        failures += [f"2 channels: {x}" for x in str(e).splitlines()[1:]]
    burst = [torch.full((1 << 16,), float(k + 1), device=device) for k in range(6)]
    for w in [dist.all_reduce(t, group=two, async_op=True) for t in burst]:
        w.wait()
    dist.barrier(group=two, device_ids=[device.index])
    checks += 1
    if not all(torch.equal(t, torch.full_like(t, float((k + 1) * world)))
               for k, t in enumerate(burst)):
        failures.append("2 channels: a burst of asynchronous allreduces differs")
    checks += against_torch_nccl(nccl_group, device, failures)
    checks += p2p_and_future_checks(device, failures)
    ddp_notes = ddp_checks(device, failures) + fsdp_check(nccl_group, device, failures)
    checks += len(ddp_notes)
    torch.cuda.synchronize()
    took = time.monotonic() - t0
    every = [None] * world
    dist.all_gather_object(every, {"checks": checks, "failures": failures},
                           group=dist.new_group(backend="gloo"))
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps({
            "world": world, "checks": sum(e["checks"] for e in every),
            "failures": [f"rank {r}: {f}" for r, e in enumerate(every) for f in e["failures"]],
            "ddp": ddp_notes, "seconds": round(took, 1)}, indent=1))
    print(f"rank {rank}: {checks} checks, {len(failures)} failed, {took:.1f}s", flush=True)
    for f in failures[:40]:
        print(f"rank {rank}: FAIL {f}", flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


def against_torch_nccl(nccl_group, device, failures: list[str]) -> int:
    """Same inputs through ringcomm (every algorithm) and torch's NCCL backend."""
    import torch
    import torch.distributed as dist

    import ringcomm
    from ringcomm.testing import CHECK_OPS, _case_input

    p, me = dist.get_world_size(), dist.get_rank()
    checks, case = 0, 0
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.int64)

    def same(what: str, got: torch.Tensor, want: torch.Tensor, op: str) -> None:
        nonlocal checks
        checks += 1
        exact = op != "AVG" or not got.is_floating_point()
        ok = torch.equal(got, want) if exact else torch.allclose(got.double(), want.double(),
                                                                 rtol=1e-2, atol=1e-2)
        if not ok:
            failures.append(f"{what}: differs from torch's nccl (max |diff| "
                            f"{(got.double() - want.double()).abs().max().item():.3g})")

    def both(coll: str, name: str, fn) -> tuple | None:
        ringcomm.set_algorithm(coll, name)
        try:
            mine = fn(None)
        except ValueError:
            return None  # refused before running (e.g. native where NCCL has none)
        finally:
            ringcomm.set_algorithm(coll, "auto")
        return mine, fn(nccl_group)

    for coll in ("allreduce", "broadcast", "allgather", "reduce_scatter"):
        for name in sorted(ringcomm.REGISTRY[coll]):
            for dtype in dtypes:
                for op in (CHECK_OPS if coll in ("allreduce", "reduce_scatter") else ("SUM",)):
                    case += 1
                    n = 1000 * p
                    x = _case_input(me, case, n, dtype, op).to(device)
                    rop = getattr(dist.ReduceOp, op)

                    def call(group, x=x, rop=rop, coll=coll):
                        t = x.clone()
                        if coll == "allreduce":
                            dist.all_reduce(t, op=rop, group=group)
                            return t
                        if coll == "broadcast":
                            dist.broadcast(t, src=p - 1, group=group)
                            return t
                        if coll == "allgather":
                            out = torch.empty(n * p, dtype=t.dtype, device=device)
                            dist.all_gather_into_tensor(out, t, group=group)
                            return out
                        out = torch.empty(n // p, dtype=t.dtype, device=device)
                        dist.reduce_scatter_tensor(out, t, op=rop, group=group)
                        return out

                    got = both(coll, name, call)
                    if got is not None:
                        same(f"{coll}[{name}] {dtype} {op}", got[0], got[1], op)
    return checks


def p2p_and_future_checks(device, failures: list[str]) -> int:
    """send/recv between ranks 0 and 1 (a two-rank NCCL communicator of the pair),
    fp32, bf16 and an empty tensor; a ``then`` callback on a CUDA collective's future."""
    import torch
    import torch.distributed as dist

    rank, p = dist.get_rank(), dist.get_world_size()
    checks = 0
    if p >= 2 and rank < 2:
        peer = 1 - rank
        for dtype in (torch.float32, torch.bfloat16):
            for n in (0, 5, 1 << 20):
                mine = torch.full((n,), float(rank + 1), dtype=dtype, device=device)
                got = torch.zeros(n, dtype=dtype, device=device)
                if rank == 0:  # one side sends first: no pair waits on itself
                    dist.send(mine, peer)
                    dist.recv(got, peer)
                else:
                    dist.recv(got, peer)
                    dist.send(mine, peer)
                checks += 1
                if not torch.equal(got, torch.full_like(got, float(peer + 1))):
                    failures.append(f"send/recv {dtype} n={n}: got {got[:4].tolist()}")
    t = torch.full((1000,), float(rank + 1), device=device)
    fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    want = float(p * (p + 1))
    checks += 1
    if not torch.equal(fut.wait(), torch.full_like(t, want)):
        failures.append(f"then() on an allreduce future: {fut.wait()[:4].tolist()}, want {want}")
    return checks


def ddp_checks(device, failures: list[str]) -> list[str]:
    """ringcomm's DDP and torch's DDP over ringcomm, on CUDA, against one process
    training on the whole batch."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from _ddp_common import grads, lm_batch, lm_loss, params, rank_slice, sgd, tiny_lm
    from ddp import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    notes = []
    for label, wrap in (("ringcomm ddp", lambda m: DDP(m, bucket_cap_mb=0.01)),
                        ("torch DDP", lambda m: TorchDDP(m, device_ids=[device.index],
                                                         bucket_cap_mb=0.01))):
        oracle = tiny_lm(seed=1000, dtype=torch.float32).to(device)
        model = tiny_lm(seed=1000 + rank, dtype=torch.float32).to(device)
        ddp = wrap(model)
        opt, opt_o = sgd(ddp), sgd(oracle)
        worst = 0.0
        for step in range(3):
            tokens, targets = (t.to(device) for t in lm_batch(seed=50 + step, n=2 * world))
            opt_o.zero_grad()
            lm_loss(oracle(tokens), targets).backward()
            opt.zero_grad()
            lm_loss(ddp(rank_slice(tokens, rank, world)),
                    rank_slice(targets, rank, world)).backward()
            for name, g in grads(model).items():
                w = grads(oracle)[name]
                worst = max(worst, (g.double() - w.double()).abs().max().item())
            opt.step()
            opt_o.step()
        for name, prm in params(model).items():
            worst = max(worst, (prm.double() - params(oracle)[name].double()).abs().max().item())
        ok = worst < 1e-4
        if not ok:
            failures.append(f"{label}: gradients/parameters differ from one process by {worst:.3g}")
        notes.append(f"{label}: {'ok' if ok else 'FAILED'} (max |diff| {worst:.1e})")
    return notes


def fsdp_check(nccl_group, device, failures: list[str]) -> list[str]:
    """FSDP2 (bf16 mixed precision) on a CUDA mesh: ringcomm against torch's nccl."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def train(group) -> list:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)
        mesh = DeviceMesh.from_group(group, "cuda")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(10 * dist.get_rank() + step)
            model(torch.randn(4, 32, generator=g).to(device)).float().sum().backward()
            opt.step()
            opt.zero_grad()
        return [p.full_tensor().detach().float() for p in model.parameters()]

    ours, ref = train(dist.group.WORLD), train(nccl_group)
    worst = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    ok = worst < 1e-3  # bf16 compute; the reductions may round in another order
    if not ok:
        failures.append(f"FSDP2 bf16 on CUDA: parameters differ from torch's nccl by {worst:.3g}")
    return [f"FSDP2 bf16 vs nccl: {'ok' if ok else 'FAILED'} (max |diff| {worst:.1e})"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "docs" / "gpu-results.md"),
                    help="where to write the report (default docs/gpu-results.md)")
    ap.add_argument("--versions", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=BUDGET_S,
                    help=f"seconds for the whole check (default {BUDGET_S:g})")
    args = ap.parse_args()
    if args.versions:
        print(json.dumps(versions()))
        return 0
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
