"""Per-rank program: tensor parallelism (torch.distributed.tensor.parallel) and
FSDP2 + tensor parallelism on ringcomm device meshes, checked against the same
training on gloo meshes and against one process training the unsharded model.

Run with ``mpiexec -n 4`` (a 1-D tp mesh of 4, then a 2x2 "dp" x "tp" mesh), or
torchrun ``--nproc-per-node=4``::

    OMP_NUM_THREADS=1 PYTHONPATH=. mpiexec -n 4 python tests/ranks/styles_tp.py

The model (float64): token embedding -> LayerNorm -> SwiGLU MLP (residual) ->
LayerNorm -> vocabulary projection, parallelized as torchtitan does:

  tp        embedding RowwiseParallel(input Replicate), w1/w3 ColwiseParallel,
            w2 RowwiseParallel, output ColwiseParallel(output Replicate); SGD
  tp+sp     embedding RowwiseParallel(output Shard(1)), both LayerNorms
            SequenceParallel, the MLP's input PrepareModuleInput(Shard(1) ->
            Replicate), w2 RowwiseParallel(output Shard(1)), output
            ColwiseParallel(input Shard(1), output Replicate); SGD
  tp+sp+lp  tp+sp with a vocabulary-sharded output (Shard(-1), DTensor) and
            cross_entropy under loss_parallel(); AdamW (foreach=False)
  fsdp+tp   2x2 mesh: tp+sp+lp over "tp", fully_shard (FSDP2) of the MLP and the
            root over "dp"; each dp rank trains on its own half of the batch

For each: the loss of each of 3 steps, the logits and every parameter's gradient
at the first step, every parameter after 3 optimizer steps (full_tensor()) and the
parameters' placements, against gloo and against the unsharded model trained in
one process (1-D: the same batch; fsdp+tp: the concatenated batch, mean loss).

torch.compile (fullgraph; backend aot_eager, or inductor with
STYLES_TP_COMPILE_BACKEND=inductor) of the tp+sp model on ringcomm: logits and
gradients equal the eager model's on ringcomm and on gloo, and the compiled
graph's collectives ran on ringcomm's group.
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Checker, done, init  # noqa: E402

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, loss_parallel,
    parallelize_module)

V, D, H, T, B = 16, 8, 16, 8, 2     # vocabulary, width, MLP width, sequence, batch
STEPS = 3
RTOL, ATOL = 1e-10, 1e-12


class FFN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, H)
        self.w3 = nn.Linear(D, H)
        self.w2 = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.norm1 = nn.LayerNorm(D)
        self.ffn = FFN()
        self.norm2 = nn.LayerNorm(D)
        self.out = nn.Linear(D, V, bias=False)
        with torch.no_grad():  # LayerNorm affine parameters that are not the defaults
            for norm in (self.norm1, self.norm2):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.ffn(self.norm1(h))
        return self.out(self.norm2(h))


def new_model(seed: int = 0) -> Model:
    torch.manual_seed(seed)
    return Model().double()


def batch(step: int, n: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g))


def plan(variant: str) -> dict:
    if variant == "tp":
        return {"emb": RowwiseParallel(input_layouts=Replicate()),
                "ffn.w1": ColwiseParallel(), "ffn.w3": ColwiseParallel(),
                "ffn.w2": RowwiseParallel(),
                "out": ColwiseParallel(output_layouts=Replicate())}
    lp = variant != "tp+sp"
    return {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm1": SequenceParallel(),
            "ffn": PrepareModuleInput(input_layouts=(Shard(1),),
                                      desired_input_layouts=(Replicate(),)),
            "ffn.w1": ColwiseParallel(), "ffn.w3": ColwiseParallel(),
            "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
            "norm2": SequenceParallel(),
            "out": ColwiseParallel(input_layouts=Shard(1),
                                   output_layouts=Shard(-1) if lp else Replicate(),
                                   use_local_output=not lp)}


# the tp-dim placement each parameter must have
WANT_PLACEMENT = {"emb.weight": Shard(0), "ffn.w1.weight": Shard(0), "ffn.w1.bias": Shard(0),
                  "ffn.w3.weight": Shard(0), "ffn.w3.bias": Shard(0),
                  "ffn.w2.weight": Shard(1), "ffn.w2.bias": Replicate(),
                  "out.weight": Shard(0)}


def optimizer(variant: str, params):
    if variant in ("tp", "tp+sp"):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, foreach=False)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(variant: str, mesh: DeviceMesh | None, dp_index: int = 0, dp_size: int = 1):
    """STEPS optimizer steps; ``mesh`` None: the unsharded model in one process on
    the whole (dp_size * B) batch. Returns losses, first-step logits (of this rank's
    batch), first-step gradients and final parameters, all as plain full tensors,
    and each parameter's placements."""
    model = new_model()
    lp = variant in ("tp+sp+lp", "fsdp+tp")
    if mesh is not None:
        if variant == "fsdp+tp":
            from torch.distributed.fsdp import fully_shard
            parallelize_module(model, mesh["tp"], plan(variant))
            fully_shard(model.ffn, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        else:
            parallelize_module(model, mesh, plan(variant))
    opt = optimizer(variant, model.parameters())
    losses, logits0, grads0 = [], None, None
    for step in range(STEPS):
        tokens, targets = batch(step, B * dp_size)
        if mesh is not None and dp_size > 1:
            tokens, targets = tokens[dp_index * B:(dp_index + 1) * B], \
                targets[dp_index * B:(dp_index + 1) * B]
        opt.zero_grad()
        ctx = loss_parallel() if (lp and mesh is not None) else contextlib.nullcontext()
        with ctx:
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
            loss.backward()
        losses.append(full(loss).detach().clone())
        if step == 0:
            logits0 = full(logits).detach().clone()
            grads0 = {n: full(p.grad).detach().clone() for n, p in model.named_parameters()}
        opt.step()
    params = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    placements = {n: tuple(p.placements) if isinstance(p, DTensor) else None
                  for n, p in model.named_parameters()}
    return torch.stack(losses), logits0, grads0, params, placements


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    return f"max diff {(a - b).abs().max().item():.3g}"


def compare(c: Checker, what: str, ours, other, against: str, outputs: bool = True):
    """Losses and step-0 logits (unless ``outputs`` is False), step-0 gradients and
    final parameters."""
    losses, logits0, grads0, params, _ = ours
    o_losses, o_logits0, o_grads0, o_params, _ = other
    if outputs:
        c.check(close(losses, o_losses),
                f"{what}: losses vs {against}: {diff(losses, o_losses)}")
        c.check(close(logits0, o_logits0),
                f"{what}: step-0 logits vs {against}: {diff(logits0, o_logits0)}")
    c.check(sorted(grads0) == sorted(o_grads0), f"{what}: parameter names differ")
    for n in sorted(set(grads0) & set(o_grads0)):
        c.check(close(grads0[n], o_grads0[n]),
                f"{what}: step-0 grad of {n} vs {against}: {diff(grads0[n], o_grads0[n])}")
        c.check(close(params[n], o_params[n]),
                f"{what}: {n} after {STEPS} steps vs {against}: {diff(params[n], o_params[n])}")


def check_placements(c: Checker, what: str, placements: dict, variant: str, tp_dim: int):
    for n, pl in sorted(placements.items()):
        want = WANT_PLACEMENT.get(n, Replicate())  # LayerNorms: replicated
        if variant == "tp" and n.startswith("norm"):
            c.check(pl is None, f"{what}: {n} should be a plain tensor, is {pl}")
            continue
        c.check(pl is not None and pl[tp_dim] == want,
                f"{what}: {n} placements {pl}, wanted {want} on the tp dim")


def same_on_ranks(c: Checker, what: str, tensors: list[torch.Tensor], gloo) -> None:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    first = flat.clone()
    dist.broadcast(first, src=0, group=gloo)
    c.check(torch.equal(flat, first), f"{what}: full parameters differ across ranks")


def check_tp(c: Checker, world: int, gloo) -> None:
    ring = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    glm = DeviceMesh.from_group(gloo, "cpu", mesh_dim_names=("tp",))
    for variant in ("tp", "tp+sp", "tp+sp+lp"):
        ref = train(variant, None)
        ours = c.run(f"{variant} on ringcomm", train, variant, ring)
        theirs = train(variant, glm)
        if ours is None:
            continue
        what = f"1-D tp mesh of {world}, {variant}"
        compare(c, what, ours, theirs, "gloo")
        compare(c, what, ours, ref, "one process")
        check_placements(c, what, ours[4], variant, 0)
        same_on_ranks(c, what, list(ours[3].values()), gloo)


def check_fsdp_tp(c: Checker, rank: int, gloo) -> None:
    ring = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    glm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"),
                           backend_override={"dp": "gloo", "tp": "gloo"})
    dp = ring.get_coordinate()[0]
    ours = c.run("fsdp+tp on ringcomm", train, "fsdp+tp", ring, dp, 2)
    theirs = train("fsdp+tp", glm, dp, 2)
    ref = train("fsdp+tp", None, 0, 2)
    if ours is None:
        return
    what = "2x2 dp x tp mesh, FSDP2 + tp+sp+lp"
    compare(c, what, ours, theirs, "gloo")
    # one process: the losses and gradients of the concatenated batch; the logits of
    # this dp rank's half of it
    ref_losses, ref_logits = ref[0], ref[1]
    mine = ref_logits[dp * B:(dp + 1) * B]
    c.check(close(ours[1], mine), f"{what}: step-0 logits vs one process: "
                                  f"{diff(ours[1], mine)}")
    # each dp rank's loss is the mean over its half: their mean is the whole batch's
    both = ours[0].clone()
    dist.all_reduce(both, group=gloo)
    both /= dist.get_world_size()
    c.check(close(both, ref_losses), f"{what}: mean loss vs one process: "
                                     f"{diff(both, ref_losses)}")
    compare(c, what, ours, ref, "one process", outputs=False)
    from torch.distributed.tensor.placement_types import _StridedShard
    for n, pl in sorted(ours[4].items()):
        # dp: FSDP2 shards dim 0 (_StridedShard where tp shards dim 0 too)
        want_tp = WANT_PLACEMENT.get(n, Replicate())
        c.check(pl is not None and len(pl) == 2 and pl[1] == want_tp
                and (pl[0] == Shard(0) or isinstance(pl[0], _StridedShard) and pl[0].dim == 0),
                f"{what}: {n} placements {pl}, wanted a dim-0 dp shard and {want_tp} on tp")
    same_on_ranks(c, what, list(ours[3].values()), gloo)


def check_compile(c: Checker, world: int, gloo) -> None:
    """torch.compile (fullgraph) of the tp+sp model on ringcomm: logits and gradients
    equal the eager model's on ringcomm and on gloo, and the compiled graph's
    collectives ran on ringcomm's group. The backend is aot_eager (AOTAutograd traces
    DTensor's collectives into _c10d_functional ops, as for inductor, without code
    generation); STYLES_TP_COMPILE_BACKEND=inductor runs inductor instead (C++
    compilation: about 75 s more on 2 cores with a cold cache)."""
    import ringcomm

    backend = os.environ.get("STYLES_TP_COMPILE_BACKEND", "aot_eager")

    ring = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    glm = DeviceMesh.from_group(gloo, "cpu", mesh_dim_names=("tp",))
    tokens, targets = batch(7)

    def run(mesh, compiled: bool):
        model = new_model()
        parallelize_module(model, mesh, plan("tp+sp"))
        fn = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
        logits = fn(tokens)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)).backward()
        return logits.detach().clone(), {n: full(p.grad).detach().clone()
                                         for n, p in model.named_parameters()}

    eager = run(ring, False)
    eager_gloo = run(glm, False)
    pg = ringcomm.get_group()
    seq = pg.seq
    compiled = c.run(f"torch.compile ({backend}) of the tp+sp model on ringcomm", run, ring,
                     True)
    if compiled is None:
        return
    # forward: 2 all-gathers, 2 reduce-scatters, 1 all-gather; backward as many, but
    # full(p.grad) adds its own: at least 9 collectives on ringcomm's default group
    c.check(pg.seq - seq >= 9, f"compiled run: only {pg.seq - seq} collectives on ringcomm")
    for other, against in ((eager, "eager on ringcomm"), (eager_gloo, "eager on gloo")):
        c.check(close(compiled[0], other[0]),
                f"compiled tp+sp logits vs {against}: {diff(compiled[0], other[0])}")
        for n in sorted(eager[1]):
            c.check(close(compiled[1][n], other[1][n]),
                    f"compiled tp+sp grad of {n} vs {against}: "
                    f"{diff(compiled[1][n], other[1][n])}")


def main() -> None:
    rank, world, groups, c = init()
    gloo = groups["gloo"]
    check_tp(c, world, gloo)
    if world == 4:
        check_fsdp_tp(c, rank, gloo)
    check_compile(c, world, gloo)
    done(c)


if __name__ == "__main__":
    main()
