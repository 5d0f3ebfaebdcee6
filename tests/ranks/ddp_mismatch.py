"""Wrapping models that differ across ranks: a clear error on every rank, never a hang
(run with mpiexec -n 3; with fewer ranks the "last rank differs" cases shrink).

Each case builds a model that differs on the last rank (or rank 0); every rank
must raise RuntimeError naming the first mismatching parameter or buffer and
the ranks involved. The launch's timeout is what proves "no hang". The group
must still be usable afterwards: a correct model then trains normally.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from _ddp_common import done, init, rank_slice
from ddp import DistributedDataParallel as DDP


def mlp(hidden: int = 4, dtype=torch.float32, extra: bool = False,
        frozen_first: bool = False) -> nn.Module:
    layers = [nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 2)]
    if extra:
        layers.append(nn.Linear(2, 2))
    m = nn.Sequential(*layers).to(dtype)
    if frozen_first:
        m[0].weight.requires_grad_(False)
    return m


def main() -> None:
    rank, world, groups, c = init()
    last = world - 1
    odd = rank == last and world > 1  # the rank that differs
    # (case name, this rank's model, words every rank's error must contain)
    cases = [
        ("shape", lambda: mlp(hidden=5 if odd else 4),
         ["parameter #0", "'0.weight'", "(5, 3)", "(4, 3)", f"rank {last}"]),
        ("dtype", lambda: mlp(dtype=torch.float64 if odd else torch.float32),
         ["parameter #0", "'0.weight'", "torch.float64", "torch.float32", f"rank {last}"]),
        ("count", lambda: mlp(extra=odd),
         ["'3.weight'", "numbers differ", f"rank {last}: 6 parameters"]),
        ("requires_grad", lambda: mlp(frozen_first=odd),
         ["'0.weight'", "requires_grad=False", "requires_grad=True"]),
        ("buffer", lambda: nn.Sequential(
            nn.Linear(3, 4), nn.BatchNorm1d(4, affine=False, track_running_stats=not odd)),
         ["buffer #0", "'1.running_mean'", "numbers differ"]),
    ]
    for backend, group in groups.items():
        for name, build, words in cases:
            what = f"{backend} {name}"
            torch.manual_seed(0)
            try:
                DDP(build(), process_group=group)
                c.check(world == 1, f"{what}: no error")
            except RuntimeError as e:
                msg = str(e)
                c.check(world > 1, f"{what}: error with one rank: {msg}")
                missing = [w for w in words if w not in msg]
                c.check(not missing, f"{what}: message lacks {missing}: {msg}")
                c.check(f"rank {rank} of {world}" in msg, f"{what}: message lacks the rank: {msg}")

        # The group is still consistent: a good model trains and replicas agree.
        torch.manual_seed(rank)
        net = DDP(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), process_group=group)
        x = torch.randn(2 * world, 3, generator=torch.Generator().manual_seed(1))
        net(rank_slice(x, rank, world)).sum().backward()
        g = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
        out = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(out, g, group=group)
        c.check(all(torch.equal(o, out[0]) for o in out), f"{backend}: afterwards grads differ")
    done(c)


if __name__ == "__main__":
    main()
