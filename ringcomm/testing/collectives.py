"""Every collective of a group checked against a single-process oracle
(:func:`check_collectives`): each rank computes every rank's input, so each
knows the answer without asking the group it checks.
:mod:`ringcomm.testing` hands these names on."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

CHECK_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")
#: what every output buffer holds before the call (as mpi4py's tests fill theirs with
#: -1): no check's right result is 1000 below 250 ranks (inputs lie in [-4, 4];
#: products are powers of two), so an element the call never wrote shows
UNWRITTEN = 1000


def unwritten(*size: int, dtype: torch.dtype = torch.float32, **where) -> torch.Tensor:
    """An output buffer of ``size`` filled with :data:`UNWRITTEN` (the dtype's largest
    value where 1000 does not fit it)."""
    fill = UNWRITTEN
    if not dtype.is_floating_point and dtype != torch.bool and torch.iinfo(dtype).max < fill:
        fill = torch.iinfo(dtype).max
    return torch.full(size, fill if dtype != torch.bool else True, dtype=dtype, **where)


def unwritten_like(t: torch.Tensor) -> torch.Tensor:
    """:func:`unwritten` of ``t``'s shape, dtype and device."""
    return unwritten(*t.shape, dtype=t.dtype, device=t.device)


def case_input(rank: int, case: int, n: int, dtype: torch.dtype, op: str = "SUM") -> torch.Tensor:
    """Rank ``rank``'s input of check ``case``: small integers (powers of two for
    PRODUCT), so sums and products are exact in every dtype and any order."""
    g = torch.Generator().manual_seed(7919 * case + rank)
    if op == "PRODUCT":
        vals = torch.tensor([-2, -1, 1, 2])[torch.randint(0, 4, (n,), generator=g)]
    else:
        vals = torch.randint(-4, 5, (n,), generator=g)
    return vals.to(dtype)


def oracle(parts: list[torch.Tensor], op: str, premultiply: bool = False) -> torch.Tensor:
    """The reduction of ``parts`` in one process. AVG as torch's backends compute it:
    on NCCL (``premultiply``) each floating input times 1/n rounded to its type, then
    a sum (NCCL's ncclAvg); otherwise a sum, then a division (truncating integers)."""
    floating = parts[0].is_floating_point()
    if op == "AVG" and premultiply and floating:
        scale = torch.tensor(1.0 / len(parts), dtype=parts[0].dtype)
        parts = [x * scale for x in parts]
    acc = parts[0].clone()
    for x in parts[1:]:
        if op in ("SUM", "AVG"):
            acc.add_(x)
        elif op == "PRODUCT":
            acc.mul_(x)
        elif op == "MIN":
            torch.minimum(acc, x, out=acc)
        elif op == "MAX":
            torch.maximum(acc, x, out=acc)
    if op == "AVG" and not (premultiply and floating):
        acc = acc / len(parts) if floating else torch.div(acc, len(parts), rounding_mode="trunc")
    return acc


def check_collectives(pg: Any, device: torch.device | str, *,
                      dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16,
                                                       torch.float16, torch.int64),
                      reduce_ops: Sequence[str] = CHECK_OPS, numel: int = 37,
                      algorithms: dict[str, Sequence[str]] | None = None) -> int:
    """Run every collective with every algorithm of ``pg`` on ``device`` and compare
    with a single-process oracle (each rank knows every rank's input). Every rank
    must make the same call. Returns the number of checks.

    ``algorithms``: collective -> names to run (default: all registered). Where the
    transport lacks a collective of its own (``native``, ``shm_direct``), that it is
    refused is checked instead.

    Raises:
        AssertionError: listing every check whose result differed.
    """
    c = _Checks(pg, torch.device(device), dtypes, reduce_ops, numel, algorithms)
    # in this order on every rank: each check's inputs are numbered in turn
    for check in (c.allreduce, c.reduce_and_broadcast, c.allgather, c.reduce_scatter,
                  c.gather, c.scatter, c.alltoall, c.barrier, c.allreduce_coalesced):
        check()
    if c.failures:
        raise AssertionError(f"rank {c.me}: {len(c.failures)} of {c.checks} checks failed:\n  "
                             + "\n  ".join(c.failures))
    return c.checks


class _Checks:
    """One run of :func:`check_collectives`: a method per collective, and what they
    share (the numbered inputs, the comparison, the algorithm names, the call)."""

    def __init__(self, pg: Any, device: torch.device, dtypes: Sequence[torch.dtype],
                 reduce_ops: Sequence[str], numel: int,
                 algorithms: dict[str, Sequence[str]] | None):
        self.pg, self.device, self.dtypes, self.reduce_ops = pg, device, dtypes, reduce_ops
        self.numel, self.algorithms = numel, algorithms or {}
        self.p, self.me = pg.size(), pg.rank()
        self.failures: list[str] = []
        self.checks = self.case = 0
        self.on = {"device": device}  # fresh tensors; .to(device, copy=True) copies inputs
        # AVG on an NCCL lane premultiplies as NCCL does; the sums of those products
        # then depend on the order of addition, which differs between algorithms
        self.nccl_lane = device.type == getattr(pg.lanes, "nccl_type", "cuda")
        self.inexact_avg = self.nccl_lane and self.p & (self.p - 1) != 0

    # -- what every check uses ----------------------------------------------------
    def inputs(self, n: int, dtype: torch.dtype, op: str = "SUM") -> list[torch.Tensor]:
        """Every rank's input of the next case."""
        self.case += 1
        return [case_input(r, self.case, n, dtype, op) for r in range(self.p)]

    def mine(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device, copy=True)

    def expect(self, what: str, got: torch.Tensor, want: torch.Tensor,
               close: bool = False) -> None:
        self.checks += 1
        got = got.cpu()
        if close and got.shape == want.shape and got.is_floating_point():
            eps = torch.finfo(got.dtype).eps * self.p
            if torch.allclose(got.double(), want.double(), rtol=eps, atol=4 * eps):
                return
        if got.shape != want.shape or not torch.equal(got, want.to(got.dtype)):
            diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape \
                else f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
            self.failures.append(f"{what}: differs from the oracle (max |diff| {diff})")

    def names(self, coll: str) -> list[str]:
        from ringcomm.algorithms import REGISTRY

        chosen = self.algorithms.get(coll)
        return list(chosen) if chosen is not None else sorted(REGISTRY[coll])

    def run(self, what: str, coll: str, name: str, call: Callable[[], Any]) -> bool:
        """Run one call with ``name`` for ``coll``; False when the transport refused
        a collective of its own it lacks."""
        self.pg.set_algorithm(coll, name)
        try:
            call().wait()
        except ValueError as e:
            from ringcomm.algorithms import REGISTRY, is_schedule

            # a transport's own collective it does not have (native on NCCL for some
            # ops, shm_direct off one host): refused, on every rank alike
            if not is_schedule(REGISTRY[coll].get(name)) and (
                    name in str(e) or "NCCL has no" in str(e)):
                self.checks += 1  # refused before anything was enqueued, on every rank
                return False
            self.failures.append(f"{what}: {type(e).__name__}: {e}")
            return False
        finally:
            self.pg.set_algorithm(coll, "auto")
        return True

    def avg_close(self, op: str) -> bool:
        return op == "AVG" and self.inexact_avg

    # -- one method per collective ------------------------------------------------
    def allreduce(self) -> None:
        import torch.distributed as dist

        for name in self.names("allreduce"):
            for dtype in self.dtypes:
                for op in self.reduce_ops:
                    xs = self.inputs(self.numel, dtype, op)
                    t = self.mine(xs[self.me])
                    what = f"allreduce[{name}] {dtype} {op}"
                    o = dist.AllreduceOptions()
                    o.reduceOp = getattr(dist.ReduceOp, op)
                    if self.run(what, "allreduce", name, lambda: self.pg.allreduce([t], o)):
                        self.expect(what, t, oracle(xs, op, self.nccl_lane), self.avg_close(op))

    def reduce_and_broadcast(self) -> None:
        import torch.distributed as dist

        p, me = self.p, self.me
        for coll in ("reduce", "broadcast"):
            for name in self.names(coll):
                for dtype in self.dtypes:
                    for root in sorted({0, p - 1}):
                        xs = self.inputs(self.numel, dtype)
                        t = self.mine(xs[me])
                        if coll == "reduce":
                            o = dist.ReduceOptions()
                            o.reduceOp = dist.ReduceOp.SUM
                            want = oracle(xs, "SUM") if me == root else xs[me]
                        else:
                            o, want = dist.BroadcastOptions(), xs[root]
                        o.rootRank = root
                        what = f"{coll}[{name}] {dtype} root {root}"
                        method = getattr(self.pg, coll)
                        if self.run(what, coll, name, lambda: method([t], o)):
                            self.expect(what, t, want)

    def allgather(self) -> None:
        p, me, n, pg = self.p, self.me, self.numel, self.pg
        for name in self.names("allgather"):
            for dtype in self.dtypes:
                xs = self.inputs(n, dtype)
                outs = [unwritten(n, dtype=dtype, **self.on) for _ in range(p)]
                what = f"allgather[{name}] {dtype}"
                if self.run(what, "allgather", name,
                            lambda: pg.allgather([outs], [self.mine(xs[me])])):
                    self.expect(what, torch.stack(outs), torch.stack(xs))
                out = unwritten(p * n, dtype=dtype, **self.on)
                what = f"all_gather_into_tensor[{name}] {dtype}"
                if self.run(what, "allgather", name,
                            lambda: pg._allgather_base(out, self.mine(xs[me]))):
                    self.expect(what, out, torch.cat(xs))
            # uneven sizes: rank r contributes r + 1 elements
            xs = [case_input(r, 0, r + 1, torch.float32) for r in range(p)]
            outs = [unwritten(r + 1, **self.on) for r in range(p)]
            what = f"allgather[{name}] uneven"
            if self.run(what, "allgather", name,
                        lambda: pg.allgather([outs], [self.mine(xs[me])])):
                self.expect(what, torch.cat(outs), torch.cat(xs))

    def reduce_scatter(self) -> None:
        import torch.distributed as dist

        p, me, pg = self.p, self.me, self.pg
        for name in self.names("reduce_scatter"):
            for dtype in self.dtypes:
                for op in self.reduce_ops:
                    xs = self.inputs(self.numel * p, dtype, op)
                    full = oracle(xs, op, self.nccl_lane)
                    out = unwritten(self.numel, dtype=dtype, **self.on)
                    o = dist.ReduceScatterOptions()
                    o.reduceOp = getattr(dist.ReduceOp, op)
                    what = f"reduce_scatter_tensor[{name}] {dtype} {op}"
                    inp = self.mine(xs[me])
                    if self.run(what, "reduce_scatter", name,
                                lambda: pg._reduce_scatter_base(out, inp, o)):
                        self.expect(what, out, full.view(p, -1)[me], self.avg_close(op))
                        self.expect(what + " (input untouched)", inp, xs[me])
            xs = self.inputs(p * (p + 1) // 2, torch.float32)  # uneven: chunk r has r + 1
            chunks = [list(x.split([r + 1 for r in range(p)])) for x in xs]
            out = unwritten(me + 1, **self.on)
            what = f"reduce_scatter[{name}] uneven"
            if self.run(what, "reduce_scatter", name,
                        lambda: pg.reduce_scatter([out], [[self.mine(c) for c in chunks[me]]],
                                                  dist.ReduceScatterOptions())):
                self.expect(what, out, oracle([c[me] for c in chunks], "SUM"))

    def gather(self) -> None:
        import torch.distributed as dist

        p, me = self.p, self.me
        for name in self.names("gather"):
            xs = self.inputs(self.numel, torch.float32)
            root = p - 1
            outs = [unwritten(self.numel, **self.on) for _ in range(p)] if me == root else []
            o = dist.GatherOptions()
            o.rootRank = root
            what = f"gather[{name}]"
            if self.run(what, "gather", name,
                        lambda: self.pg.gather([outs] if outs else [], [self.mine(xs[me])], o)):
                if me == root:
                    self.expect(what, torch.stack(outs), torch.stack(xs))

    def scatter(self) -> None:
        import torch.distributed as dist

        p, me = self.p, self.me
        for name in self.names("scatter"):
            xs = self.inputs(self.numel * p, torch.float32)
            root = 0
            out = unwritten(self.numel, **self.on)
            o = dist.ScatterOptions()
            o.rootRank = root
            ins = [list(self.mine(x).view(p, -1).unbind(0)) for x in xs]
            what = f"scatter[{name}]"
            if self.run(what, "scatter", name,
                        lambda: self.pg.scatter([out], [ins[me]] if me == root else [], o)):
                self.expect(what, out, xs[root].view(p, -1)[me])

    def alltoall(self) -> None:
        import torch.distributed as dist

        p, me, pg = self.p, self.me, self.pg
        for name in self.names("alltoall"):
            xs = self.inputs(self.numel * p, torch.float32)
            want = torch.cat([x.view(p, -1)[me] for x in xs])
            out = unwritten(self.numel * p, **self.on)
            what = f"all_to_all_single[{name}]"
            if self.run(what, "alltoall", name,
                        lambda: pg.alltoall_base(out, self.mine(xs[me]), [], [],
                                                 dist.AllToAllOptions())):
                self.expect(what, out, want)
            outs = [unwritten(self.numel, **self.on) for _ in range(p)]
            what = f"all_to_all[{name}]"
            if self.run(what, "alltoall", name,
                        lambda: pg.alltoall(outs, list(self.mine(xs[me]).view(p, -1).unbind(0)),
                                            dist.AllToAllOptions())):
                self.expect(what, torch.cat(outs), want)

    def barrier(self) -> None:
        import torch.distributed as dist

        for name in self.names("barrier"):
            o = dist.BarrierOptions()
            o.device = self.device
            if self.run(f"barrier[{name}]", "barrier", name, lambda: self.pg.barrier(o)):
                self.checks += 1

    def allreduce_coalesced(self) -> None:
        xs, ys = self.inputs(self.numel, torch.float32), self.inputs(5, torch.int64)
        a, b = self.mine(xs[self.me]), self.mine(ys[self.me])
        what = "allreduce_coalesced"
        if self.run(what, "allreduce", "auto", lambda: self.pg.allreduce_coalesced([a, b])):
            self.expect(what, a, oracle(xs, "SUM"))
            self.expect(what, b, oracle(ys, "SUM"))
