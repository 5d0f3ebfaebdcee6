"""Per-rank program: DeepSpeed's ZeRO on a backend named on the command line, as
docs/integrations.md shows it.

Usage: deepspeed_check.py BACKEND DIR   (BACKEND: ringcomm or gloo; DIR: a directory
every rank can write), under torchrun, mpiexec or DeepSpeed's own launcher (which
adds ``--local_rank=N``).

Each configuration trains the same small model for a few steps on rank-dependent
batches: ZeRO stages 1, 2 and 3 in fp32 with SGD; each stage again with the optimizer
offloaded to the CPU (DeepSpeed's CPU Adam, a JIT-built op), stage 3 with its
parameters offloaded too; stage 2 with gradient accumulation; stages 2 and 3 in
bf16. Every rank writes its losses and the full parameters of every configuration
to DIR/BACKEND-rankR.json, and the test compares ringcomm's files with gloo's.
In the program itself: the group is BACKEND's, the parameters are the same on every
rank and were trained, and on ringcomm the collectives went through ringcomm's group.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from _common import Checker

from ringcomm.bench.columns import release_deepspeed_segment

STEPS = 3
MICRO = 4

#: name -> (zero_optimization, the rest of the DeepSpeed config)
CONFIGS = {
    "zero1": ({"stage": 1}, {}),
    "zero2": ({"stage": 2}, {}),
    "zero3": ({"stage": 3}, {}),
    "zero1-offload": ({"stage": 1, "offload_optimizer": {"device": "cpu"}}, {"adam": True}),
    "zero2-offload": ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {"adam": True}),
    "zero3-offload": ({"stage": 3, "offload_optimizer": {"device": "cpu"},
                       "offload_param": {"device": "cpu"}}, {"adam": True}),
    "zero2-accumulate": ({"stage": 2}, {"gradient_accumulation_steps": 2}),
    "zero2-bf16": ({"stage": 2}, {"bf16": {"enabled": True}}),
    "zero3-bf16": ({"stage": 3}, {"bf16": {"enabled": True}}),
}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def config(zero: dict, rest: dict) -> dict:
    rest = dict(rest)
    adam = rest.pop("adam", False)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Adam" if adam else "SGD", "params": {"lr": 0.05}},
           "zero_optimization": zero, "zero_allow_untested_optimizer": True,
           "steps_per_print": 10 ** 6}
    cfg.update(rest)
    return cfg


def full_params(engine) -> list[torch.Tensor]:
    """Every parameter whole, in fp32: the optimizer's master copy, gathered from the
    ranks' shards at stage 3 (in bf16 the module holds a rounded copy)."""
    from deepspeed.utils import safe_get_full_fp32_param
    return [safe_get_full_fp32_param(p).detach().clone() for p in engine.module.parameters()]


def train(c: Checker, name: str, rank: int) -> dict:
    import deepspeed

    zero, rest = CONFIGS[name]
    cfg = config(zero, rest)
    net = model()
    before = [p.detach().clone() for p in net.parameters()]
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    dtype = torch.bfloat16 if cfg.get("bf16", {}).get("enabled") else torch.float32
    losses = []
    for step in range(STEPS * cfg["gradient_accumulation_steps"]):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 2, generator=g)
        loss = nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = full_params(engine)
    c.check(all(math.isfinite(v) for v in losses), f"{name}: a loss is not finite: {losses}")
    c.check(len(params) == len(before) and any(
        not torch.equal(a.float(), b) for a, b in zip(params, before)), f"{name}: nothing trained")
    flat = torch.cat([p.reshape(-1).float() for p in params])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    c.check(torch.equal(flat, ref), f"{name}: the parameters differ across ranks")
    engine.destroy()
    return {"losses": losses, "params": [p.float().tolist() for p in params]}


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    backend, directory = args[0], args[1]
    if backend == "ringcomm":
        import ringcomm  # registers the backend (torch >= 2.15 finds it by name)
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    # DeepSpeed's CPU op made a segment in /dev/shm per rank and never removes it:
    # once every rank mapped its peers' (init returned everywhere), it goes
    dist.barrier()
    release_deepspeed_segment(rank)
    c = Checker(rank)
    c.check(dist.get_backend() == backend, f"the group's backend is {dist.get_backend()}")
    seq = None
    if backend == "ringcomm":
        pg = ringcomm.get_group()
        c.check(isinstance(dist.group.WORLD, ringcomm.ProcessGroupRingcomm),
                f"the default group is {type(dist.group.WORLD).__name__}, not ringcomm's")
        seq = pg.seq
    results = {}
    for name in CONFIGS:
        start = time.perf_counter()
        results[name] = train(c, name, rank)
        if rank == 0:
            print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
    if seq is not None:
        c.check(pg.seq > seq + len(CONFIGS) * STEPS,
                f"DeepSpeed ran {pg.seq - seq} collectives on ringcomm's group")
    with open(os.path.join(directory, f"{backend}-rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    c.finish()


if __name__ == "__main__":
    main()
