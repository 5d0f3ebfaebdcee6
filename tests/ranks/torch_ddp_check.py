"""Per-rank program: torch's own data-parallel wrappers train on ringcomm exactly as
on gloo (the oracle: same model, data and steps on a gloo group over the same ranks).

DDP: find_unused_parameters, gradient_as_bucket_view, static_graph, no_sync,
join() with uneven inputs. FSDP2 (fully_shard) over a device mesh on ringcomm.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ringcomm
from _common import Checker, check_trained


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc1 = nn.Linear(8 * 6 * 6, 64)
        self.fc2 = nn.Linear(64, 10)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        x = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)


def train_ddp(group, steps: int, no_sync_every: int = 0, uneven: bool = False,
              **ddp_kw) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = DDP(Net(), process_group=group, bucket_cap_mb=0.01, **ddp_kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    n = steps + (rank if uneven else 0)  # join(): ranks run different step counts
    with model.join(enable=uneven):
        for step in range(n):
            x, y = batch(rank, step)
            if no_sync_every and step % no_sync_every == 0:
                with model.no_sync():  # accumulate locally, sync on the next step
                    nn.functional.cross_entropy(model(x), y).backward()
                continue
            opt.zero_grad() if not no_sync_every else None
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if no_sync_every:
                opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def train_fsdp(group, steps: int) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank() * 10 + step))
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def main() -> None:
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    c = Checker(dist.get_rank())
    world = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    configs = [
        ("find_unused_parameters", {"find_unused_parameters": True}),
        ("gradient_as_bucket_view", {"find_unused_parameters": True,
                                     "gradient_as_bucket_view": True}),
        ("static_graph", {"static_graph": True}),
        ("no_sync", {"find_unused_parameters": True, "no_sync_every": 2}),
        ("join uneven inputs", {"find_unused_parameters": True, "uneven": True}),
    ]
    for name, kw in configs:
        ours = c.run(f"DDP {name} on ringcomm", train_ddp, world, 4, **kw)
        ref = train_ddp(gloo, 4, **kw)
        if ours is None:
            continue
        check_trained(c, f"DDP {name}", ours, ref, gloo, rtol=1e-6, atol=1e-7)

    c.check(isinstance(world, ringcomm.ProcessGroupRingcomm), "FSDP mesh group is ringcomm")
    ours = c.run("FSDP2 on ringcomm", train_fsdp, world, 3)
    # torch 2.7's gloo reduces reduce_scatter_tensor with SUM whatever op it is
    # given (more_collectives_check.py shows it against one process), so it is no
    # oracle for FSDP2's reduce-scatter there
    ref = train_fsdp(gloo, 3) if torch.__version__ >= "2.8" else None
    if ref is None:
        print("torch_ddp_check: FSDP2 not compared on torch < 2.8 (gloo's "
              "reduce_scatter_tensor ignores the reduce op)", flush=True)
    if ours is not None and ref is not None:
        for i, (a, b) in enumerate(zip(ours, ref)):
            c.check(torch.allclose(a, b, rtol=1e-6, atol=1e-7),
                    f"FSDP2 parameter {i}: max diff {(a - b).abs().max().item()}")
    dist.destroy_process_group()
    c.finish()


if __name__ == "__main__":
    main()
