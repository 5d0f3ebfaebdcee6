"""Per-rank program: torch.distributed.pipelining schedules with ringcomm carrying the
stage-to-stage traffic.

A 12-layer MLP (width 16, float64) is split by hand into PipelineStages (no
``pipeline()`` tracing). Each schedule below runs twice from the same initial
weights: once with ``PipelineStage(group=...)`` the ringcomm default group, once
with a gloo group over the same ranks. Both are compared with one process training
the unsplit model on the whole batch:

  * the per-microbatch losses and the merged output that ``step()`` returns on the
    rank holding the last stage, at each of 3 steps;
  * every local stage parameter's gradient after the first ``step()``;
  * every local stage parameter after 3 SGD (momentum) steps;
  * ``schedule.eval()`` afterwards (forward only, losses and output of the trained
    model).

Against the one-process reference: allclose (rtol 1e-9, atol 1e-12); the pipeline
sums per-microbatch gradients, so rounding differs. Against gloo: bitwise equal
(the backend only moves the tensors; the arithmetic is the same).

Loss scaling, as torch defines it (schedules.py, ``scale_grads``): with the default
``scale_grads=True`` the stage divides the accumulated gradients by the number of
microbatches, so a mean-reduced loss per microbatch gives the gradient of the mean
loss over the whole batch (microbatches are equal in size). With
``scale_grads=False`` gradients are summed, which matches a sum-reduced loss over
the whole batch; the "sum loss" cases check that.

Schedules (N = world size, M = max(4, 2N) microbatches of 2 samples):
  GPipe, 1F1B                       one stage per rank (N stages)
  1F1B static                       1F1B with input_args/output_args given, so the
                                    stages skip the metadata exchange (STATIC mode)
  GPipe sum loss                    scale_grads=False with a sum-reduced loss
  Interleaved1F1B, LoopedBFS,       two stages per rank, stage i on rank i % N
  InterleavedZeroBubble
  Interleaved1F1B sum loss          scale_grads=False, two stages per rank
  ZBVZeroBubble, DualPipeV          two stages per rank in a V: rank r holds
                                    stages r and 2N-1-r (torch's "v" mapping;
                                    both require exactly 2 stages per rank, and
                                    DualPipeV at least as many microbatches as
                                    stages, hence M >= 2N)
All of torch 2.13's schedules train on CPU over gloo; none is left out. One thing
is: ``eval()`` (forward only) after training, on ZBVZeroBubble and DualPipeV. On
gloo as on ringcomm, torch's _PipelineScheduleRuntime (schedules.py) still runs
backward actions of the compute schedule ("2I0" for ZBV, "2B0" for DualPipeV, at
2 ranks) and raises there:
    AssertionError: can't steal_bwd_input if this stage doesn't have backward
(the other rank is left in a receive), so those two are checked in training only.

Run:
  OMP_NUM_THREADS=1 PYTHONPATH=. mpiexec -n 2 python tests/ranks/styles_pipeline.py
  python -m torch.distributed.run --standalone --nproc-per-node=2 \
      tests/ranks/styles_pipeline.py
(3 ranks work too: a non-power-of-two pipeline.)
"""
from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Checker, done, init  # noqa: E402

WIDTH, LAYERS, MB_SIZE, STEPS = 16, 12, 2, 3
DTYPE = torch.float64
RTOL, ATOL = 1e-9, 1e-12
LR, MOMENTUM = 0.1, 0.9

# name, schedule class, stages per rank, stage placement, options
SPECS = [
    ("GPipe", ScheduleGPipe, 1, "loop", {}),
    ("1F1B", Schedule1F1B, 1, "loop", {}),
    ("1F1B static", Schedule1F1B, 1, "loop", {"static": True}),
    ("GPipe sum loss", ScheduleGPipe, 1, "loop", {"sum": True}),
    ("Interleaved1F1B", ScheduleInterleaved1F1B, 2, "loop", {}),
    ("LoopedBFS", ScheduleLoopedBFS, 2, "loop", {}),
    ("InterleavedZeroBubble", ScheduleInterleavedZeroBubble, 2, "loop", {}),
    ("Interleaved1F1B sum loss", ScheduleInterleaved1F1B, 2, "loop", {"sum": True}),
    # eval() is left out for the V schedules: on gloo it raises (see the docstring)
    ("ZBVZeroBubble", ScheduleZBVZeroBubble, 2, "v", {"no_eval": True}),
    ("DualPipeV", ScheduleDualPipeV, 2, "v", {"no_eval": True}),
]


def full_model() -> nn.Sequential:
    """LAYERS blocks (Linear + Tanh; the last is Linear alone), the same on every rank."""
    torch.manual_seed(1234)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS - 1)]
    blocks.append(nn.Sequential(nn.Linear(WIDTH, WIDTH)))
    return nn.Sequential(*blocks).to(DTYPE)


def layer_range(stage: int, n_stages: int) -> range:
    per = LAYERS // n_stages
    return range(stage * per, (stage + 1) * per)


def stage_ranks(world: int, n_stages: int, style: str) -> dict[int, int]:
    """Stage index -> rank, as torch's generate_stage_to_rank_mapping places them."""
    if style == "loop":
        return {s: s % world for s in range(n_stages)}
    mapping, r = {}, 0  # "v": 0, 1, .., N-1, N-1, .., 1, 0
    for s in range(n_stages):
        mapping[s] = r
        if (s + 1) % world == 0:
            continue
        r += 1 if (s // world) % 2 == 0 else -1
    return mapping


def batch(step: int, n_mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    n = n_mb * MB_SIZE
    return (torch.randn(n, WIDTH, generator=g, dtype=DTYPE),
            torch.randn(n, WIDTH, generator=g, dtype=DTYPE))


def loss_fn(summed: bool):
    def fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target, reduction="sum" if summed else "mean")
    return fn


def reference(n_mb: int, summed: bool) -> dict:
    """One process, the unsplit model, the whole batch (the oracle)."""
    model = full_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    lf = loss_fn(summed)
    rec: dict = {"losses": [], "outputs": []}
    for step in range(STEPS):
        x, y = batch(step, n_mb)
        with torch.no_grad():
            rec["losses"].append([lf(model(xm), ym) for xm, ym in
                                  zip(x.chunk(n_mb), y.chunk(n_mb))])
        opt.zero_grad()
        out = model(x)
        lf(out, y).backward()  # mean: the mean over microbatches' means (equal sizes)
        rec["outputs"].append(out.detach().clone())
        if step == 0:
            rec["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    rec["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batch(STEPS, n_mb)
    with torch.no_grad():
        rec["eval_output"] = model(x)
        rec["eval_losses"] = [lf(model(xm), ym) for xm, ym in zip(x.chunk(n_mb), y.chunk(n_mb))]
    return rec


def run_pipeline(spec, group, n_mb: int) -> dict:
    """Train the split model with one schedule over ``group``; what this rank saw."""
    _, cls, per_rank, style, opts = spec
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n_stages = per_rank * world
    placement = stage_ranks(world, n_stages, style)
    mine = sorted(s for s, r in placement.items() if r == rank)
    full = full_model()
    mods, names = [], []  # names: (stage module's param, the full model's name)
    for s in mine:
        layers = layer_range(s, n_stages)
        mod = nn.Sequential(*[copy.deepcopy(full[j]) for j in layers])
        mods.append(mod)
        for n, p in mod.named_parameters():
            i, rest = n.split(".", 1)
            names.append((p, f"{layers[int(i)]}.{rest}"))
    extra = {}
    stages = []
    for s, mod in zip(mine, mods):
        if opts.get("static"):
            # the output requires grad (the stage computes it), as does a received input
            extra = {"input_args": (torch.empty(MB_SIZE, WIDTH, dtype=DTYPE,
                                                requires_grad=s > 0),),
                     "output_args": (torch.empty(MB_SIZE, WIDTH, dtype=DTYPE,
                                                 requires_grad=True),)}
        stages.append(PipelineStage(mod, s, n_stages, torch.device("cpu"), group=group, **extra))
    summed = opts.get("sum", False)
    kwargs = {"n_microbatches": n_mb, "loss_fn": loss_fn(summed), "scale_grads": not summed}
    schedule = cls(stages[0] if per_rank == 1 else stages, **kwargs)
    has_first, has_last = 0 in mine, (n_stages - 1) in mine
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=LR, momentum=MOMENTUM)
    rec: dict = {"losses": [], "outputs": [], "names": [n for _, n in names]}

    def one(step: int, train: bool):
        x, y = batch(step, n_mb)
        args = (x,) if has_first else ()
        losses: list = []
        call = schedule.step if train else schedule.eval
        out = call(*args, target=y if has_last else None, losses=losses if has_last else None)
        return out, losses

    for step in range(STEPS):
        opt.zero_grad()
        out, losses = one(step, True)
        if has_last:
            rec["outputs"].append(out.detach().clone())
            rec["losses"].append([l.detach().clone() for l in losses])
        if step == 0:
            rec["grads"] = [None if p.grad is None else p.grad.detach().clone()
                            for p, _ in names]
        opt.step()
    rec["params"] = [p.detach().clone() for p, _ in names]
    if opts.get("no_eval"):
        rec["has_last"] = has_last
        return rec
    out, losses = one(STEPS, False)
    if has_last:
        rec["eval_output"] = out.detach().clone()
        rec["eval_losses"] = [l.detach().clone() for l in losses]
    rec["has_last"] = has_last
    return rec


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def compare(c: Checker, what: str, got: torch.Tensor | None, ref: torch.Tensor,
            gloo: torch.Tensor | None) -> None:
    if got is None:
        c.check(False, f"{what}: no value on ringcomm")
        return
    ok = got.shape == ref.shape and torch.allclose(got, ref, rtol=RTOL, atol=ATOL)
    c.check(ok, f"{what}: differs from one process on the whole batch: max diff "
                f"{diff(got, ref) if got.shape == ref.shape else (got.shape, ref.shape)}")
    if gloo is not None:
        ok = got.shape == gloo.shape and torch.equal(got, gloo)
        c.check(ok, f"{what}: differs from the same schedule over gloo: max diff "
                    f"{diff(got, gloo) if got.shape == gloo.shape else (got.shape, gloo.shape)}")


def check_spec(c: Checker, spec, ring, gloo, n_mb: int) -> None:
    name = spec[0]
    results = {}
    for backend, group in (("ringcomm", ring), ("gloo", gloo)):
        results[backend] = c.run(f"{name} over {backend}", run_pipeline, spec, group, n_mb)
    check_results(c, spec, results["ringcomm"], results["gloo"], n_mb)


def check_results(c: Checker, spec, ours: dict | None, theirs: dict | None, n_mb: int) -> None:
    """What one rank saw of ``spec`` (``ours``) against one process on the whole batch
    and, bit for bit, against the same schedule over gloo (``theirs``; None: that
    comparison is left out)."""
    name = spec[0]
    refs = reference(n_mb, spec[4].get("sum", False))
    if ours is None:
        return
    if theirs is not None:
        c.check(ours["names"] == theirs["names"], f"{name}: stage parameters differ from gloo's")
    g = (lambda key, *i: _get(theirs, key, *i))
    if ours["has_last"]:
        for step in range(STEPS):
            compare(c, f"{name} step {step} output", ours["outputs"][step],
                    refs["outputs"][step], g("outputs", step))
            c.check(len(ours["losses"][step]) == n_mb,
                    f"{name} step {step}: {len(ours['losses'][step])} losses, expected {n_mb}")
            for m, loss in enumerate(ours["losses"][step][:n_mb]):
                compare(c, f"{name} step {step} microbatch {m} loss", loss,
                        refs["losses"][step][m], g("losses", step, m))
    if ours["has_last"] and not spec[4].get("no_eval"):
        compare(c, f"{name} eval output", ours["eval_output"], refs["eval_output"],
                g("eval_output"))
        for m in range(n_mb):
            got = ours["eval_losses"][m] if m < len(ours["eval_losses"]) else None
            compare(c, f"{name} eval microbatch {m} loss", got, refs["eval_losses"][m],
                    g("eval_losses", m))
    for i, pname in enumerate(ours["names"]):
        compare(c, f"{name} gradient of {pname} after one step()", ours["grads"][i],
                refs["grads"][pname], g("grads", i))
        compare(c, f"{name} {pname} after {STEPS} steps", ours["params"][i],
                refs["params"][pname], g("params", i))


def _get(rec, key, *index):
    if rec is None or key not in rec:
        return None
    v = rec[key]
    for i in index:
        if i >= len(v):
            return None
        v = v[i]
    return v


def main() -> None:
    rank, world, groups, c = init()
    ring, gloo = groups["ringcomm"], groups["gloo"]
    c.check(dist.get_backend(ring) == "ringcomm", f"default group is {dist.get_backend(ring)}")
    n_mb = max(4, 2 * world)
    for spec in SPECS:
        check_spec(c, spec, ring, gloo, n_mb)
    done(c)


if __name__ == "__main__":
    main()
