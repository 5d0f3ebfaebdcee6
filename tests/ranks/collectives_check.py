"""Per-rank program: every algorithm x reduce op x dtype x size of allreduce, plus
broadcast (every root), allgather, barrier, async handles, non-contiguous tensors,
subgroups and bad input — against an independent single-process computation and
against torch's gloo backend.

Run under mpiexec or torchrun; exits non-zero listing every failed check.
"""
from __future__ import annotations

import functools
import operator
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm
from _common import Checker, done, run_checks
from ringcomm.testing.collectives import unwritten, unwritten_like

R = dist.ReduceOp
OPS = {"SUM": R.SUM, "AVG": R.AVG, "PRODUCT": R.PRODUCT, "MIN": R.MIN, "MAX": R.MAX,
       "BAND": R.BAND, "BOR": R.BOR, "BXOR": R.BXOR}
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
          torch.uint8, torch.int32, torch.int64, torch.bool]
BITWISE = {"BAND", "BOR", "BXOR"}


def valid(opname: str, dtype: torch.dtype) -> bool:
    if opname in BITWISE:
        return not dtype.is_floating_point
    if opname == "AVG":
        return dtype != torch.bool
    return True


def data(rank: int, n: int, dtype: torch.dtype, opname: str = "SUM",
         salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input, reproducible on every rank. Values keep every reduction
    exact in every dtype (no rounding, no overflow) so results compare bit for bit."""
    g = torch.Generator().manual_seed(1000003 * rank + 7919 * n + 31 * salt + len(opname))
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if opname == "PRODUCT":
        lo, hi = (1, 3) if dtype == torch.uint8 else (-1, 3)
        v = torch.randint(lo, hi, (n,), generator=g)
        v[v == 0] = 1
    elif opname in BITWISE:
        v = torch.randint(0, 120, (n,), generator=g)
    elif dtype == torch.uint8:
        v = torch.randint(0, 40, (n,), generator=g)
    else:
        v = torch.randint(-20, 21, (n,), generator=g)
    return v.to(dtype)


def oracle(inputs: list[torch.Tensor], opname: str) -> torch.Tensor:
    """Single-process reduction with torch reductions, independent of ringcomm.ops."""
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        s = torch.stack(inputs)
        if opname in ("SUM", "MAX", "BOR"):
            return s.any(0)
        if opname in ("PRODUCT", "MIN", "BAND"):
            return s.all(0)
        return functools.reduce(operator.xor, inputs)
    wide = torch.stack([t.to(torch.float64 if dtype.is_floating_point else torch.int64)
                        for t in inputs])
    if opname == "SUM":
        out = wide.sum(0)
    elif opname == "AVG":
        out = wide.sum(0) / len(inputs) if dtype.is_floating_point else \
            torch.div(wide.sum(0), len(inputs), rounding_mode="trunc")
    elif opname == "PRODUCT":
        out = wide.prod(0)
    elif opname == "MIN":
        out = wide.amin(0)
    elif opname == "MAX":
        out = wide.amax(0)
    else:
        out = functools.reduce({"BAND": operator.and_, "BOR": operator.or_,
                                "BXOR": operator.xor}[opname], list(wide))
    return out.to(dtype)


#: the built-in allreduce schedules (the algorithm library has library_check.py)
BUILTIN_ALLREDUCE = [a for a in ringcomm.REGISTRY["allreduce"]
                     if ("allreduce", a) in ringcomm.algorithms.BUILTIN]


def same(a, b) -> bool:
    """Bit for bit: dtype, shape and values (lists and tuples element by element)."""
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _refused(fn) -> str | None:
    """The message of the ValueError ``fn`` raises, None if it raises none."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


@dataclass
class Ctx:
    """What every check shares: this rank, the world size, the checker, a gloo group
    over the same ranks, and a ringcomm group with 64-byte segments."""
    rank: int
    p: int
    c: Checker
    gloo: object
    small_seg: object


def raises(c: Checker, what: str, exc, needle: str, fn, *args, **kw) -> None:
    """``fn`` raises ``exc`` with ``needle`` in its message (one check)."""
    try:
        fn(*args, **kw)
    except exc as e:
        c.case(what, e)
        c.check(needle.lower() in str(e).lower(), f"{what}: message {e!s:.200}")
    except Exception as e:  # noqa: BLE001
        c.check(False, f"{what}: raised {type(e).__name__}: {e!s:.200}")
    else:
        c.check(False, f"{what}: no error")


def check_world(ctx: Ctx) -> None:
    """The default group is ringcomm's."""
    ctx.c.check(isinstance(dist.group.WORLD, ringcomm.ProcessGroupRingcomm), "world is ringcomm")
    ctx.c.check(dist.get_backend() == "ringcomm", f"get_backend() = {dist.get_backend()}")


def _allreduce_sizes(p: int, gname: str, opname: str, dtype, extra: list[int]):
    """The sizes one op and dtype run at on one group, None for none.

    The op x dtype matrix runs in full at every size on the world group up to 3 ranks,
    and with tiny segments up to 2. Beyond that (oversubscribed ranks make every
    collective cost), an op and dtype change only the local reduction, not the
    schedule: every pair at one size of several chunks (the last sizes entry), SUM on
    three dtypes at every size."""
    sizes = [0, 1, max(p - 1, 1), 7, 1000] if p <= 3 else [0, 1, p - 1, 7, 301]
    full = p <= 2 or (gname == "world" and p <= 3)
    if full or (opname == "SUM" and dtype in (torch.float32, torch.bfloat16, torch.int64)):
        return sizes + extra
    return sizes[-1:] if gname == "world" else None


def _allreduce_exact(ctx: Ctx, group, gname: str, algo: str, opname: str, op, dtype,
                     ns: list[int]) -> None:
    """One op and dtype at the sizes ``ns``, bit for bit against the oracle."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    if algo == "native" and dtype == torch.bfloat16:  # MPI has no bfloat16
        try:
            dist.all_reduce(torch.ones(3, dtype=dtype), op=op, group=group)
            c.check(False, "native allreduce accepted bfloat16")
        except ValueError as e:
            c.check("native" in str(e) and "bfloat16" in str(e), str(e))
        return
    for n in ns:
        inputs = [data(i, n, dtype, opname) for i in range(p)]
        t = inputs[rank].clone()
        what = f"allreduce[{gname},{algo}] {opname} {dtype} n={n}"
        if c.run(what, dist.all_reduce, t, op=op, group=group) is None:
            c.check(same(t, oracle(inputs, opname)),
                    f"{what}: got {t[:6].tolist()} want "
                    f"{oracle(inputs, opname)[:6].tolist()}")


def _refused_here(ctx: Ctx, algo: str, group, collective: str = "allreduce") -> bool:
    """Whether the group's transport lacks ``algo`` as a collective of its own
    (shm_direct off one host, or without shared memory): then it is refused, naming
    itself, on every rank alike (``collective``: allreduce or broadcast, the one
    ``algo`` was set for)."""
    if algo != "shm_direct":
        return False
    try:
        if collective == "broadcast":
            dist.broadcast(torch.ones(3), src=0, group=group)
        else:
            dist.all_reduce(torch.ones(3), group=group)
        return False
    except ValueError as e:
        ctx.c.check("shm_direct" in str(e) and "one host" in str(e), str(e))
        return True


def check_allreduce_matrix(ctx: Ctx) -> None:
    """allreduce: algorithm x op x dtype x size, exact, on the world group and with
    tiny segments."""
    for group, gname, extra in ((None, "world", [5000]), (ctx.small_seg, "seg64", [300])):
        for algo in ("auto", *BUILTIN_ALLREDUCE):
            ringcomm.set_algorithm("allreduce", algo, group=group)
            if _refused_here(ctx, algo, group):
                continue
            for opname, op in OPS.items():
                for dtype in DTYPES:
                    if not valid(opname, dtype):
                        continue
                    ns = _allreduce_sizes(ctx.p, gname, opname, dtype, extra)
                    if ns is not None:
                        _allreduce_exact(ctx, group, gname, algo, opname, op, dtype, ns)
        ringcomm.set_algorithm("allreduce", "auto", group=group)


def _allreduce_random_vs_gloo(ctx: Ctx, algo: str) -> None:
    """Random floats against gloo (rounding differs: a tolerance)."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        for n in (1, 999, 70001):
            g = torch.Generator().manual_seed(ctx.rank * 17 + n)
            x = torch.randn(n, generator=g, dtype=dtype)
            ours, ref = x.clone(), x.clone()
            dist.all_reduce(ours)
            dist.all_reduce(ref, group=ctx.gloo)
            ctx.c.check(torch.allclose(ours, ref, rtol=tol, atol=tol),
                        f"allreduce[{algo}] {dtype} n={n} vs gloo: max diff "
                        f"{(ours - ref).abs().max().item() if n else 0}")


def _allreduce_exact_vs_gloo(ctx: Ctx, algo: str) -> None:
    """Exactly equal to gloo where gloo supports the op/dtype (exact values)."""
    for opname in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8,
                      torch.int8, torch.float16, torch.bfloat16):
            if not valid(opname, dtype):
                continue
            x = data(ctx.rank, 513, dtype, opname, salt=1)
            ref = x.clone()
            try:
                dist.all_reduce(ref, op=OPS[opname], group=ctx.gloo)
            except RuntimeError:
                continue  # gloo lacks this op/dtype pair; the local oracle covered it
            if algo == "native" and dtype == torch.bfloat16:
                continue  # refused: checked in check_allreduce_matrix
            ours = x.clone()
            dist.all_reduce(ours, op=OPS[opname])
            ctx.c.check(same(ours, ref), f"allreduce[{algo}] {opname} {dtype} != gloo")


def check_allreduce_vs_gloo(ctx: Ctx) -> None:
    """Every built-in allreduce against gloo: random floats, and exact values."""
    for algo in BUILTIN_ALLREDUCE:
        ringcomm.set_algorithm("allreduce", algo)
        if _refused_here(ctx, algo, None):
            continue
        _allreduce_random_vs_gloo(ctx, algo)
        _allreduce_exact_vs_gloo(ctx, algo)
    ringcomm.set_algorithm("allreduce", "auto")


def check_broadcast(ctx: Ctx) -> None:
    """broadcast: every root, every algorithm, both groups; and as gloo's."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    for group, gname in ((None, "world"), (ctx.small_seg, "seg64")):
        for algo in ("auto", *ringcomm.REGISTRY["broadcast"]):
            ringcomm.set_algorithm("broadcast", algo, group=group)
            if _refused_here(ctx, algo, group, "broadcast"):
                continue
            for root in range(p):
                for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8):
                    for n in (0, 1, 7, 2000):
                        want = data(root, n, dtype, "SUM", salt=2)
                        t = want.clone() if rank == root else unwritten(n, dtype=dtype)
                        what = f"broadcast[{algo}] on {gname} root={root} {dtype} n={n}"
                        if c.run(what, dist.broadcast, t, src=root, group=group) is None:
                            c.check(same(t, want), what)
            ringcomm.set_algorithm("broadcast", "auto", group=group)
    # matches gloo
    x = torch.randn(333, generator=torch.Generator().manual_seed(rank))
    a, b = x.clone(), x.clone()
    dist.broadcast(a, src=p - 1)
    dist.broadcast(b, src=p - 1, group=ctx.gloo)
    c.check(same(a, b), "broadcast != gloo")


def check_allgather(ctx: Ctx) -> None:
    """allgather: dtypes and sizes on both groups, 2-D against gloo, uneven sizes."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    for group, gname in ((None, "world"), (ctx.small_seg, "seg64")):
        for dtype in (torch.float32, torch.float16, torch.int8, torch.bool, torch.int64):
            for n in (0, 1, 5, 1500):
                inputs = [data(i, n, dtype, "SUM", salt=3) for i in range(p)]
                outs = [unwritten(n, dtype=dtype) for _ in range(p)]
                what = f"allgather on {gname} {dtype} n={n}"
                if c.run(what, dist.all_gather, outs, inputs[rank], group=group) is None:
                    c.check(all(same(o, w) for o, w in zip(outs, inputs)), what)
    # 2-D tensors, against gloo
    x = torch.arange(12, dtype=torch.float32).view(3, 4) + 100 * rank
    ours = [unwritten(3, 4) for _ in range(p)]
    ref = [unwritten(3, 4) for _ in range(p)]
    dist.all_gather(ours, x)
    dist.all_gather(ref, x, group=ctx.gloo)
    c.check(all(same(a, b) for a, b in zip(ours, ref)), "allgather 2-D != gloo")
    # uneven sizes: rank i contributes i+1 elements
    inputs = [torch.full((i + 1,), float(i)) for i in range(p)]
    outs = [unwritten(i + 1) for i in range(p)]
    if c.run("allgather uneven", dist.all_gather, outs, inputs[rank]) is None:
        c.check(all(same(o, w) for o, w in zip(outs, inputs)), "allgather uneven values")


def _coalesced_inputs(r: int) -> list[torch.Tensor]:
    return [torch.full((2, 2), r + 1.0), torch.full((1,), 10.0 * r), unwritten(0),
            torch.arange(3.0) + r]


def check_all_gather_coalesced(ctx: Ctx) -> None:
    """all_gather_coalesced, laid out as torch documents it (outputs[rank][input]):
    different shapes, an empty tensor, against gloo and the known inputs."""
    c, p = ctx.c, ctx.p
    mine = _coalesced_inputs(ctx.rank)
    ours = [[unwritten_like(x) for x in mine] for _ in range(p)]
    ref = [[unwritten_like(x) for x in mine] for _ in range(p)]
    if c.run("all_gather_coalesced", dist.all_gather_coalesced, ours, mine) is None:
        dist.all_gather_coalesced(ref, mine, group=ctx.gloo)
        for r in range(p):
            for i, want in enumerate(_coalesced_inputs(r)):
                c.check(same(ours[r][i], want) and same(ours[r][i], ref[r][i]),
                        f"all_gather_coalesced: rank {r} input {i}: got {ours[r][i].tolist()}, "
                        f"want {want.tolist()}, gloo {ref[r][i].tolist()}")
    raises(c, "all_gather_coalesced with a list too many", ValueError, "one per rank",
           dist.all_gather_coalesced, [[unwritten(3), unwritten(2)]] * (p + 1),
           [torch.ones(3), torch.ones(2)])


def check_non_contiguous(ctx: Ctx) -> None:
    """Non-contiguous tensors are handled in place."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    base = torch.arange(40, dtype=torch.float32).view(5, 8) * (rank + 1)
    view = base[:, ::2]
    before_odd = base[:, 1::2].clone()
    dist.all_reduce(view)
    want = torch.arange(40, dtype=torch.float32).view(5, 8)[:, ::2] * (p * (p + 1) // 2)
    c.check(same(view, want), "allreduce of a strided view")
    c.check(same(base[:, 1::2], before_odd), "allreduce of a view touched other elements")
    bview = torch.zeros(4, 6)[:, 1:4] if rank else (torch.arange(24.).view(4, 6))[:, 1:4]
    dist.broadcast(bview, src=0)
    c.check(same(bview, torch.arange(24.).view(4, 6)[:, 1:4]), "broadcast of a strided view")


def check_async_handles(ctx: Ctx) -> None:
    """Async handles: out-of-order waits, a sync call behind them, futures, state."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    ts = [torch.full((1000 * (i + 1),), float(rank + i)) for i in range(6)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    sync_t = torch.ones(10)
    dist.all_reduce(sync_t)  # a sync call queued behind async ones keeps the order
    for i in reversed(range(len(works))):
        works[i].wait()
        c.check(same(ts[i], torch.full_like(ts[i], float(sum(range(p)) + p * i))),
                f"async allreduce {i}")
    c.check(same(sync_t, torch.full((10,), float(p))), "sync allreduce after async ones")
    fut_t = torch.ones(3)
    fut = dist.all_reduce(fut_t, async_op=True).get_future()
    val = fut.wait()
    c.check(isinstance(val, list) and same(val[0], torch.full((3,), float(p))),
            f"future value {val}")
    w = dist.all_reduce(torch.ones(2), async_op=True)
    w.wait()
    c.check(w.is_completed() and w.is_success() and w.exception() is None, "work state")


def check_wait_in_callback(ctx: Ctx) -> None:
    """Waiting inside a future callback must never deadlock and must give the right
    result, as on gloo. A callback attached to a finished collective runs at once on
    the caller's thread; one attached while the collective still waits for a late
    rank runs on the lane's progress thread (rank 0 comes late: the first case; the
    others: the second). A collective issued there runs at once: a wait on its Work,
    or on its future as torch's PowerSGD hook does, returns."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    seen = {}
    t2, t3 = torch.ones(2), torch.ones(3)

    def callback(fut):
        w = dist.all_reduce(t2, async_op=True)
        w.wait()
        seen["waited"] = True
        seen["future"] = dist.all_reduce(t3, async_op=True).get_future().wait()
        return fut.value()

    if rank == 0:
        time.sleep(0.5)
    work = dist.all_reduce(torch.ones(4), async_op=True)
    if rank == 0:
        work.wait()
    work.get_future().then(callback).wait()
    c.check(seen.get("waited") is True, f"wait in a callback: {seen}")
    c.check(same(t2, torch.full((2,), float(p))), "collective issued in a callback")
    c.check(isinstance(seen.get("future"), list) and same(seen["future"][0],
                                                         torch.full((3,), float(p))),
            f"future of a collective issued in a callback: {seen}")


def check_callback_waits_for_later(ctx: Ctx) -> None:
    """A callback that waits for a collective issued *after* its own (queued behind it
    on the lane), on the Work and on a torch future (which ringcomm cannot see): the
    lane passes to a new progress thread, and both complete."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    for how in ("work", "future"):
        later: dict = {}
        ready = threading.Event()
        t5 = torch.ones(5)

        def waits_for_later(fut, how=how, later=later, ready=ready):
            # on rank 0 the collective may be done before the callback is attached: it
            # then runs on this (the main) thread, where there is nothing to wait for
            if threading.current_thread() is not threading.main_thread() and ready.wait(20):
                w = later["w"]
                w.wait() if how == "work" else w.get_future().wait()
                later["done"] = w.is_completed()
            return fut.value()

        if rank == 0:
            time.sleep(0.3)
        first = dist.all_reduce(torch.ones(2), async_op=True)
        f1 = first.get_future().then(waits_for_later)
        later["w"] = dist.all_reduce(t5, async_op=True)
        ready.set()
        f1.wait()
        later["w"].wait()
        c.check(later.get("done", rank == 0) is True and same(t5, torch.full((5,), float(p))),
                f"callback waiting ({how}) for a later collective: {later}")


def check_barrier_device_ids(ctx: Ctx) -> None:
    """Accelerate's wait_for_everyone passes device_ids on every barrier: without CUDA
    and CuPy, gloo reads them as no device at all, and so does ringcomm."""
    if not torch.cuda.is_available():
        ctx.c.run("barrier(device_ids=[0]) on a CPU-only torch", dist.barrier, device_ids=[0])


def _prepared_calls(ctx: Ctx, algo: str) -> None:
    c, rank, p = ctx.c, ctx.rank, ctx.p
    base = torch.full((12,), float(rank))
    dist.all_reduce(base)  # prepares the shape
    total = float(sum(range(p)))
    variants = {
        "a new tensor": torch.full((12,), float(rank)),
        "another shape, same numel": torch.full((3, 4), float(rank)),
        "non-contiguous": torch.full((4, 3), float(rank)).t(),
        "another size": torch.full((13,), float(rank)),
        "another dtype": torch.full((12,), float(rank), dtype=torch.float64),
    }
    for what, x in variants.items():
        dist.all_reduce(x)
        c.check(same(x, torch.full(x.shape, total, dtype=x.dtype)),
                f"allreduce[{algo}] after a prepared call, {what}: {x.flatten()[:4].tolist()}")
    bad = c.run(f"allreduce[{algo}] of a meta tensor after a prepared CPU one",
                lambda: _refused(lambda: dist.all_reduce(unwritten(12, device="meta"))))
    c.check(bad is not None and "meta" in bad, f"meta tensor after a prepared call: {bad}")
    a, b = torch.full((12,), float(rank)), torch.full((12,), 2.0 * rank)
    w1, w2 = dist.all_reduce(a, async_op=True), dist.all_reduce(b, async_op=True)
    w3 = dist.all_reduce(a, async_op=True)  # the same tensor again, still in flight
    for w in (w1, w2, w3):
        w.wait()
    c.check(same(a, torch.full((12,), total * p)) and same(b, torch.full((12,), 2 * total)),
            f"allreduce[{algo}]: two calls of one shape in flight: {a[:2]} {b[:2]}")


def check_prepared_calls(ctx: Ctx) -> None:
    """Prepared calls: a repeated call of a shape runs only on what it was made for
    (a new tensor of the shape, or one that differs in contiguity, size, dtype or
    device, gets the right result or the first call's error), and two calls of one
    shape in flight at once do not share what the first still holds."""
    for algo in BUILTIN_ALLREDUCE:
        ringcomm.set_algorithm("allreduce", algo)
        if not _refused_here(ctx, algo, None):
            _prepared_calls(ctx, algo)
    ringcomm.set_algorithm("allreduce", "auto")


def check_barrier(ctx: Ctx) -> None:
    """barrier: nobody leaves before everybody arrived."""
    rank, p = ctx.rank, ctx.p
    store = dist.distributed_c10d._get_default_store()
    store.set(f"arrived/{rank}", "1")
    # TCPStore's set does not wait for the server; a get on the same connection does,
    # so the key is visible to every rank before this one enters the barrier.
    store.get(f"arrived/{rank}")
    dist.barrier()
    ctx.c.check(store.check([f"arrived/{i}" for i in range(p)]), "barrier returned early")
    dist.barrier(async_op=True).wait()


def check_subgroups(ctx: Ctx) -> None:
    """Subgroups: odd ranks, a group without rank 0, a singleton."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    odd = list(range(1, p, 2)) or [0]
    g_odd = dist.new_group(odd, backend="ringcomm")
    g_tail = dist.new_group(list(range(1, p)) or [0], backend="ringcomm")
    for g, members in ((g_odd, odd), (g_tail, list(range(1, p)) or [0])):
        if rank in members:
            for algo in BUILTIN_ALLREDUCE:
                ringcomm.set_algorithm("allreduce", algo, group=g)
                if _refused_here(ctx, algo, g):
                    continue
                t = torch.full((17,), float(rank))
                dist.all_reduce(t, group=g)
                c.check(same(t, torch.full((17,), float(sum(members)))),
                        f"subgroup {members} allreduce[{algo}]")
            t = torch.full((4,), float(rank))
            dist.broadcast(t, src=members[-1], group=g)
            c.check(same(t, torch.full((4,), float(members[-1]))), f"subgroup {members} bcast")
            c.check(dist.get_rank(g) == members.index(rank), "group rank")


def check_bad_input(ctx: Ctx) -> None:
    """Bad input: a clear error on the calling rank, the group stays usable."""
    c, p = ctx.c, ctx.p
    bad = (ValueError, RuntimeError)
    raises(c, "BAND on float", bad, "BAND", dist.all_reduce, torch.ones(3), op=R.BAND)
    raises(c, "AVG on bool", bad, "AVG", dist.all_reduce,
           torch.ones(3, dtype=torch.bool), op=R.AVG)
    raises(c, "complex MAX", bad, "MAX on complex", dist.all_reduce,
           torch.ones(3, dtype=torch.complex64), op=R.MAX)
    raises(c, "meta tensor", bad, "meta", dist.all_reduce, unwritten(3, device="meta"))
    raises(c, "sparse tensor", bad, "only dense tensors", dist.all_reduce,
           torch.ones(3).to_sparse())
    raises(c, "broadcast root out of range", bad, "out of range", dist.broadcast,
           torch.ones(3), src=p + 3)
    raises(c, "allgather list too long", bad, "expected one per rank", dist.all_gather,
           [unwritten(3)] * (p + 1), torch.ones(3))
    raises(c, "allgather dtype mismatch", bad, "dtype", dist.all_gather,
           [unwritten(3, dtype=torch.float64) for _ in range(p)], torch.ones(3))
    raises(c, "unknown algorithm", ValueError, "ring", ringcomm.set_algorithm, "allreduce",
           "nope")
    # the group still works after refused calls
    t = torch.ones(5)
    dist.all_reduce(t)
    c.check(same(t, torch.full((5,), float(p))), "allreduce after refused calls")
    # complex SUM works (torch views it as real)
    z = torch.full((3,), complex(1, ctx.rank), dtype=torch.complex64)
    dist.all_reduce(z)
    c.check(same(z, torch.full((3,), complex(p, sum(range(p))), dtype=torch.complex64)),
            "complex SUM")


#: run in this order on every rank (the ranks must issue the same collectives)
CHECKS = [check_world, check_allreduce_matrix, check_allreduce_vs_gloo, check_broadcast,
          check_allgather, check_all_gather_coalesced, check_non_contiguous,
          check_async_handles, check_wait_in_callback, check_callback_waits_for_later,
          check_barrier_device_ids, check_prepared_calls, check_barrier, check_subgroups,
          check_bad_input]


def main() -> None:
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    # A second ringcomm group over the same ranks with tiny segments, so modest sizes
    # exercise the pipelining (many segments per chunk, the receive window wrapping).
    small_seg = dist.new_group(backend="ringcomm",
                               pg_options=ringcomm.Options(segment_bytes=64))
    ctx = Ctx(rank, dist.get_world_size(), Checker(rank), gloo, small_seg)
    run_checks(CHECKS, ctx)
    done(ctx.c)


if __name__ == "__main__":
    sys.exit(main())
