"""Shared by the ddp_* per-rank programs: set-up, small models, data, comparisons.

Oracles used by the DDP tests:

* Single process on the concatenated batch. DDP's gradient is the mean over ranks
  of each rank's mean-loss gradient; with equal per-rank batch sizes that is the
  gradient of the mean loss over the concatenated batch, *provided the model maps
  each sample independently*. BatchNorm in training mode breaks that (its output
  depends on batch statistics), so oracle tests put BatchNorm in eval mode
  (running statistics: a per-sample affine map whose weight and bias still train).
* torch's own DistributedDataParallel on the same group, for what the first oracle
  cannot cover (BatchNorm in training mode, buffer broadcasting).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Checker, done, init  # noqa: E402,F401  (init, done: for the ddp_* programs)

VOCAB, DIM, SEQ = 23, 12, 5


class Classifier(nn.Module):
    """Three linear layers: 12 features -> 3 classes (for :func:`train_classifier`)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def train_classifier(wrapper, model: nn.Module, group, *, bucket_cap_mb: float, batch: int,
                     steps: int = 4) -> list[torch.Tensor]:
    """``steps`` SGD steps of ``wrapper(model)`` (a DDP class) on ``group``, each rank on
    its own seeded batch of 12 features and 3 classes; the parameters afterwards."""
    ddp_model = wrapper(model, process_group=group, bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    rank = dist.get_rank()
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(batch, 12, generator=g), torch.randint(0, 3, (batch,), generator=g)
        opt.zero_grad()
        F.cross_entropy(ddp_model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in ddp_model.parameters()]


class TinyLM(nn.Module):
    """Embedding -> Conv1d -> BatchNorm1d -> Linear -> head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.conv = nn.Conv1d(DIM, DIM, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm1d(DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.emb.weight  # shared parameter: two uses, one gradient
        with torch.no_grad():  # buffers worth broadcasting
            self.bn.running_mean.normal_(0, 0.3)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).transpose(1, 2)                      # (B, DIM, T)
        h = torch.tanh(self.bn(self.conv(h))).transpose(1, 2)     # (B, T, DIM)
        h = h + torch.tanh(self.hidden(h))
        return self.head(h)                                       # (B, T, VOCAB)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def lm_batch(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (n, SEQ), generator=g),
            torch.randint(0, VOCAB, (n, SEQ), generator=g))


def tiny_lm(seed: int, dtype: torch.dtype = torch.float64) -> TinyLM:
    """A TinyLM with BatchNorm in eval mode (see the module docstring)."""
    torch.manual_seed(seed)
    m = TinyLM().to(dtype)
    m.bn.eval()
    return m


class ConvNet(nn.Module):
    """Conv2d -> BatchNorm2d (training mode) -> pool -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 2 * 2, 3)
        with torch.no_grad():  # seed-dependent statistics: broadcasting them shows
            self.bn1.running_mean.normal_(0, 0.3)
            self.bn1.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return self.fc(h.flatten(1))


def conv_net(seed: int) -> ConvNet:
    torch.manual_seed(seed)
    return ConvNet().double()


def image_batch(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 2, 4, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g))


def rank_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per:(rank + 1) * per]


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    # Momentum carries every step's error into the next: a good amplifier for
    # comparisons over several steps.
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def compare_tensors(c: Checker, what: str, got: dict[str, torch.Tensor | None],
                    want: dict[str, torch.Tensor | None], rtol: float, atol: float) -> None:
    """Check two name->tensor maps agree (both None counts as agreeing)."""
    c.check(sorted(got) == sorted(want), f"{what}: names differ: {sorted(got)} vs {sorted(want)}")
    for name in sorted(set(got) & set(want)):
        g, w = got[name], want[name]
        if g is None or w is None:
            c.check(g is None and w is None,
                    f"{what}: {name}: one is None: got {g is None}, want {w is None}")
            continue
        ok = g.shape == w.shape and torch.allclose(g.double(), w.double(), rtol=rtol, atol=atol)
        c.check(ok, f"{what}: {name}: max |diff| {max_diff(g, w):.3g} "
                    f"(rtol {rtol}, atol {atol})")


def params(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def grads(m: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.detach().clone())
            for n, p in m.named_parameters()}


def buffers(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in m.named_buffers()}


def grads_or_marker(m: nn.Module) -> list[torch.Tensor]:
    """Each parameter's gradient, or a marker value where it is None (keeps the
    collective in same_on_all_ranks the same size on every rank)."""
    return [torch.full_like(p, -1234.5) if p.grad is None else p.grad for p in m.parameters()]


def same_on_all_ranks(c: Checker, what: str, tensors: list[torch.Tensor],
                      group: dist.ProcessGroup) -> None:
    """Replicas must be bitwise identical: every rank applied the same update."""
    flat = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    world = dist.get_world_size(group)
    out = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(out, flat, group=group)
    for r in range(world):
        c.check(torch.equal(out[r], out[0]),
                f"{what}: rank {r} differs from rank 0 by {max_diff(out[r], out[0]):.3g}")
