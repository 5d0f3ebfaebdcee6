"""The ringcomm demo: allreduce with every algorithm, checked, timed, next to gloo.

    mpiexec -n 4 python -m ringcomm.demo          # or: make demo
    torchrun --nproc-per-node 4 -m ringcomm.demo
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import ringcomm


def _time(fn, iters: int) -> float:
    """Max over ranks of the median time of ``fn`` (seconds)."""
    fn()
    samples = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(samples)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, few iterations")
    args = ap.parse_args(argv)

    dist.init_process_group("ringcomm")
    rank, p = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    sizes = [1 << 10, 1 << 16] if args.quick else [1 << 10, 1 << 16, 1 << 20, 1 << 24]
    iters = 3 if args.quick else 10
    algos = [*sorted(ringcomm.REGISTRY["allreduce"]), "auto"]  # every registered one
    if rank == 0:
        print(f"ringcomm {ringcomm.__version__}: allreduce (SUM, float32) on {p} ranks, "
              "time per call in us")
        print(f"{'bytes':>10} | " + " ".join(f"{a:>{max(9, len(a))}}" for a in algos)
              + f" {'(auto ->)':>18} | {'gloo':>9}")
    wrong = 0
    for nbytes in sizes:
        n = nbytes // 4
        row = {}
        for algo in algos:
            ringcomm.set_algorithm("allreduce", algo)
            t = torch.arange(n, dtype=torch.float32) + rank
            dist.all_reduce(t)
            want = p * torch.arange(n, dtype=torch.float32) + p * (p - 1) / 2
            wrong += int(not torch.equal(t, want))
            row[algo] = _time(lambda: dist.all_reduce(t), iters)
        row["gloo"] = _time(lambda: dist.all_reduce(t, group=gloo), iters)
        if rank == 0:
            chosen = ringcomm.get_group().algorithm_for("allreduce", nbytes)
            print(f"{nbytes:>10} | " + " ".join(f"{row[a] * 1e6:>{max(9, len(a))}.1f}"
                                                for a in algos)
                  + f" {chosen:>18} | {row['gloo'] * 1e6:>9.1f}")
    ringcomm.set_algorithm("allreduce", "auto")
    total = torch.tensor([wrong])
    dist.all_reduce(total)
    if rank == 0:
        print("all results correct" if total.item() == 0 else f"{total.item()} WRONG results")
    dist.destroy_process_group()
    return 0 if total.item() == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
