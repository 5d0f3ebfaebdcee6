"""DDP with static_graph=True, against torch's DDP (run with mpiexec -n 3).

A model with a layer it never uses trains four steps with both DDPs, without
find_unused_parameters, on the ringcomm group and on a gloo group, with and
without bucket views: parameters equal torch's DDP's, and the unused layer keeps
no gradient. Only the first iteration walks the autograd graph and allreduces the
used-parameter map; the others reuse what it found. ``logging_data()`` agrees with
torch's ``_get_ddp_logging_data()`` on what both record (configuration, sizes,
rebuilt buckets) and reports the unused layer's bytes and positive mean times.
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


#: logging-data keys ours and torch's DDP both fill with the same meaning
SAME_KEYS = ("world_size", "rank", "module_name", "backend_name", "bucket_cap_bytes",
             "find_unused_parameters", "gradient_as_bucket_view", "broadcast_buffers",
             "static_graph", "total_parameter_size_bytes", "has_rebuilt_buckets",
             "rebuilt_bucket_sizes")
TIMES = ("avg_forward_compute_time", "avg_backward_compute_time", "avg_backward_comm_time")


def train(wrapper, rank: int, group, view: bool) -> tuple[nn.Module, nn.Module]:
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
    return net, model


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
                ours, ours_ddp = train(DDP, rank, group, view)
            finally:
                ddp.reducer.reachable_parameters = original
            c.check(walks[0] == 1, f"{what}: {walks[0]} graph walks in 4 iterations")
            theirs, theirs_ddp = train(nn.parallel.DistributedDataParallel, rank, group, view)
            mine, torch_data = ours_ddp.logging_data(), theirs_ddp._get_ddp_logging_data()
            for k in SAME_KEYS:
                c.check(mine[k] == torch_data[k],
                        f"{what}: logging_data {k}: {mine[k]!r}, torch's {torch_data[k]!r}")
            total = sum(p.nbytes for p in ours.parameters())
            for k in ("bucket_sizes", "rebuilt_bucket_sizes"):  # every parameter, once
                c.check(sum(map(int, mine[k].split(", "))) == total,
                        f"{what}: logging_data {k} {mine[k]!r} do not add up to {total}")
            idle = sum(p.nbytes for p in ours.idle.parameters())
            c.check(mine["unused_parameter_size"] == idle,
                    f"{what}: unused_parameter_size {mine['unused_parameter_size']}, the idle "
                    f"layer has {idle} bytes")
            c.check(mine["iteration"] == 4 and all(mine[t] > 0 for t in TIMES),
                    f"{what}: iteration and mean times: {[(k, mine[k]) for k in TIMES]}")
            c.check(sorted(map(int, mine["prev_iteration_grad_ready_order_indices"]
                               .split(", "))) == [0, 1, 4, 5],
                    f"{what}: ready order {mine['prev_iteration_grad_ready_order_indices']}")
            compare_tensors(c, f"{what}: params", params(ours), params(theirs), *TOL)
            c.check(all(p.grad is None for p in ours.idle.parameters()),
                    f"{what}: the unused layer got a gradient")
    done(c)


if __name__ == "__main__":
    main()
