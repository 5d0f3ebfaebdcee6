"""DDP behaviour that depends on the autograd graph (run with mpiexec -n 3, or any n >= 1):

* unused parameters with find_unused_parameters=True: globally unused, and used
  on some ranks only, changing from step to step, or used only inside no_sync;
  compared every step with one process that evaluates every rank's loss with
  that rank's choices (the concatenated-batch oracle when ranks run different
  code paths). Globally
  unused gradients stay None, or exactly unchanged, even when ranks hold
  different values.
* outputs the loss ignores on some ranks; a parameter the loss uses outside
  DDP's forward (taken if its bucket is still open, a clear error otherwise).
* without find_unused_parameters: a clear error on the ranks that left a
  parameter unused, and no hang: the next iteration works everywhere.
* overlap: the first bucket's allreduce is launched before backward reaches the
  first layer (event order, no clocks).
* bucket rebuild: after the first iteration, buckets follow the order in which
  rank 0 saw gradients arrive, on every rank, even when other ranks saw another
  order; accumulated gradients survive the rebuild.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from _ddp_common import (compare_tensors, grads, grads_or_marker, init, params,
                         same_on_all_ranks, sgd)
import ddp
from ddp import DistributedDataParallel as DDP

F64 = (1e-9, 1e-12)


class Branchy(nn.Module):
    """A trunk plus branches a and b that a caller may skip, and one never used."""

    def __init__(self, with_never: bool = True) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(8, 3)
        if with_never:
            self.never = nn.Linear(8, 3)

    def forward(self, x, use_a: bool = True, use_b: bool = True):
        h = torch.tanh(self.trunk(x))
        out = h[:, :3]
        if use_a:
            out = out + self.a(h)
        if use_b:
            out = out + torch.tanh(self.b(h))
        return out


def branchy(seed: int, with_never: bool = True) -> Branchy:
    torch.manual_seed(seed)
    return Branchy(with_never).double()


def data(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(2, 6, generator=g, dtype=torch.float64),
            torch.randn(2, 3, generator=g, dtype=torch.float64))


def loss_fn(model, step, rank, flags):
    x, y = data(step, rank)
    return (model(x, *flags) - y).pow(2).mean()


def schedule(step: int, rank: int, world: int) -> tuple[bool, bool]:
    """(use_a, use_b) of ``rank`` at ``step``."""
    return [(True, True),                      # everything used
            (True, rank == 0),                 # b on rank 0 only
            (rank % 2 == 1, rank != 0),        # a on odd ranks, b on all but 0
            (True, False),                     # b unused everywhere
            (False, rank == world - 1)][step]  # a unused everywhere, b on the last rank


def unused_params(c, rank, world, group, backend):
    for view in (False, True):
        for mode in ("accumulate", "sgd"):
            what = f"unused {backend} view={view} {mode}"
            oracle, model = branchy(seed=4), branchy(seed=4 + rank)
            net = DDP(model, process_group=group, bucket_cap_mb=0.0002,
                      find_unused_parameters=True, gradient_as_bucket_view=view)
            opt, opt_o = sgd(net), sgd(oracle)
            for step in range(5):
                if mode == "sgd":
                    opt.zero_grad()
                    opt_o.zero_grad()
                # Oracle: the mean over ranks of each rank's loss with its own path.
                total = sum(loss_fn(oracle, step, r, schedule(step, r, world))
                            for r in range(world))
                (total / world).backward()
                loss_fn(net, step, rank, schedule(step, rank, world)).backward()
                compare_tensors(c, f"{what}: step {step} grads", grads(model), grads(oracle),
                                *F64)
                if mode == "sgd":
                    opt.step()
                    opt_o.step()
                    compare_tensors(c, f"{what}: step {step} params", params(model),
                                    params(oracle), *F64)
            c.check(model.never.weight.grad is None and model.never.bias.grad is None,
                    f"{what}: the never-used parameter got a gradient")
            same_on_all_ranks(c, f"{what}: params", list(model.parameters()), group)

            # Globally unused gradients are left exactly as they are, even when they
            # differ across ranks (they must not be averaged, nor rounded).
            mine = {n: torch.full_like(p, rank + 1.5) for n, p in model.b.named_parameters()}
            for n, p in model.b.named_parameters():
                if p.grad is None:
                    p.grad = mine[n].clone()
                else:
                    p.grad.copy_(mine[n])  # in place: with view=True it stays a bucket view
            loss_fn(net, 9, rank, (True, False)).backward()
            for n, p in model.b.named_parameters():
                c.check(torch.equal(p.grad, mine[n]),
                        f"{what}: globally unused b.{n}.grad changed from {rank + 1.5}")


def unused_with_no_sync(c, rank, world, group, backend):
    """A parameter used only inside no_sync, on one rank, must still be averaged."""
    for view in (False, True):
        what = f"unused + no_sync {backend} view={view}"
        oracle, model = branchy(seed=12), branchy(seed=12 + rank)
        net = DDP(model, process_group=group, bucket_cap_mb=0.0002,
                  find_unused_parameters=True, gradient_as_bucket_view=view)
        micro = [lambda r: (True, r == world - 1),  # b only on the last rank, in no_sync
                 lambda r: (True, False)]           # synchronized: b unused everywhere
        for m, flags in enumerate(micro):
            sum(loss_fn(oracle, 20 + m, r, flags(r)) for r in range(world)).div(world).backward()
            if m == 0:
                with net.no_sync():
                    loss_fn(net, 20 + m, rank, flags(rank)).backward()
            else:
                loss_fn(net, 20 + m, rank, flags(rank)).backward()
        compare_tensors(c, f"{what}: grads", grads(model), grads(oracle), *F64)
        same_on_all_ranks(c, f"{what}: b grads", grads_or_marker(model.b), group)


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.head_a, self.head_b = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return {"a": self.head_a(h), "b": self.head_b(h)}


def ignored_output(c, rank, world, group, backend):
    """head_b is reachable from the outputs, but the loss ignores output "b" on some
    ranks (then its hook never fires): it must count as unused there."""
    for view in (False, True):
        what = f"ignored output {backend} view={view}"
        torch.manual_seed(14)
        oracle = TwoHeads().double()
        model = TwoHeads().double()
        model.load_state_dict(oracle.state_dict())
        net = DDP(model, process_group=group, bucket_cap_mb=1e-6, find_unused_parameters=True,
                  gradient_as_bucket_view=view)

        def loss(m, step, r):
            x = torch.randn(2, 4, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(100 * step + r))
            out = m(x)
            uses_b = step == 0 and r == 0  # step 0: rank 0 only; step 1: nobody
            return out["a"].pow(2).sum() + (out["b"].pow(2).sum() if uses_b else 0)

        for step in range(2):
            sum(loss(oracle, step, r) for r in range(world)).div(world).backward()
            loss(net, step, rank).backward()
            compare_tensors(c, f"{what}: step {step} grads", grads(model), grads(oracle), *F64)


def used_outside_forward(c, rank, world, group, backend):
    """The loss uses a parameter directly, not through DDP's forward: it is unreachable
    from the outputs, so DDP marks it unused; when its gradient arrives anyway, DDP
    takes it if its bucket has not gone out yet, and raises a clear error otherwise."""
    for cap, bucket_already_sent in ((25, False), (0.0002, True)):
        what = f"used outside forward {backend} cap={cap}"
        oracle, model = branchy(seed=15), branchy(seed=15 + rank)
        net = DDP(model, process_group=group, bucket_cap_mb=cap, find_unused_parameters=True)
        sum(loss_fn(oracle, 0, r, (True, True)) + oracle.never.weight.sum()
            for r in range(world)).div(world).backward()
        try:
            (loss_fn(net, 0, rank, (True, True)) + model.never.weight.sum()).backward()
            c.check(not bucket_already_sent, f"{what}: no error")
            compare_tensors(c, f"{what}: grads", grads(model), grads(oracle), *F64)
        except RuntimeError as e:
            c.check(bucket_already_sent, f"{what}: unexpected error {e}")
            c.check("'never.weight'" in str(e) and "already reduced" in str(e),
                    f"{what}: unclear error: {e}")


def unused_without_flag(c, rank, world, group, backend):
    what = f"unused without find_unused_parameters {backend}"

    def expect_error(net, flags, param, should_raise, case):
        try:
            loss_fn(net, 0, rank, flags).backward()
            c.check(not should_raise, f"{what}: {case}: no error on rank {rank}")
        except RuntimeError as e:
            c.check(should_raise, f"{what}: {case}: unexpected error: {e}")
            msg = str(e)
            c.check(param in msg and "find_unused_parameters=True" in msg,
                    f"{what}: {case}: error does not name {param} and the fix: {msg}")

    # Unused on every rank: every rank raises.
    net = DDP(branchy(seed=8), process_group=group, bucket_cap_mb=0.0002)
    expect_error(net, (True, True), "never.weight", True, "globally unused")
    # Unused on rank 0 only: only rank 0 raises; the others must not hang.
    net = DDP(branchy(seed=8, with_never=False), process_group=group, bucket_cap_mb=0.0002)
    expect_error(net, (True, rank != 0), "b.weight", rank == 0, "unused on rank 0")
    # The group and the wrapper still work: a normal iteration matches the oracle.
    model, oracle = net.module, branchy(seed=8, with_never=False)
    oracle.load_state_dict(model.state_dict())
    net.zero_grad()
    sum(loss_fn(oracle, 1, r, (True, True)) for r in range(world)).div(world).backward()
    loss_fn(net, 1, rank, (True, True)).backward()
    compare_tensors(c, f"{what}: next iteration", grads(model), grads(oracle), *F64)


def overlap(c, rank, world, group, backend):
    """Event order, not time: each event appends to one list on the backward thread."""
    torch.manual_seed(2)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(32, 32), nn.Tanh()]
    model = nn.Sequential(*layers)
    # (32*32 + 32) float32 = 4224 B >= 4194 B cap: one layer per bucket, six buckets.
    net = DDP(model, process_group=group, bucket_cap_mb=0.004)
    events: list = []

    def recording_hook(state, bucket):
        events.append(("launch", bucket.index()))
        fut = ddp.allreduce_hook(state, bucket)
        return fut

    net.register_comm_hook(None, recording_hook)
    for name, p in model[0].named_parameters():  # after DDP's hooks: fires just after them
        p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(("first", name)))
    for it in range(2):  # the second iteration runs on rebuilt buckets
        events.clear()
        x = torch.randn(4, 32, requires_grad=True)
        x.register_hook(lambda g: events.append(("input_grad",)))
        net(x).sum().backward()
        events.append(("backward_returned",))
        launches = [e[1] for e in events if e[0] == "launch"]
        first_layer = min(i for i, e in enumerate(events) if e[0] == "first")
        what = f"overlap {backend} iteration {it}"
        c.check(launches == list(range(6)), f"{what}: launches {launches}, want 0..5 in order")
        c.check(events.index(("launch", 0)) < first_layer,
                f"{what}: bucket 0 was not launched before the first layer's gradients: {events}")
        # Every bucket but the one holding layer 0 goes out while backward still runs.
        c.check(events.index(("launch", 4)) < first_layer < events.index(("launch", 5)),
                f"{what}: launches not interleaved with backward: {events}")
        c.check(events.index(("launch", 0)) < events.index(("input_grad",)),
                f"{what}: bucket 0 launched after backward finished: {events}")


class TwoPath(nn.Module):
    """out = F(x) * G(x); the caller picks which path is computed first."""

    def __init__(self) -> None:
        super().__init__()
        self.f1, self.f2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.g1, self.g2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, f_first: bool):
        def f():
            return self.f2(torch.tanh(self.f1(x)))

        def g():
            return self.g2(torch.tanh(self.g1(x)))

        if f_first:
            a = f()
            b = g()
        else:
            b = g()
            a = f()
        return a * b


def rebuild(c, rank, world, group, backend):
    for cap in (1e-6, 0.0002):  # one parameter per bucket; two to three per bucket
        what = f"rebuild {backend} cap={cap}"
        torch.manual_seed(6)
        oracle = TwoPath().double()
        model = TwoPath().double()
        model.load_state_dict(oracle.state_dict())
        net = DDP(model, process_group=group, bucket_cap_mb=cap, gradient_as_bucket_view=True)
        n = len(list(model.parameters()))
        if cap == 1e-6:
            # Construction order: reverse registration, one parameter per bucket.
            c.check(net.reducer.bucket_assignment() == [[i] for i in reversed(range(n))],
                    f"{what}: initial buckets {net.reducer.bucket_assignment()}")
        seen: list[int] = []
        for i, p in enumerate(model.parameters()):
            p.register_post_accumulate_grad_hook(lambda p, i=i: seen.append(i))
        # Rank 0 computes path G first, so its backward reaches F's parameters first:
        # an order unlike the registration order, and unlike odd ranks' order.
        f_first = rank % 2 == 1
        for step in range(2):  # no zero_grad: gradients accumulate across the rebuild
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(3, 4, dtype=torch.float64, generator=gen)
            xs = [x + r for r in range(world)]
            sum(oracle(xs[r], r % 2 == 1).sum() for r in range(world)).div(world).backward()
            net(xs[rank], f_first).sum().backward()
            compare_tensors(c, f"{what}: step {step} grads", grads(model), grads(oracle), *F64)
            if step == 0:
                first_order = list(seen)
        orders = [torch.zeros(n, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(orders, torch.tensor(first_order), group=group)
        rank0_order = orders[0].tolist()
        flat = [i for b in net.reducer.bucket_assignment() for i in b]
        c.check(flat == rank0_order,
                f"{what}: rebuilt buckets {net.reducer.bucket_assignment()} do not follow "
                f"rank 0's gradient order {rank0_order}")
        if world > 1:
            c.check(orders[1].tolist() != rank0_order,
                    f"{what}: ranks 0 and 1 saw the same order; the test lost its point")
        if cap == 1e-6:
            c.check(rank0_order != list(reversed(range(n))),
                    f"{what}: rank 0's order equals reverse registration; test lost its point")
        layouts = [torch.zeros(n, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(layouts, torch.tensor(flat), group=group)
        c.check(all(torch.equal(t, layouts[0]) for t in layouts),
                f"{what}: bucket layouts differ across ranks: {[t.tolist() for t in layouts]}")
        # Bucket sizes also follow the cap from the rebuilt order: every bucket closed
        # at the first parameter that brought it to the cap (the last may stay short).
        cap_bytes = net.bucket_bytes_cap
        nbytes = [q.numel() * q.element_size() for q in model.parameters()]
        buckets = net.reducer.bucket_assignment()
        for k, b in enumerate(buckets):
            sizes = [nbytes[i] for i in b]
            full = sum(sizes) >= cap_bytes
            c.check(bool(b) and sum(sizes[:-1]) < cap_bytes and (full or k == len(buckets) - 1),
                    f"{what}: bucket {k} {b} holds {sizes} bytes against a cap of {cap_bytes}")
        c.check(sorted(i for b in buckets for i in b) == list(range(n)),
                f"{what}: buckets {buckets} do not hold every parameter once")


def main() -> None:
    rank, world, groups, c = init()
    for backend, group in groups.items():
        for fn in (unused_params, unused_with_no_sync, ignored_output, used_outside_forward,
                   unused_without_flag, overlap, rebuild):
            c.run(f"{fn.__name__} {backend}", fn, c, rank, world, group, backend)
    # An orderly teardown: leaving the groups to interpreter exit once ended in a C++
    # "terminate called without an active exception" after every check had passed.
    dist.barrier()
    dist.destroy_process_group()
    c.finish()


if __name__ == "__main__":
    main()
