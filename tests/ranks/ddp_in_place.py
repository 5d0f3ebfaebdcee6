"""DDP's buckets reduced where the gradients lie (run with mpiexec -n 2 or 3).

Where the group sums a bucket's tensors where they lie (ringcomm's
allreduce_coalesced over shared memory: shm_direct, auto's pick at 2 ranks and
set by ``RINGCOMM_ALGO=allreduce=shm_direct`` at more), this DDP divides each
gradient in place when its bucket goes out and reduces it there, with no copy into
the bucket and back.
Oracle: torch's DistributedDataParallel on the same group and data, bit for bit
(gradients every step, parameters at the end), in four cases: the default; a
layer one rank leaves unused (``find_unused_parameters``); gradients accumulated
under ``no_sync`` before a synchronized step; gradients set to None between steps
(new tensors every backward). Each case also checks that the reducer did reduce in
place (every bucket coalesced, gradients left where they lay). A fifth case gives a
parameter, in a bucket of its own, a gradient that is a view of one another branch
of the backward still reads (a bias added to a batch of one: autograd hands the
parameter the squeezed gradient itself): dividing it in place would change what the
layer before reads, so it goes through its slot, and the layer's gradients still
equal torch's.
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


class SharedGrad(nn.Module):
    """``out(lin(x) + bias.unsqueeze(0))`` on a batch of one: the add passes one
    gradient to both branches, and ``bias`` gets a view of it (no broadcasting to
    undo) while ``lin``'s backward, run after ``bias``'s hook, still reads it."""

    def __init__(self, skip: bool = False) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.lin, self.out = nn.Linear(64, 2048), nn.Linear(2048, 10)
        self.bias = nn.Parameter(torch.randn(2048))  # 8 KiB: auto's shm_direct size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.lin(x[:1]) + self.bias.unsqueeze(0)))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * rank + step))


def run_case(c, rank: int, name: str, unused: bool, accumulate: int, set_to_none: bool,
             net: type = Net, cap: float = 0.25) -> None:
    ours = DDP(net(unused), bucket_cap_mb=cap, find_unused_parameters=unused)
    ref = TorchDDP(net(unused), bucket_cap_mb=cap, find_unused_parameters=unused)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, ref)]
    for step in range(STEPS):
        for model, opt in zip((ours, ref), opts):
            opt.zero_grad(set_to_none=set_to_none)
            for k in range(accumulate):
                with model.no_sync():
                    model(batch(rank, 10 * step + k)).square().mean().backward()
            model(batch(rank, 10 * step + 9)).square().mean().backward()
        it, red = ours.reducer.it, ours.reducer
        if net is Net:
            c.check(all(red._in_place) and all(it.coalesced) and any(it.lying),
                    f"{name} step {step}: not reduced in place (in place {red._in_place}, "
                    f"coalesced {it.coalesced}, lying {sum(it.lying)})")
        else:  # the bias's own bucket went out in place; once the buckets follow the
            # gradients' order it goes out at the bias's hook, while lin's backward has
            # yet to read that memory: through its slot
            i = [p for p in ours.parameters()].index(ours.module.bias)
            c.check(it.coalesced[red._bucket_of[i]] and (step == 0 or not it.lying[i]),
                    f"{name} step {step}: the bias's bucket coalesced "
                    f"{it.coalesced[red._bucket_of[i]]}, the bias reduced where it lay "
                    f"{it.lying[i]}")
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
    # a bucket per parameter (cap 0): the bias's goes out at its own hook, before
    # lin's backward has read the gradient the bias was handed
    run_case(c, rank, "a gradient another branch still reads", False, 0, True, SharedGrad, 0)
    done(c)


if __name__ == "__main__":
    main()
