"""Per-rank program: torch's own DistributedDataParallel on ringcomm trains exactly
like on gloo (same parameters after several steps, several configurations)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ringcomm  # noqa: F401
from _common import Checker


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


def train(group, steps: int, **ddp_kw) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = DDP(Net(), process_group=group, bucket_cap_mb=0.01, **ddp_kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    dist.init_process_group("ringcomm")
    c = Checker(dist.get_rank())
    gloo = dist.new_group(backend="gloo")
    for kw in ({"find_unused_parameters": True}, {"find_unused_parameters": True,
                                                  "gradient_as_bucket_view": True}):
        ours = train(None, 4, **kw)
        ref = train(gloo, 4, **kw)
        for i, (a, b) in enumerate(zip(ours, ref)):
            c.check(torch.allclose(a, b, rtol=1e-6, atol=1e-7),
                    f"DDP {kw} parameter {i}: max diff {(a - b).abs().max().item()}")
        # replicas agree with each other
        flat = torch.cat([p.flatten() for p in ours])
        first = flat.clone()
        dist.broadcast(first, src=0, group=gloo)
        c.check(torch.equal(flat, first), f"DDP {kw}: replicas diverged")
    dist.destroy_process_group()
    c.finish()


if __name__ == "__main__":
    main()
