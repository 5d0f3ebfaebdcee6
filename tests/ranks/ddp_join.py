"""DDP on uneven inputs (join), against torch's DDP (run with mpiexec -n 3).

Rank r has BATCHES[r] batches (3, 5 and 8). Both DDPs train inside ``model.join()``
on the ringcomm group and on a gloo group, with the model's BatchNorm buffers
broadcast or not, with divide_by_initial_world_size True and False, and with bucket
views; after the loop every rank's parameters and buffers must equal torch's DDP's,
and be the same on every rank. With find_unused_parameters (a layer used on odd
steps only), ours must equal a single-process computation of the same training.
Nobody hangs: a rank out of inputs shadows the others' collectives. Then
``throw_on_early_termination=True`` raises on every rank once the first runs out.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from _ddp_common import buffers, compare_tensors, done, init, params, same_on_all_ranks
from ddp import DistributedDataParallel as DDP

BATCHES = (3, 5, 8)
TOL = (1e-9, 1e-12)


class Net(nn.Module):
    def __init__(self, seed: int, spare: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 16)
        self.spare = nn.Linear(16, 16) if spare else None  # used on odd steps only
        self.out = nn.Linear(16, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.double()
        self.odd = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bn(self.fc1(x)))
        h = torch.tanh(self.fc2(h))
        if self.odd:
            h = h + torch.tanh(self.spare(h))
        return self.out(h)


def train(wrapper, rank, group, *, divide: bool, broadcast_buffers: bool, unused: bool,
          view: bool) -> nn.Module:
    net = Net(seed=11 + rank, spare=unused)  # different on every rank: DDP starts from rank 0's
    kwargs = dict(process_group=group, bucket_cap_mb=0.0005,
                  broadcast_buffers=broadcast_buffers, find_unused_parameters=unused)
    if view:
        kwargs["gradient_as_bucket_view"] = True
    model = wrapper(net, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with model.join(divide_by_initial_world_size=divide):
        for step in range(BATCHES[rank]):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x, y = torch.randn(4, 6, generator=g, dtype=torch.float64), \
                torch.randint(0, 3, (4,), generator=g)
            net.odd = unused and step % 2 == 1
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return net


def oracle(world: int, *, divide: bool) -> nn.Module:
    """One process: at global step k every rank with more than k batches computes its
    gradient on its batch, from the same parameters and the buffers of the largest
    such rank (what join() broadcasts before each forward); gradients are summed and
    divided by the world size (or by the ranks still training); a parameter none of
    them used gets no gradient, so the optimizer leaves it alone."""
    import copy

    net = Net(seed=11, spare=True)  # rank 0's start, which DDP broadcasts
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(max(BATCHES)):
        active = [r for r in range(world) if BATCHES[r] > step]
        grads: dict[str, torch.Tensor] = {}
        state = None
        for r in active:
            replica = copy.deepcopy(net)
            g = torch.Generator().manual_seed(1000 * r + step)
            x, y = torch.randn(4, 6, generator=g, dtype=torch.float64), \
                torch.randint(0, 3, (4,), generator=g)
            replica.odd = step % 2 == 1
            F.cross_entropy(replica(x), y).backward()
            for name, p in replica.named_parameters():
                if p.grad is not None:
                    grads[name] = grads.get(name, 0) + p.grad
            state = {k: v for k, v in replica.state_dict().items() if "running" in k
                     or "num_batches" in k}  # the largest active rank's, last
        opt.zero_grad()
        for name, p in net.named_parameters():
            if name in grads:
                p.grad = grads[name] / (world if divide else len(active))
        opt.step()
        net.load_state_dict(state, strict=False)
    return net


def main() -> None:
    rank, world, groups, c = init()
    if world != 3:
        raise SystemExit("ddp_join.py: run it on 3 ranks")
    # every parameter used: torch's DDP is the oracle
    cases = [dict(divide=True, broadcast_buffers=True, unused=False, view=False),
             dict(divide=False, broadcast_buffers=True, unused=False, view=True),
             dict(divide=True, broadcast_buffers=False, unused=False, view=False)]
    for backend, group in groups.items():
        for case in cases:
            what = f"join {backend} {case}"
            ours = train(DDP, rank, group, **case)
            theirs = train(nn.parallel.DistributedDataParallel, rank, group, **case)
            compare_tensors(c, f"{what}: params", params(ours), params(theirs), *TOL)
            compare_tensors(c, f"{what}: buffers", buffers(ours), buffers(theirs), *TOL)
            same_on_all_ranks(c, f"{what}: params", list(params(ours).values()),
                              groups["gloo"])
        # a parameter unused on some steps: torch's DDP lets a rank that ran out of
        # inputs contribute its last iteration's used-parameter map, so the
        # single-process computation of what join() means is the oracle here
        for divide in (True, False):
            what = f"join {backend} find_unused_parameters divide={divide}"
            ours = train(DDP, rank, group, divide=divide, broadcast_buffers=True,
                         unused=True, view=False)
            want = oracle(world, divide=divide)
            compare_tensors(c, f"{what}: params", params(ours), params(want), *TOL)
            compare_tensors(c, f"{what}: buffers", buffers(ours), buffers(want), *TOL)
    # throw_on_early_termination: every rank raises once the first one runs out
    model = DDP(Net(seed=5), process_group=groups["ringcomm"])
    raised = None
    try:
        with model.join(throw_on_early_termination=True):
            for step in range(BATCHES[rank]):
                x = torch.randn(4, 6, dtype=torch.float64)
                model(x).sum().backward()
    except RuntimeError as e:
        raised = str(e)
    c.check(raised is not None and ("exhausted" in raised or "Detected" in raised),
            f"throw_on_early_termination: {raised}")
    done(c)


if __name__ == "__main__":
    main()
