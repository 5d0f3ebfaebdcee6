"""Per-rank program: an allreduce written only through the public schedule API,
registered with ringcomm.register_algorithm, runs under dist.all_reduce, torch's
DDP and ddp/ with the same results as gloo; a wrong one is refused on every rank
before anything is sent, and the group stays usable.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ringcomm
from ddp import DistributedDataParallel as OurDDP
from ringcomm.schedule import Builder, Reduce
from _common import Checker
from _ddp_common import train_classifier


def star(ctx):
    """Every rank sends its buffer to rank 0, which adds them up in rank order and
    sends the sum back: 2 rounds, all the traffic through rank 0."""
    b = Builder(ctx)
    p, r, n = ctx.size, ctx.rank, ctx.layout[0]
    if p == 1 or n == 0:
        return b.build()
    data = (0, 0, n)
    if r == 0:
        tmp = b.scratch(n * (p - 1))
        spaces = [(tmp, i * n, n) for i in range(p - 1)]
        b.step(recvs=[(q, spaces[q - 1]) for q in range(1, p)],
               local=[Reduce(data, s) for s in spaces])
        b.step(sends=[(q, data) for q in range(1, p)])
    else:
        b.step(sends=[(0, data)])
        b.step(recvs=[(0, data)])
    return b.build()


def star_double_count(ctx):
    """Wrong: rank 0 adds rank 1's contribution twice."""
    sched = star(ctx)
    if ctx.rank != 0 or ctx.size < 2 or not sched.steps:
        return sched
    first = sched.steps[0]
    b = Builder(ctx)
    tmp = b.scratch(sched.scratch[0])
    b.step(recvs=first.recvs, local=first.local + first.local[:1])
    for st in sched.steps[1:]:
        b.step(st.sends, st.recvs, st.local)
    assert tmp == first.recvs[0].region.buf
    return b.build()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def train(wrapper, group) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return train_classifier(wrapper, Net(), group, bucket_cap_mb=0.0005, batch=5)


def main() -> int:
    dist.init_process_group("ringcomm")
    rank, p = dist.get_rank(), dist.get_world_size()
    c = Checker(rank)
    gloo = dist.new_group(backend="gloo")
    ringcomm.register_algorithm("allreduce", "star", star)
    ringcomm.set_algorithm("allreduce", "star")
    c.check(ringcomm.get_group().algorithm_for("allreduce", 1 << 20) == "star", "star chosen")

    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        for n in (0, 1, 7, 1000, 300000):
            g = torch.Generator().manual_seed(rank * 31 + n)
            x = torch.randint(-20, 20, (n,), generator=g).to(dtype)
            ours = x.clone()
            dist.all_reduce(ours)
            # small integers sum exactly in every dtype; gloo sums bf16 as float32 here
            ref = x.float() if dtype == torch.bfloat16 else x.clone()
            dist.all_reduce(ref, group=gloo)
            ref = ref.to(dtype)
            c.check(torch.equal(ours, ref), f"star allreduce {dtype} n={n} != gloo")
    t = torch.arange(10.0).view(2, 5).t()  # non-contiguous
    want = t * p
    dist.all_reduce(t)
    c.check(torch.equal(t, want), "star allreduce of a non-contiguous tensor")

    ref = train(TorchDDP, gloo)
    for name, wrapper in (("torch DDP", TorchDDP), ("ddp/", OurDDP)):
        got = train(wrapper, None)
        c.check(all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(got, ref)),
                f"{name} with the star allreduce differs from torch DDP on gloo")

    ringcomm.register_algorithm("allreduce", "star_bad", star_double_count)
    ringcomm.set_algorithm("allreduce", "star_bad")
    try:
        dist.all_reduce(torch.ones(4))
        c.check(p == 1, "a double-counting schedule was accepted")
    except ValueError as e:
        c.check("'star_bad' is wrong" in str(e) and "twice" in str(e), f"message: {e}")
    ringcomm.set_algorithm("allreduce", "auto")
    t = torch.ones(4)
    dist.all_reduce(t)
    c.check(torch.equal(t, torch.full((4,), float(p))), "group usable after the refusal")

    # A builder that raises (on every rank: each builds every rank's schedule to check
    # it) surfaces its error to the caller, and its group is broken from then on.
    def boom(ctx):
        if ctx.rank == ctx.size - 1:
            raise ZeroDivisionError("boom from the last rank")
        return star(ctx)

    sub = dist.new_group(backend="ringcomm")
    ringcomm.register_algorithm("allreduce", "boom", boom)
    ringcomm.set_algorithm("allreduce", "boom", group=sub)
    try:
        dist.all_reduce(torch.ones(4), group=sub)
        c.check(False, "a raising builder's collective returned")
    except Exception as e:  # noqa: BLE001 - torch may rewrap the DistBackendError
        c.check(isinstance(e, dist.DistBackendError) and "ZeroDivisionError" in str(e)
                and "boom from the last rank" in str(e) and "unusable" in str(e),
                f"raising builder: {type(e).__name__}: {e}")
    ringcomm.set_algorithm("allreduce", "auto", group=sub)
    try:
        dist.broadcast(torch.ones(2), 0, group=sub)
        c.check(False, "the group of a raising builder stayed usable")
    except Exception as e:  # noqa: BLE001
        c.check("unusable after an earlier failure" in str(e) and "boom" in str(e),
                f"after the raising builder: {type(e).__name__}: {e}")
    t = torch.ones(4)
    dist.all_reduce(t)  # the world group is another group: still fine
    c.check(torch.equal(t, torch.full((4,), float(p))), "world group usable")
    dist.barrier()
    dist.destroy_process_group()
    c.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
