"""DDP's mixed_precision (run with mpiexec -n 3).

torch's own DDP mixed precision needs CUDA events ("cpu backend doesn't support
events"), so the oracle is one process doing what the configuration says, rank
by rank: each rank's forward and backward on low-precision copies of the
full-precision parameters and inputs, its gradients divided by the world size in
param_dtype and summed in reduce_dtype, rank 0 first, the sum cast to float32 for
a momentum step on the full-precision parameters. Covered: bf16 compute with fp32
reduction, fp16 throughout, bf16 reduction of fp32 gradients, two no_sync
micro-steps, on ringcomm and gloo; the optimizer sees float32 parameters and
gradients; a forward without gradients leaves float32 parameters; buffers cast;
bad configurations refused.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel.distributed import _MixedPrecision

from _ddp_common import compare_tensors, done, init, params
from ddp import DistributedDataParallel as DDP

STEPS = 3
CONFIGS = {  # name -> (config, micro-steps, tolerance)
    "bf16 compute, fp32 reduce": (_MixedPrecision(param_dtype=torch.bfloat16,
                                                  reduce_dtype=torch.float32), 1, (1e-5, 1e-6)),
    "fp16 throughout": (_MixedPrecision(param_dtype=torch.float16), 1, (2e-3, 1e-4)),
    "fp32 compute, bf16 reduce": (_MixedPrecision(reduce_dtype=torch.bfloat16), 1,
                                  (1e-2, 1e-3)),
    "bf16 compute, fp32 reduce, 2 micro-steps": (
        _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), 2,
        (1e-5, 1e-6)),
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.fc1, self.fc2 = nn.Linear(6, 24), nn.Linear(24, 3)
        self.register_buffer("scale", torch.ones(24))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))  # scale: only for buffer_dtype


def batch(rank: int, step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + k)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def oracle(cfg, micro: int) -> nn.Module:
    master = Net()
    opt = torch.optim.SGD(master.parameters(), lr=0.1, momentum=0.9)
    world = dist.get_world_size()
    pd = cfg.param_dtype or torch.float32
    rd = cfg.reduce_dtype or pd
    for step in range(STEPS):
        total = None
        for r in range(world):
            low = copy.deepcopy(master).to(pd) if cfg.param_dtype else copy.deepcopy(master)
            for k in range(micro):
                x, y = batch(r, step, k)
                F.cross_entropy(low(x.to(pd)), y).backward()
            part = [(p.grad * (1.0 / world)).to(rd) for p in low.parameters()]
            total = part if total is None else [a + b for a, b in zip(total, part)]
        for p, g in zip(master.parameters(), total):
            p.grad = g.to(torch.float32)
        opt.step()
        opt.zero_grad()
    return master


def train(c, what: str, group, cfg, micro: int) -> nn.Module:
    m = Net()
    model = DDP(m, process_group=group, mixed_precision=cfg, bucket_cap_mb=0.0002)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rank = dist.get_rank()
    reduce = cfg.reduce_dtype or cfg.param_dtype
    kinds = {b.buffer.dtype for b in model.reducer.buckets}
    c.check(len(model.reducer.buckets) > 1 and kinds == {reduce},
            f"{what}: {len(model.reducer.buckets)} buckets of {kinds}, expected {reduce}")
    for step in range(STEPS):
        for k in range(micro):
            x, y = batch(rank, step, k)
            ctx = model.no_sync() if k < micro - 1 else torch.enable_grad()
            with ctx:
                F.cross_entropy(model(x), y).backward()
        ok = all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
                 for p in m.parameters())
        c.check(ok, f"{what}: the optimizer sees "
                    f"{sorted({(str(p.dtype), str(p.grad.dtype)) for p in m.parameters()})}")
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        model(torch.randn(2, 6))
    c.check(all(p.dtype == torch.float32 for p in m.parameters()),
            f"{what}: parameters after a forward without gradients")
    return m


def main() -> None:
    rank, world, groups, c = init()
    for name, (cfg, micro, tol) in CONFIGS.items():
        want = params(oracle(cfg, micro))
        for backend, group in groups.items():
            what = f"{name} on {backend}"
            got = c.run(what, train, c, what, group, cfg, micro)
            if got is not None:
                compare_tensors(c, what, params(got), want, *tol)
    # a forward without gradients between a forward and its backward: the backward
    # still gets low-precision parameters, the optimizer full-precision ones
    m = Net()
    model = DDP(m, mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
    loss = F.cross_entropy(model(*batch(rank, 0, 0)[:1]), batch(rank, 0, 0)[1])
    with torch.no_grad():
        model(torch.randn(2, 6))
    c.run("no-grad forward before the backward", loss.backward)
    c.check(all(p.dtype == torch.float32 and p.grad is not None and
                p.grad.dtype == torch.float32 for p in m.parameters()),
            f"no-grad forward before the backward: "
            f"{sorted({(str(p.dtype), str(p.grad is not None and p.grad.dtype)) for p in m.parameters()})}")
    m = Net()
    DDP(m, mixed_precision=_MixedPrecision(buffer_dtype=torch.float16))
    c.check(m.scale.dtype == torch.float16, f"buffer_dtype: the buffer is {m.scale.dtype}")
    bad = {"with gradient_as_bucket_view": (ValueError, dict(
               mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16),
               gradient_as_bucket_view=True)),
           "an integer param_dtype": (TypeError, dict(
               mixed_precision=_MixedPrecision(param_dtype=torch.int32))),
           "not a configuration": (TypeError, dict(mixed_precision="bf16"))}
    for what, (kind, kwargs) in bad.items():
        try:
            DDP(Net(), **kwargs)
            c.check(False, f"mixed_precision {what}: accepted")
        except kind as e:
            c.check("mixed_precision" in str(e), f"mixed_precision {what}: {e}")
            c.case(f"mixed_precision {what}", e)
    done(c)


if __name__ == "__main__":
    main()
