"""DDP's buckets reduced where the gradients lie (run with mpiexec -n 2 or 3).

Where the group sums a bucket's tensors where they lie (ringcomm's
allreduce_coalesced over shared memory: shm_direct, auto's pick at 2 ranks and
set by ``RINGCOMM_ALGO=allreduce=shm_direct`` at more), this DDP divides each
gradient in place and reduces it there, with no copy into the bucket and back.
Oracle: torch's DistributedDataParallel on the same group and data, bit for bit
(gradients every step, parameters at the end), in four cases: the default; a
layer one rank leaves unused (``find_unused_parameters``); gradients accumulated
under ``no_sync`` before a synchronized step; gradients set to None between steps
(new tensors every backward). Each case also checks that the reducer did reduce in
place (every bucket coalesced, gradients left where they lay).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from _ddp_common import done, init
from ddp import DistributedDataParallel as DDP

STEPS = 3


class Net(nn.Module):
    """Four linear layers, ~0.3 M parameters (buckets well above auto's shm_direct
    threshold); with ``skip``, rank 1 leaves the third layer unused."""

    def __init__(self, skip: bool) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 256)
        self.c, self.d = nn.Linear(256, 256), nn.Linear(256, 10)
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.b(torch.relu(self.a(x))))
        if not (self.skip and dist.get_rank() == 1):
            h = torch.relu(self.c(h))
        return self.d(h)


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * rank + step))


def run_case(c, rank: int, name: str, unused: bool, accumulate: int, set_to_none: bool) -> None:
    ours = DDP(Net(unused), bucket_cap_mb=0.25, find_unused_parameters=unused)
    ref = TorchDDP(Net(unused), bucket_cap_mb=0.25, find_unused_parameters=unused)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, ref)]
    for step in range(STEPS):
        for model, opt in zip((ours, ref), opts):
            opt.zero_grad(set_to_none=set_to_none)
            for k in range(accumulate):
                with model.no_sync():
                    model(batch(rank, 10 * step + k)).square().mean().backward()
            model(batch(rank, 10 * step + 9)).square().mean().backward()
        it = ours.reducer.it
        c.check(all(ours.reducer._in_place) and all(it.coalesced) and any(it.lying),
                f"{name} step {step}: not reduced in place (in place {ours.reducer._in_place}, "
                f"coalesced {it.coalesced}, lying {sum(it.lying)})")
        for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
            c.check((p.grad is None and q.grad is None) or (
                p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)),
                f"{name} step {step}: {n}.grad differs from torch's DDP")
        for opt in opts:
            opt.step()
    c.check(all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters())),
            f"{name}: parameters differ from torch's DDP")


def main() -> None:
    rank, _, _, c = init()
    for name, unused, accumulate, set_to_none in (
            ("default", False, 0, True), ("an unused layer", True, 0, True),
            ("accumulated under no_sync", False, 2, False),
            ("gradients kept between steps", False, 0, False)):
        run_case(c, rank, name, unused, accumulate, set_to_none)
    done(c)


if __name__ == "__main__":
    main()
