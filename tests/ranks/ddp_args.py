"""DDP's torch.compile, init_sync, device_mesh and forward_sync_buffers (run with
mpiexec -n 2).

* torch.compile: the compiled model (dynamo traces the wrapped module's forward,
  DDP's own bookkeeping runs eagerly around it) trains four steps on ringcomm
  and on gloo, and with compiled autograd as well; the oracle is torch's DDP,
  eager, over gloo.

* device_mesh: a 1-D CPU mesh over every rank trains as torch's DDP does on a
  gloo group (the oracle); giving a group as well, or a 2-D mesh, is refused.
* init_sync=False: no broadcast at construction, each rank keeps its own start
  (different seeds stay different); with equal starts, training equals torch's.
* forward_sync_buffers=False: buffers are synchronized at construction (unlike
  broadcast_buffers=False) and not before forwards, as in torch 2.13.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
import torch._dynamo.config as dynamo_config
from torch.distributed.device_mesh import init_device_mesh

from _ddp_common import compare_tensors, done, init, params
from ddp import DistributedDataParallel as DDP

TOL = (1e-6, 1e-7)
COMPILED_TOL = (1e-5, 1e-6)


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)
        self.register_buffer("count", torch.full((1,), float(seed)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.fc2(torch.tanh(self.fc1(x)))


def train(model: nn.Module, rank: int) -> bool:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return True


def compiled(c, rank: int, groups: dict, want: nn.Module) -> None:
    for backend, group in groups.items():
        m = Net(1)
        model = DDP(m, process_group=group, bucket_cap_mb=0.0005)
        what = f"torch.compile(ddp model) on {backend}"
        if c.run(what, train, torch.compile(model), rank):
            compare_tensors(c, what, params(m), params(want), *COMPILED_TOL)
            c.check(model.reducer.num_synced_backwards == 3 and len(model.reducer.buckets) > 1,
                    f"{what}: {model.reducer.num_synced_backwards} synchronized backwards, "
                    f"{len(model.reducer.buckets)} buckets")
    m = Net(1)
    model = DDP(m, process_group=groups["ringcomm"], bucket_cap_mb=0.0005)
    try:
        with dynamo_config.patch(compiled_autograd=True):
            train(torch.compile(model), rank)
    except Exception as e:  # noqa: BLE001 - torch's refusal, reported as it is
        c.case("ddp/ under compiled autograd", e)
        c.check(False, f"compiled autograd: {e!r}")
    else:
        compare_tensors(c, "compiled autograd", params(m), params(want), *COMPILED_TOL)
        c.check(model.reducer.num_synced_backwards == 3, "compiled autograd: "
                f"{model.reducer.num_synced_backwards} synchronized backwards")


def main() -> None:
    rank, world, groups, c = init()
    want = Net(1)
    train(nn.parallel.DistributedDataParallel(want, process_group=groups["gloo"]), rank)
    compiled(c, rank, groups, want)

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    m = Net(1)
    if c.run("device_mesh", train, DDP(m, device_mesh=mesh), rank):
        compare_tensors(c, "device_mesh", params(m), params(want), *TOL)
    for what, kwargs in {"a group and a mesh": dict(device_mesh=mesh,
                                                    process_group=groups["gloo"]),
                         "a 2-D mesh": dict(device_mesh=init_device_mesh(
                             "cpu", (1, world), mesh_dim_names=("a", "b")))}.items():
        try:
            DDP(Net(1), **kwargs)
            c.check(False, f"device_mesh with {what}: accepted")
        except ValueError as e:
            c.check("device_mesh" in str(e), f"device_mesh with {what}: {e}")
            c.case(f"DDP device_mesh with {what}", e)

    mine = Net(10 + rank)  # a different start on each rank
    start = params(mine)
    DDP(mine, process_group=groups["ringcomm"], init_sync=False)
    compare_tensors(c, "init_sync=False keeps this rank's start", params(mine), start, 0, 0)
    m = Net(1)
    if c.run("init_sync=False", train, DDP(m, process_group=groups["ringcomm"],
                                           init_sync=False), rank):
        compare_tensors(c, "init_sync=False, equal starts", params(m), params(want), *TOL)

    m = Net(10 + rank)
    model = DDP(m, process_group=groups["ringcomm"], forward_sync_buffers=False)
    c.check(m.count.item() == 10.0, f"forward_sync_buffers=False: at construction the "
                                    f"buffer is {m.count.item()}, rank 0's is 10")
    with torch.no_grad():
        m.count += rank  # rank-local from here on
        model(torch.randn(2, 6))
        model(torch.randn(2, 6))
    c.check(m.count.item() == 12.0 + rank, f"forward_sync_buffers=False: after two "
                                           f"forwards {m.count.item()}, expected {12 + rank}")
    done(c)


if __name__ == "__main__":
    main()
