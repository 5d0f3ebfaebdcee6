"""DDP features, each against an oracle (run with mpiexec -n 3, or any n >= 1):

* torch's DistributedDataParallel on the same group: ConvNet with BatchNorm in
  training mode, buffers broadcast or not, several bucket sizes.
* no_sync: gradients inside equal a local model's; the first synchronized
  backward afterwards equals one process on all micro-batches of all ranks.
* communication hooks: fp16/bf16 close to the exact average; torch's own
  allreduce hook and a hook that returns a new tensor give the exact average;
  hooks see buckets in index order; misuse raises.
* gradient_as_bucket_view: gradients live inside the bucket buffers.
* state_dict: torch DDP layout ("module." prefix); the inner module's loads into
  a plain model; the two DDPs' state_dicts load into each other.
* construction errors raised before any communication.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks

from _ddp_common import (buffers, compare_tensors, conv_net, done, grads, image_batch, init,
                         grads_or_marker, lm_batch, lm_loss, params, rank_slice, same_on_all_ranks,
                         sgd, tiny_lm)
import ddp
from ddp import DistributedDataParallel as DDP

F64 = (1e-9, 1e-12)


def vs_torch_ddp(c, rank, world, group, backend):
    for cap, broadcast_buffers in ((25, True), (0.0005, True), (0.002, False)):
        what = f"vs torch DDP {backend} cap={cap} broadcast_buffers={broadcast_buffers}"
        mine_m, theirs_m = conv_net(seed=7 + rank), conv_net(seed=7 + rank)
        mine = DDP(mine_m, process_group=group, bucket_cap_mb=cap,
                   broadcast_buffers=broadcast_buffers)
        theirs = nn.parallel.DistributedDataParallel(theirs_m, process_group=group,
                                                     bucket_cap_mb=cap,
                                                     broadcast_buffers=broadcast_buffers)
        opt_a, opt_b = sgd(mine), sgd(theirs)
        for step in range(3):
            x, y = image_batch(seed=300 + 10 * step + rank, n=3)  # per-rank data
            for model, opt in ((mine, opt_a), (theirs, opt_b)):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            compare_tensors(c, f"{what}: step {step} grads", grads(mine_m), grads(theirs_m),
                            *F64)
        compare_tensors(c, f"{what}: params", params(mine_m), params(theirs_m), *F64)
        # BatchNorm statistics: rank 0's before each forward, then this rank's batch.
        compare_tensors(c, f"{what}: buffers", buffers(mine_m), buffers(theirs_m), *F64)
        with torch.no_grad():  # evaluation forwards still run and agree
            x, _ = image_batch(seed=999, n=2)
            mine.eval(), theirs.eval()
            compare_tensors(c, f"{what}: eval output", {"out": mine(x)}, {"out": theirs(x)},
                            *F64)


def no_sync(c, rank, world, group, backend):
    micro = 3
    for view in (False, True):
        what = f"no_sync {backend} view={view}"
        oracle, local = tiny_lm(seed=5), tiny_lm(seed=5)
        model = tiny_lm(seed=5 + rank)
        net = DDP(model, process_group=group, bucket_cap_mb=0.001, gradient_as_bucket_view=view)
        batches = [lm_batch(seed=70 + m, n=2 * world) for m in range(micro)]
        for m, (tok, tgt) in enumerate(batches):
            mine = (rank_slice(tok, rank, world), rank_slice(tgt, rank, world))
            lm_loss(oracle(tok), tgt).backward()  # oracle: all ranks' data, accumulated
            if m < micro - 1:
                with net.no_sync():
                    lm_loss(net(mine[0]), mine[1]).backward()
                lm_loss(local(mine[0]), mine[1]).backward()  # this rank's data only
                compare_tensors(c, f"{what}: local grads inside no_sync, micro-batch {m}",
                                grads(model), grads(local), *F64)
            else:
                lm_loss(net(mine[0]), mine[1]).backward()
        compare_tensors(c, f"{what}: synced accumulated grads", grads(model), grads(oracle), *F64)
        same_on_all_ranks(c, f"{what}: grads", grads_or_marker(model), group)


def hooks(c, rank, world, group, backend):
    tok, tgt = lm_batch(seed=11, n=2 * world)
    oracle = tiny_lm(seed=3, dtype=torch.float32)
    lm_loss(oracle(tok), tgt).backward()
    want = grads(oracle)
    scale = max(g.abs().max().item() for g in want.values())
    seen: list[list[tuple[int, bool]]] = []  # per iteration: (index, is_last) per launch

    def recording(state, bucket):
        if bucket.index() == 0:
            seen.append([])
        seen[-1].append((bucket.index(), bucket.is_last()))
        shapes_ok = [g.shape == p.shape for g, p in zip(bucket.gradients(), bucket.parameters())]
        c.check(all(shapes_ok), f"hooks {backend}: bucket {bucket.index()} gradient shapes")
        return ddp.allreduce_hook(state, bucket)

    def fresh_tensor(state, bucket):
        # Reduces a copy and returns it: DDP must copy the result back.
        copy = bucket.buffer().clone() / dist.get_world_size(bucket.process_group)
        return dist.all_reduce(copy, group=bucket.process_group,
                               async_op=True).get_future().then(lambda f: f.value()[0])

    # (name, state, hook, relative tolerance against the float32 oracle)
    cases = [("default", None, ddp.allreduce_hook, 1e-5),
             ("recording", None, recording, 1e-5),
             ("torch allreduce_hook", group, torch_hooks.allreduce_hook, 1e-5),
             ("returns new tensor", None, fresh_tensor, 1e-5),
             # fp16: 11 significant bits, bf16: 8; per-rank rounding plus the sum's.
             ("fp16", None, ddp.fp16_compress_hook, 2e-3),
             ("bf16", group, ddp.bf16_compress_hook, 1.6e-2)]
    for name, state, hook, tol in cases:
        model = tiny_lm(seed=3 + rank, dtype=torch.float32)
        net = DDP(model, process_group=group, bucket_cap_mb=0.001)
        net.register_comm_hook(state, hook)
        for it in range(2):  # the second iteration runs on rebuilt buckets
            net.zero_grad()
            lm_loss(net(rank_slice(tok, rank, world)), rank_slice(tgt, rank, world)).backward()
        got = grads(model)
        compare_tensors(c, f"hook {name} {backend}", got, want, 0, tol * scale)
        if name in ("fp16", "bf16"):
            exact = all(torch.equal(got[k], want[k]) for k in want)
            c.check(not exact, f"hook {name} {backend}: result is bit-exact; was it compressed?")
        same_on_all_ranks(c, f"hook {name} {backend}", grads_or_marker(model),
                          group)
    c.check(len(seen) == 2, f"hooks {backend}: expected 2 iterations of launches: {seen}")
    for it in seen:
        n = len(it)
        c.check(n > 1 and [i for i, _ in it] == list(range(n)),
                f"hooks {backend}: buckets not launched in index order: {seen}")
        c.check([last for _, last in it] == [False] * (n - 1) + [True],
                f"hooks {backend}: is_last wrong: {seen}")

    # Misuse.
    net = DDP(tiny_lm(seed=3), process_group=group)
    try:
        net.register_comm_hook(None, "not a function")
        c.check(False, "register_comm_hook accepted a non-callable")
    except TypeError as e:
        c.check("callable" in str(e), f"non-callable hook: unclear error {e}")
    net.register_comm_hook(None, ddp.fp16_compress_hook)
    try:
        net.register_comm_hook(None, ddp.bf16_compress_hook)
        c.check(False, "register_comm_hook accepted a second hook")
    except RuntimeError as e:
        c.check("only once" in str(e), f"second hook: unclear error {e}")
    net2 = DDP(tiny_lm(seed=3), process_group=group)
    lm_loss(net2(rank_slice(tok, rank, world)), rank_slice(tgt, rank, world)).backward()
    try:
        net2.register_comm_hook(None, ddp.fp16_compress_hook)
        c.check(False, "register_comm_hook accepted a hook after training started")
    except RuntimeError as e:
        c.check("before the first" in str(e), f"late hook: unclear error {e}")


def bucket_view(c, rank, world, group, backend):
    what = f"gradient_as_bucket_view {backend}"
    model = tiny_lm(seed=21 + rank)
    net = DDP(model, process_group=group, bucket_cap_mb=0.001, gradient_as_bucket_view=True)
    oracle = tiny_lm(seed=21)
    tok, tgt = lm_batch(seed=5, n=2 * world)

    def inside_buckets() -> bool:
        spans = [(b.buffer.data_ptr(), b.buffer.data_ptr() + b.nbytes)
                 for b in net.reducer.buckets]
        return all(any(lo <= p.grad.data_ptr() < hi for lo, hi in spans)
                   for p in model.parameters())

    for step, set_to_none in enumerate((True, False, False)):
        net.zero_grad(set_to_none=set_to_none)
        oracle.zero_grad()
        lm_loss(oracle(tok), tgt).backward()
        lm_loss(net(rank_slice(tok, rank, world)), rank_slice(tgt, rank, world)).backward()
        c.check(inside_buckets(), f"{what}: step {step}: some grad is not a bucket view")
        compare_tensors(c, f"{what}: step {step} grads", grads(model), grads(oracle), *F64)


def state_dict(c, rank, world, group, backend):
    what = f"state_dict {backend}"
    plain = tiny_lm(seed=31)
    net = DDP(tiny_lm(seed=31 + rank), process_group=group)
    theirs = nn.parallel.DistributedDataParallel(tiny_lm(seed=77), process_group=group)
    sd = net.state_dict()
    c.check(sorted(sd) == sorted("module." + k for k in plain.state_dict()),
            f"{what}: keys {sorted(sd)} are not the plain model's with the 'module.' prefix")
    c.check(sorted(sd) == sorted(theirs.state_dict()), f"{what}: keys differ from torch DDP's")
    fresh = tiny_lm(seed=999)
    fresh.load_state_dict(net.module.state_dict())  # strict
    compare_tensors(c, f"{what}: module state loads into a plain model",
                    dict(fresh.state_dict()), dict(plain.state_dict()), 0, 0)
    theirs.load_state_dict(net.state_dict())  # strict, both directions
    net.load_state_dict(theirs.state_dict())
    compare_tensors(c, f"{what}: via torch DDP", dict(theirs.module.state_dict()),
                    dict(plain.state_dict()), 0, 0)


def construction_errors(c, rank, world, group, backend):
    def expect(exc, words, fn, what):
        try:
            fn()
            c.check(False, f"{what}: no error")
        except exc as e:
            c.check(all(w in str(e) for w in words), f"{what}: unclear error: {e}")

    expect(ValueError, ["bucket_cap_mb", "positive", "-1"],
           lambda: DDP(tiny_lm(seed=1), process_group=group, bucket_cap_mb=-1), "cap -1")
    expect(TypeError, ["nn.Module"], lambda: DDP(lambda x: x, process_group=group), "not module")
    frozen = tiny_lm(seed=1).requires_grad_(False)
    expect(RuntimeError, ["requires a gradient"], lambda: DDP(frozen, process_group=group),
           "frozen model")
    expect(RuntimeError, ["'0'", "sparse"],
           lambda: DDP(nn.Sequential(nn.Embedding(5, 2, sparse=True)), process_group=group),
           "sparse embedding")


def main() -> None:
    rank, world, groups, c = init()
    for backend, group in groups.items():
        for fn in (vs_torch_ddp, no_sync, hooks, bucket_view, state_dict, construction_errors):
            c.run(f"{fn.__name__} {backend}", fn, c, rank, world, group, backend)
    done(c)


if __name__ == "__main__":
    main()
