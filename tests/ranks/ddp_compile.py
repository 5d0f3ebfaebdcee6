"""ddp/ under torch.compile (run with mpiexec -n 2).

The compiled model (torch.compile of the DDP wrapper: dynamo traces the wrapped
module's forward, DDP's own bookkeeping runs eagerly around it) trains four
steps on ringcomm and on gloo; the oracle is torch's DDP, eager, over gloo. With
compiled autograd as well (torch._dynamo.config.compiled_autograd), where torch
runs it, the same; where it refuses, the reason is printed as a case.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from _ddp_common import compare_tensors, done, init, params
from ddp import DistributedDataParallel as DDP

TOL = (1e-5, 1e-6)


def net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                         nn.Linear(32, 3))


def train(model: nn.Module, rank: int) -> bool:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return True


def main() -> None:
    rank, world, groups, c = init()
    want = net()
    train(nn.parallel.DistributedDataParallel(want, process_group=groups["gloo"]), rank)
    for backend, group in groups.items():
        m = net()
        model = DDP(m, process_group=group, bucket_cap_mb=0.002)
        what = f"torch.compile(ddp model) on {backend}"
        if c.run(what, train, torch.compile(model), rank):
            compare_tensors(c, what, params(m), params(want), *TOL)
            c.check(model.reducer.num_synced_backwards == 4,
                    f"{what}: {model.reducer.num_synced_backwards} synchronized backwards")
    m = net()
    model = DDP(m, process_group=groups["ringcomm"], bucket_cap_mb=0.002)
    import torch._dynamo.config as dynamo_config
    try:
        with dynamo_config.patch(compiled_autograd=True):
            train(torch.compile(model), rank)
    except Exception as e:  # noqa: BLE001 - torch's refusal, reported as it is
        c.case("ddp/ under compiled autograd", e)
    else:
        compare_tensors(c, "compiled autograd", params(m), params(want), *TOL)
        c.check(model.reducer.num_synced_backwards == 4, "compiled autograd: "
                f"{model.reducer.num_synced_backwards} synchronized backwards")
        c.case("ddp/ under compiled autograd", "trains, == torch's DDP")
    done(c)


if __name__ == "__main__":
    main()
