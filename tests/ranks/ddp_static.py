"""DDP with static_graph=True, against torch's DDP (run with mpiexec -n 3).

A model with a layer it never uses trains four steps with both DDPs, without
find_unused_parameters, on the ringcomm group and on a gloo group, with and
without bucket views: parameters equal torch's DDP's, and the unused layer keeps
no gradient. Only the first iteration walks the autograd graph and allreduces the
used-parameter map; the others reuse what it found.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ddp.reducer
from _ddp_common import compare_tensors, done, init, params
from ddp import DistributedDataParallel as DDP

TOL = (1e-9, 1e-12)


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1, self.idle, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))  # self.idle: never used


def train(wrapper, rank: int, group, view: bool) -> nn.Module:
    net = Net(seed=3 + rank)
    model = wrapper(net, process_group=group, bucket_cap_mb=0.0005, static_graph=True,
                    gradient_as_bucket_view=view)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(4, 6, generator=g, dtype=torch.float64), \
            torch.randint(0, 3, (4,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return net


def main() -> None:
    rank, world, groups, c = init()
    walks = [0]
    original = ddp.reducer.reachable_parameters

    def counting(*args, **kwargs):
        walks[0] += 1
        return original(*args, **kwargs)

    for backend, group in groups.items():
        for view in (False, True):
            what = f"static_graph {backend} view={view}"
            walks[0] = 0
            ddp.reducer.reachable_parameters = counting
            try:
                ours = train(DDP, rank, group, view)
            finally:
                ddp.reducer.reachable_parameters = original
            c.check(walks[0] == 1, f"{what}: {walks[0]} graph walks in 4 iterations")
            theirs = train(nn.parallel.DistributedDataParallel, rank, group, view)
            compare_tensors(c, f"{what}: params", params(ours), params(theirs), *TOL)
            c.check(all(p.grad is None for p in ours.idle.parameters()),
                    f"{what}: the unused layer got a gradient")
    done(c)


if __name__ == "__main__":
    main()
