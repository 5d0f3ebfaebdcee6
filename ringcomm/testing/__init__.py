"""Run algorithms on in-process ranks, for developing and testing them: no MPI, no
launcher, any world size.

* :func:`run_schedule` runs a schedule builder with either executor: the
  point-to-point one over threads (as on MPI) or the grouped one under the
  NCCL-rules simulator (as on NCCL)::

      from ringcomm.testing import run_schedule
      bufs = [[torch.arange(10.0)] for _ in range(4)]          # per rank, per buffer
      run_schedule(ring.allreduce, "allreduce", 4, (10,), bufs, executor="nccl-sim")

* :func:`run_ranks` calls any function with a point-to-point transport per rank.
* :func:`nccl_groups` runs process groups whose CPU tensors take the NCCL path,
  over :class:`~ringcomm.testing.fake_nccl.FakeNccl` (also importable from here).
* :func:`check_collectives` checks every collective of a group against a
  single-process oracle.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

from ringcomm import ops
from ringcomm.schedule import Context
from ringcomm.execution.checker import local_layout
from ringcomm.execution.executors import GroupProgram, P2PProgram
from ringcomm.execution.plan import Plan
from ringcomm.execution.simulator import SimFabric
from ringcomm.testing.fake_nccl import FakeNccl
from ringcomm.testing.local import LocalFabric
from ringcomm.transport.base import Transport

EXECUTORS = ("threads", "nccl-sim")


def run_ranks(size: int, fn: Callable[[Transport], Any], timeout_s: float = 30.0,
              transports: Sequence[Transport] | None = None) -> list[Any]:
    """Call ``fn(transport)`` on ``size`` threads, one per rank; return their results
    in rank order. The transports are a new :class:`LocalFabric`'s, or ``transports``
    (one per rank, kept by the caller from run to run, as programs bound to them
    need).

    Raises:
        RuntimeError: some rank raised (the first error is chained) or did not finish
            within ``timeout_s``.
    """
    if transports is None:
        fabric = LocalFabric(size)
        transports = [fabric.transport(r) for r in range(size)]

    def body(rank: int) -> Any:
        tp = transports[rank]
        tp.begin(timeout_s)
        try:
            return fn(tp)
        finally:
            tp.end()

    return _on_threads("run_ranks", size, body, timeout_s)


def _on_threads(what: str, size: int, body: Callable[[int], Any], timeout_s: float) -> list:
    """``body(rank)`` on ``size`` threads; the results in rank order, or the lowest
    rank's error."""
    results: list[Any] = [None] * size
    errors: list[tuple[int, BaseException]] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as e:  # noqa: BLE001
            errors.append((rank, e))

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"{what}: ranks still running after {timeout_s}s")
    if errors:
        rank, err = min(errors, key=lambda e: e[0])
        raise RuntimeError(f"{what}: rank {rank} failed: {type(err).__name__}: {err}") from err
    return results


def run_schedule(build: Callable, collective: str, size: int, layout: tuple,
                 bufs: Sequence[Sequence[torch.Tensor | None]], *, op=ops.SUM, root: int = 0,
                 seg: int = 1 << 30, executor: str = "threads",
                 timeout_s: float = 30.0, hosts: tuple = ()) -> None:
    """Run schedule builder ``build`` for ``collective`` on ``size`` in-process ranks.

    Args:
        layout: the global layout (as :func:`ringcomm.execution.checker.check` takes it).
        bufs: per rank, the caller's 1-D buffers in the collective's order
            (``ringcomm.schedule.BUFFERS``); results are written into them.
        op: the reduce op (a ``ReduceOp.RedOpType``) of reducing collectives.
        seg: elements per pipeline segment.
        executor: ``"threads"`` (point-to-point, as on MPI) or ``"nccl-sim"`` (one
            group per step under NCCL's rules, as on NCCL).
        hosts: the host of every rank (:class:`ringcomm.schedule.Context`); empty: one host.
    Raises:
        RuntimeError: a rank failed or timed out (threads).
        ringcomm.execution.simulator.SimulatorError: the schedule cannot complete under NCCL's rules.
    """
    plans = [Plan(build(Context(collective, size, r, local_layout(collective, layout, r, root),
                                root, seg, tuple(hosts)))) for r in range(size)]

    def scratch(r: int) -> list[torch.Tensor]:
        dtype = next((b.dtype for b in bufs[r] if b is not None), torch.uint8)
        return [torch.empty(n, dtype=dtype) for n in plans[r].scratch]

    if executor == "nccl-sim":
        fabric = SimFabric(size)
        for r in range(size):
            GroupProgram(plans[r], fabric.comm(r), scratch(r), op).run(bufs[r])
        fabric.drain()
    elif executor == "threads":
        run_ranks(size, lambda tp: P2PProgram(plans[tp.rank], tp, scratch(tp.rank), op).run(
            bufs[tp.rank]), timeout_s)
    else:
        raise ValueError(f"run_schedule: executor must be one of {EXECUTORS}, got {executor!r}")


def nccl_groups(size: int, fn: Callable[[Any], Any], *, lib: FakeNccl | None = None,
                timeout_s: float = 30.0, options: Any = None) -> list[Any]:
    """Call ``fn(pg)`` on ``size`` threads, each with a ringcomm process group whose
    CPU tensors run over the NCCL path with :class:`FakeNccl` (communicators set up
    through a shared in-process store); return the results in rank order.

    Raises:
        RuntimeError: some rank raised (the first error is chained) or did not finish.
    """
    from datetime import timedelta

    import torch.distributed as dist

    from ringcomm.front.process_group import ProcessGroupRingcomm

    lib = lib or FakeNccl()
    store = dist.HashStore()

    def body(rank: int) -> Any:
        pg = ProcessGroupRingcomm(rank, size, None, timedelta(seconds=timeout_s), options,
                                  "fake-nccl", store=store, cpu_error="not used",
                                  nccl=lib, nccl_device_type="cpu")
        try:
            return fn(pg)
        finally:
            pg.shutdown()

    return _on_threads("nccl_groups", size, body, timeout_s)


# -- every collective against a single-process oracle ---------------------------------

#: reduce ops checked by default, by name
CHECK_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")


def _case_input(rank: int, case: int, n: int, dtype: torch.dtype, op: str = "SUM") -> torch.Tensor:
    """Rank ``rank``'s input of check ``case``: small integers (powers of two for
    PRODUCT), so sums and products are exact in every dtype and any order."""
    g = torch.Generator().manual_seed(7919 * case + rank)
    if op == "PRODUCT":
        vals = torch.tensor([-2, -1, 1, 2])[torch.randint(0, 4, (n,), generator=g)]
    else:
        vals = torch.randint(-4, 5, (n,), generator=g)
    return vals.to(dtype)


def _oracle(parts: list[torch.Tensor], op: str, premultiply: bool = False) -> torch.Tensor:
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
    transport has no ``native`` collective, that it is refused is checked instead.

    Raises:
        AssertionError: listing every check whose result differed.
    """
    import torch.distributed as dist

    from ringcomm.algorithms import REGISTRY

    device = torch.device(device)
    p, me = pg.size(), pg.rank()
    failures: list[str] = []
    counter = [0, 0]  # checks, case number
    # AVG on an NCCL lane premultiplies as NCCL does; the sums of those products then
    # depend on the order of addition, which differs from algorithm to algorithm
    nccl_lane = device.type == getattr(pg.lanes, "nccl_type", "cuda")
    inexact_avg = nccl_lane and p & (p - 1) != 0

    def inputs(n: int, dtype: torch.dtype, op: str = "SUM") -> list[torch.Tensor]:
        counter[1] += 1
        return [_case_input(r, counter[1], n, dtype, op) for r in range(p)]

    def expect(what: str, got: torch.Tensor, want: torch.Tensor, close: bool = False) -> None:
        counter[0] += 1
        got = got.cpu()
        if close and got.shape == want.shape and got.is_floating_point():
            eps = torch.finfo(got.dtype).eps * p
            if torch.allclose(got.double(), want.double(), rtol=eps, atol=4 * eps):
                return
        if got.shape != want.shape or not torch.equal(got, want.to(got.dtype)):
            diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape \
                else f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
            failures.append(f"{what}: differs from the oracle (max |diff| {diff})")

    def names(coll: str) -> list[str]:
        chosen = (algorithms or {}).get(coll)
        return list(chosen) if chosen is not None else sorted(REGISTRY[coll])

    def run(what: str, coll: str, name: str, call: Callable[[], Any]) -> bool:
        """Run one call with ``name`` for ``coll``; False when native was refused."""
        pg.set_algorithm(coll, name)
        try:
            call().wait()
        except ValueError as e:
            if name == "native" and ("native" in str(e) or "NCCL has no" in str(e)):
                counter[0] += 1  # refused before anything was enqueued, on every rank
                return False
            failures.append(f"{what}: {type(e).__name__}: {e}")
            return False
        finally:
            pg.set_algorithm(coll, "auto")
        return True

    on = {"device": device}  # fresh tensors; .to(device, copy=True) for copies of inputs
    for name in names("allreduce"):
        for dtype in dtypes:
            for op in reduce_ops:
                xs = inputs(numel, dtype, op)
                t = xs[me].to(device, copy=True)
                what = f"allreduce[{name}] {dtype} {op}"
                o = dist.AllreduceOptions()
                o.reduceOp = getattr(dist.ReduceOp, op)
                if run(what, "allreduce", name, lambda: pg.allreduce([t], o)):
                    expect(what, t, _oracle(xs, op, nccl_lane), op == "AVG" and inexact_avg)
    for coll in ("reduce", "broadcast"):
        for name in names(coll):
            for dtype in dtypes:
                for root in sorted({0, p - 1}):
                    xs = inputs(numel, dtype)
                    t = xs[me].to(device, copy=True)
                    if coll == "reduce":
                        o = dist.ReduceOptions()
                        o.reduceOp = dist.ReduceOp.SUM
                        want = _oracle(xs, "SUM") if me == root else xs[me]
                    else:
                        o, want = dist.BroadcastOptions(), xs[root]
                    o.rootRank = root
                    what = f"{coll}[{name}] {dtype} root {root}"
                    method = getattr(pg, coll)
                    if run(what, coll, name, lambda: method([t], o)):
                        expect(what, t, want)
    for name in names("allgather"):
        for dtype in dtypes:
            xs = inputs(numel, dtype)
            outs = [torch.empty(numel, dtype=dtype, **on) for _ in range(p)]
            what = f"allgather[{name}] {dtype}"
            if run(what, "allgather", name,
                   lambda: pg.allgather([outs], [xs[me].to(device, copy=True)])):
                expect(what, torch.stack(outs), torch.stack(xs))
            out = torch.empty(p * numel, dtype=dtype, **on)
            what = f"all_gather_into_tensor[{name}] {dtype}"
            if run(what, "allgather", name, lambda: pg._allgather_base(out, xs[me].to(device, copy=True))):
                expect(what, out, torch.cat(xs))
        # uneven sizes: rank r contributes r + 1 elements
        xs = [_case_input(r, 0, r + 1, torch.float32) for r in range(p)]
        outs = [torch.empty(r + 1, **on) for r in range(p)]
        what = f"allgather[{name}] uneven"
        if run(what, "allgather", name, lambda: pg.allgather([outs], [xs[me].to(device, copy=True)])):
            expect(what, torch.cat(outs), torch.cat(xs))
    for name in names("reduce_scatter"):
        for dtype in dtypes:
            for op in reduce_ops:
                xs = inputs(numel * p, dtype, op)
                full = _oracle(xs, op, nccl_lane)
                out = torch.empty(numel, dtype=dtype, **on)
                o = dist.ReduceScatterOptions()
                o.reduceOp = getattr(dist.ReduceOp, op)
                what = f"reduce_scatter_tensor[{name}] {dtype} {op}"
                inp = xs[me].to(device, copy=True)
                if run(what, "reduce_scatter", name, lambda: pg._reduce_scatter_base(out, inp, o)):
                    expect(what, out, full.view(p, -1)[me], op == "AVG" and inexact_avg)
                    expect(what + " (input untouched)", inp, xs[me])
        xs = inputs(p * (p + 1) // 2, torch.float32)  # uneven: chunk r has r + 1 elements
        chunks = [list(x.split([r + 1 for r in range(p)])) for x in xs]
        out = torch.empty(me + 1, **on)
        what = f"reduce_scatter[{name}] uneven"
        if run(what, "reduce_scatter", name,
               lambda: pg.reduce_scatter([out], [[c.to(device, copy=True) for c in chunks[me]]],
                                         dist.ReduceScatterOptions())):
            expect(what, out, _oracle([c[me] for c in chunks], "SUM"))
    for name in names("gather"):
        xs = inputs(numel, torch.float32)
        root = p - 1
        outs = [torch.empty(numel, **on) for _ in range(p)] if me == root else []
        o = dist.GatherOptions()
        o.rootRank = root
        what = f"gather[{name}]"
        if run(what, "gather", name, lambda: pg.gather([outs] if outs else [],
                                                       [xs[me].to(device, copy=True)], o)):
            if me == root:
                expect(what, torch.stack(outs), torch.stack(xs))
    for name in names("scatter"):
        xs = inputs(numel * p, torch.float32)
        root = 0
        out = torch.empty(numel, **on)
        o = dist.ScatterOptions()
        o.rootRank = root
        ins = [list(x.to(device, copy=True).view(p, -1).unbind(0)) for x in xs]
        what = f"scatter[{name}]"
        if run(what, "scatter", name,
               lambda: pg.scatter([out], [ins[me]] if me == root else [], o)):
            expect(what, out, xs[root].view(p, -1)[me])
    for name in names("alltoall"):
        xs = inputs(numel * p, torch.float32)
        out = torch.empty(numel * p, **on)
        what = f"all_to_all_single[{name}]"
        if run(what, "alltoall", name,
               lambda: pg.alltoall_base(out, xs[me].to(device, copy=True), [], [], dist.AllToAllOptions())):
            expect(what, out, torch.cat([x.view(p, -1)[me] for x in xs]))
        outs = [torch.empty(numel, **on) for _ in range(p)]
        what = f"all_to_all[{name}]"
        if run(what, "alltoall", name,
               lambda: pg.alltoall(outs, list(xs[me].to(device, copy=True).view(p, -1).unbind(0)),
                                   dist.AllToAllOptions())):
            expect(what, torch.cat(outs), torch.cat([x.view(p, -1)[me] for x in xs]))
    for name in names("barrier"):
        o = dist.BarrierOptions()
        o.device = device
        if run(f"barrier[{name}]", "barrier", name, lambda: pg.barrier(o)):
            counter[0] += 1
    xs, ys = inputs(numel, torch.float32), inputs(5, torch.int64)
    a, b = xs[me].to(device, copy=True), ys[me].to(device, copy=True)
    what = "allreduce_coalesced"
    if run(what, "allreduce", "auto", lambda: pg.allreduce_coalesced([a, b])):
        expect(what, a, _oracle(xs, "SUM"))
        expect(what, b, _oracle(ys, "SUM"))
    if failures:
        raise AssertionError(f"rank {me}: {len(failures)} of {counter[0]} checks failed:\n  "
                             + "\n  ".join(failures))
    return counter[0]
