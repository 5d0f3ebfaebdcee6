"""Data-parallel training with ringcomm and this project's DDP, on synthetic data.

    mpiexec -n 2 python examples/train.py
    torchrun --nproc-per-node 2 examples/train.py --ddp torch --backend gloo
    mpiexec -n 2 python examples/train.py --trace run.json   # then open the merged file
                                                             # in https://ui.perfetto.dev

Every rank trains on its own shard; after each step the replicas hold the same
parameters (checked at the end, over gloo). Prints loss per epoch and time per step. The
loss curve is the same for both DDPs on both backends.
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import ringcomm  # noqa: F401  (registers the backend; fills in rendezvous under mpiexec)
from ringcomm import trace


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="ringcomm", help="ringcomm, gloo, ...")
    ap.add_argument("--ddp", choices=["ours", "torch"], default="ours",
                    help="ddp.DistributedDataParallel (ours) or torch's")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="steps per epoch")
    ap.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    ap.add_argument("--trace", metavar="PATH",
                    help="record the training's timeline: each rank writes PATH with "
                    ".rank<r> before the suffix; merge them with python -m ringcomm.trace merge")
    args = ap.parse_args(argv)

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.ddp == "ours":
        from ddp import DistributedDataParallel as DDP
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(rank)  # DDP broadcasts rank 0's parameters at construction
    model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                              nn.Linear(256, 1)), bucket_cap_mb=0.25)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    true_w = torch.randn(32, 1, generator=torch.Generator().manual_seed(0))
    data = torch.Generator().manual_seed(1000 + rank)

    with trace.recording(args.trace) if args.trace else contextlib.nullcontext():
        for epoch in range(args.epochs):
            start, total = time.perf_counter(), 0.0
            for _ in range(args.steps):
                x = torch.randn(args.batch, 32, generator=data)
                y = x @ true_w + 0.01 * torch.randn(args.batch, 1, generator=data)
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss.item()
            mean = torch.tensor([total / args.steps])
            dist.all_reduce(mean)
            if rank == 0:
                ms = (time.perf_counter() - start) / args.steps * 1e3
                print(f"epoch {epoch}: loss {mean.item() / world:.6f}  {ms:.1f} ms/step "
                      f"({args.ddp} DDP on {args.backend}, {world} ranks)", flush=True)
    if args.trace and rank == 0:
        merged = trace.rank_path(args.trace, 0).with_name(
            trace.rank_path(args.trace, 0).name.replace(".rank0", ""))
        print(f"trace: one file per rank; merge with: python -m ringcomm.trace merge {merged} "
              + " ".join(str(trace.rank_path(args.trace, r)) for r in range(world)), flush=True)

    # checked over gloo, a backend apart from the one trained on, so a broken
    # ringcomm broadcast cannot make unequal replicas look equal
    check = dist.new_group(backend="gloo")
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0, group=check)
    same = torch.tensor([int(torch.equal(flat, ref))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN, group=check)
    if rank == 0:
        print("replicas identical" if same.item() else "replicas DIVERGED", flush=True)
    dist.destroy_process_group()
    return 0 if same.item() else 1


if __name__ == "__main__":
    raise SystemExit(main())
