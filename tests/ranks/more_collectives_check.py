"""Per-rank program: the rest of torch.distributed on ringcomm, against gloo as
the oracle (same call, same inputs, on a gloo group over the same ranks):
reduce, all_gather_into_tensor, reduce_scatter(_tensor), all_to_all(_single),
gather, scatter (every root), send/recv (tags, out of order, any source,
batch_isend_irecv rings), object collectives, coalesced calls, functional
collectives, and bad input; on ``RINGCOMM_TRANSPORT``'s transport (native's checks
only on MPI's).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm
from ringcomm import settings
from _common import Checker, done, run_checks
from ringcomm.testing.collectives import unwritten

R = dist.ReduceOp


def same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def data(seed: int, shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-9, 10, shape, generator=g).to(dtype)


@dataclass
class Ctx:
    """What every check shares: this rank, the world size, the checker, and a gloo
    group over the same ranks."""
    rank: int
    p: int
    c: Checker
    gloo: object


def both(ctx: Ctx, what: str, fn, make, oracle=None) -> None:
    """Run fn(args, group) on ringcomm and on gloo with equal fresh args; compare.
    Where this torch's gloo lacks the collective (2.11's has no all_to_all),
    compare with ``oracle()``, the result computed in one process."""
    c = ctx.c
    ours, ref = make(), make()
    if c.run(f"{what} (ringcomm)", fn, ours, None) is not None:
        return
    c.count += 1  # the gloo call, a check of its own
    try:
        fn(ref, ctx.gloo)
    except RuntimeError as e:
        if oracle is None or "does not support" not in str(e):
            raise
        ref = oracle()
    c.check(same(ours, ref), f"{what}: ringcomm != gloo")


def check_reduce(ctx: Ctx) -> None:
    """reduce: every root, several ops and dtypes; non-roots keep their input (ours)."""
    c, rank = ctx.c, ctx.rank
    for root in range(ctx.p):
        for op in (R.SUM, R.MAX, R.MIN, R.PRODUCT):
            for dtype in (torch.float32, torch.int64, torch.bfloat16):
                for n in (1, 5, 3000):
                    x = data(rank * 7 + n, (n,), dtype)
                    if op == R.PRODUCT:  # keep products exact in bfloat16, whatever the order
                        x = x.clamp(-2, 2)
                    ours, ref = x.clone(), x.clone()
                    dist.reduce(ours, dst=root, op=op)
                    try:
                        dist.reduce(ref, dst=root, op=op, group=ctx.gloo)
                    except RuntimeError:
                        continue
                    if rank == root:
                        c.check(same(ours, ref), f"reduce root={root} {op} {dtype} n={n}")
                    else:
                        c.check(same(ours, x), f"reduce changed a non-root input ({op} {dtype})")


def _reduce_scatter_tensor(ctx: Ctx, dtype, n: int) -> None:
    """reduce_scatter_tensor SUM and MAX against one process (torch 2.7's gloo sums
    here whatever the op), and its input left as it was."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    big = data(rank * 3 + n, (p * n,), dtype)
    every = torch.stack([data(q * 3 + n, (p * n,), dtype) for q in range(p)])
    for op in (R.SUM, R.MAX):
        out = unwritten(n, dtype=dtype)
        want = (every.sum(0) if op == R.SUM else every.amax(0)).to(dtype)
        if c.run(f"reduce_scatter_tensor {op} {dtype} n={n}",
                 dist.reduce_scatter_tensor, out, big.clone(), op=op) is None:
            c.count += 1  # as many checks as against gloo
            c.check(same(out, want[rank * n:(rank + 1) * n]),
                    f"reduce_scatter_tensor {op} {dtype} n={n}: ringcomm != one process")
    inp = big.clone()
    out = unwritten(n, dtype=dtype)
    dist.reduce_scatter_tensor(out, inp)
    c.check(same(inp, big), "reduce_scatter_tensor modified its input")


def check_gather_into_and_reduce_scatter_tensor(ctx: Ctx) -> None:
    """all_gather_into_tensor and reduce_scatter_tensor (FSDP's pair)."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    for dtype in (torch.float32, torch.float16, torch.int32, torch.bool):
        for n in (0, 1, 7, 2049):
            x = data(rank + n, (n,), dtype)
            both(ctx, f"all_gather_into_tensor {dtype} n={n}",
                 lambda a, g: dist.all_gather_into_tensor(a[0], a[1], group=g),
                 lambda: [unwritten(p * n, dtype=dtype), x.clone()])
            out2 = unwritten(p, n, dtype=dtype)  # gloo takes only a flat output here
            dist.all_gather_into_tensor(out2, x)
            c.check(same(out2, torch.stack([data(q + n, (n,), dtype) for q in range(p)])),
                    f"all_gather_into_tensor 2-D {dtype} n={n}")
            if dtype != torch.bool:
                _reduce_scatter_tensor(ctx, dtype, n)


def check_strided_gather_and_avg(ctx: Ctx) -> None:
    """all_gather_into_tensor of a strided 1-D input; reduce_scatter_tensor AVG (gloo
    lacks it): against the SUM result divided."""
    rank, p = ctx.rank, ctx.p
    both(ctx, "all_gather_into_tensor strided input",
         lambda a, g: dist.all_gather_into_tensor(a[0], a[1], group=g),
         lambda: [unwritten(p * 5), (torch.arange(10, dtype=torch.float32) + 10 * rank)[::2]])
    big = data(rank, (p * 6,), torch.float64)
    a, s = unwritten(6, dtype=torch.float64), unwritten(6, dtype=torch.float64)
    dist.reduce_scatter_tensor(a, big.clone(), op=R.AVG)
    dist.reduce_scatter_tensor(s, big.clone(), op=R.SUM, group=ctx.gloo)
    ctx.c.check(torch.allclose(a, s / p), "reduce_scatter_tensor AVG")


def check_reduce_scatter_list(ctx: Ctx) -> None:
    """reduce_scatter with a list (uneven blocks allowed)."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    for n in (0, 3, 1000):
        ins = [data(rank * 11 + i + n, (n + i,)) for i in range(p)]
        out = unwritten(n + rank)
        if c.run(f"reduce_scatter n={n}", dist.reduce_scatter, out, [x.clone() for x in ins]) is None:
            want = sum(data(q * 11 + rank + n, (n + rank,)) for q in range(p))
            c.check(same(out, want), f"reduce_scatter n={n}")


def check_all_to_all(ctx: Ctx) -> None:
    """all_to_all_single: equal splits, uneven splits with zeros, 2-D rows; all_to_all
    with lists of different and of equal sizes."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    for n in (0, 2, 500):
        x = data(rank * 5 + n, (p * n,))
        both(ctx, f"all_to_all_single equal n={n}",
             lambda a, g: dist.all_to_all_single(a[0], a[1], group=g),
             lambda: [unwritten(p * n), x.clone()])
    in_splits = [(rank + j) % 3 for j in range(p)]  # rank sends (rank+j)%3 rows to j
    out_splits = [(j + rank) % 3 for j in range(p)]  # rank receives (j+rank)%3 rows from j
    x = data(rank, (sum(in_splits), 4))
    both(ctx, "all_to_all_single uneven",
         lambda a, g: dist.all_to_all_single(a[0], a[1], out_splits, in_splits, group=g),
         lambda: [unwritten(sum(out_splits), 4), x.clone()])
    # all_to_all with tensor lists of different sizes
    ins = [data(rank * 13 + j, (rank + j + 1,)) for j in range(p)]
    outs = [unwritten(j + rank + 1) for j in range(p)]  # gloo needs equal sizes: oracle
    if c.run("all_to_all lists", dist.all_to_all, outs, [t.clone() for t in ins]) is None:
        c.check(same(outs, [data(j * 13 + rank, (j + rank + 1,)) for j in range(p)]),
                "all_to_all lists of uneven sizes")
    x = [data(rank * 7 + j, (5,)) for j in range(p)]
    both(ctx, "all_to_all equal lists",
         lambda a, g: dist.all_to_all(a[0], a[1], group=g),
         lambda: [[unwritten(5) for _ in range(p)], [t.clone() for t in x]],
         oracle=lambda: [[data(j * 7 + rank, (5,)) for j in range(p)], [t.clone() for t in x]])


def check_gather_scatter(ctx: Ctx) -> None:
    """gather / scatter: every root."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    for root in range(p):
        for n in (0, 1, 999):
            x = data(rank * 17 + n, (n,))
            outs = [unwritten(n) for _ in range(p)] if rank == root else None
            if c.run(f"gather root={root} n={n}", dist.gather, x, outs, dst=root) is None \
                    and rank == root:
                c.check(same(outs, [data(q * 17 + n, (n,)) for q in range(p)]),
                        f"gather root={root} n={n}")
            chunks = [data(root * 100 + q + n, (n,)) for q in range(p)]
            out = unwritten(n)
            if c.run(f"scatter root={root} n={n}", dist.scatter, out,
                     chunks if rank == root else None, src=root) is None:
                c.check(same(out, chunks[rank]), f"scatter root={root} n={n}")


def check_native_gather_scatter(ctx: Ctx) -> None:
    """native (MPI's own) gather/scatter where the root's list is views of one tensor
    and its own slot is its input/output (MPI forbids aliased buffers: in place)."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    if settings.get("RINGCOMM_TRANSPORT") != "mpi":
        return  # a transport without collectives of its own refuses native by name
    for coll in ("gather", "scatter"):
        ringcomm.set_algorithm(coll, "native")
    for root in range(p):
        whole = torch.arange(3.0 * p) + 100 * root
        slots = list(whole.view(p, 3).unbind(0))
        mine = slots[root] if rank == root else slots[rank].clone()
        if c.run(f"native gather root={root}", dist.gather, mine,
                 slots if rank == root else None, dst=root) is None:
            c.check(rank != root or torch.equal(whole, torch.arange(3.0 * p) + 100 * root),
                    f"native gather root={root}: {whole.tolist()}")
        mine = slots[rank] if rank == root else unwritten(3)
        if c.run(f"native scatter root={root}", dist.scatter, mine,
                 slots if rank == root else None, src=root) is None:
            c.check(torch.equal(mine, torch.arange(3.0) + 3 * rank + 100 * root),
                    f"native scatter root={root}: {mine.tolist()}")
    for coll in ("gather", "scatter"):
        ringcomm.set_algorithm(coll, "auto")


# send/recv (the next five checks; nothing to do on one rank): tags, out-of-order
# receives, any source, rings of large isends

def check_tagged_p2p(ctx: Ctx) -> None:
    """Tagged isends received out of order, and a batch_isend_irecv ring, of messages
    above any eager limit."""
    if ctx.p == 1:
        return
    c, rank, p = ctx.c, ctx.rank, ctx.p
    right, left = (rank + 1) % p, (rank - 1) % p
    big = 1 << 20  # 4 MiB each: above any eager limit
    sends = [dist.isend(torch.full((big,), float(rank * 10 + k)), right, tag=k)
             for k in range(3)]
    bufs = [unwritten(big) for _ in range(3)]
    recvs = [dist.irecv(bufs[k], left, tag=k) for k in (2, 0, 1)]  # posted out of order
    for w in sends + recvs:
        w.wait()
    c.check(all(torch.all(bufs[k] == left * 10 + k) for k in range(3)), "tagged isend/irecv")
    ops_ = [dist.P2POp(dist.isend, torch.full((big,), float(rank)), right),
            dist.P2POp(dist.irecv, unwritten(big), left)]
    for w in dist.batch_isend_irecv(ops_):
        w.wait()
    c.check(torch.all(ops_[1].tensor == left), "batch_isend_irecv ring")


def check_any_source(ctx: Ctx) -> None:
    """recv from any source; a large any-source receive posted before a collective
    completes while this rank is inside the collective (the sender is blocked until it
    is matched); several pending any-source receives, each driven by its own future's
    thread."""
    if ctx.p == 1:
        return
    c, rank, p = ctx.c, ctx.rank, ctx.p
    if rank == 0:
        got = {}
        for _ in range(p - 1):
            t = unwritten(2)
            src = dist.recv(t)  # any source
            got[src] = t[0].item()
        c.check(got == {q: float(q) for q in range(1, p)}, f"recv any source: {got}")
    else:
        dist.send(torch.full((2,), float(rank)), 0)
    if rank == 0:
        buf = torch.zeros(1 << 18)
        w = dist.irecv(buf, tag=6)
        dist.barrier()
        w.wait()
        c.check(torch.all(buf == 1.0).item(), "large any-source receive across a barrier")
    else:
        if rank == 1:
            dist.send(torch.ones(1 << 18), 0, tag=6)
        dist.barrier()
    if rank == 0:
        bufs = [torch.zeros(4) for _ in range(p - 1) for _ in range(2)]
        futs = [dist.irecv(b, tag=8).get_future() for b in bufs]
        for f in futs:
            c.run("any-source receive future", f.wait)
        c.check(sorted(b[0].item() for b in bufs) == sorted(
            [float(q) for q in range(1, p)] * 2), "any-source futures got every message")
    else:
        for _ in range(2):
            dist.send(torch.full((4,), float(rank)), 0, tag=8)


def check_any_source_every_root(ctx: Ctx) -> None:
    """Every rank in turn receives twice from any source while the others each send to
    it twice (posted any-source receives once never matched under torchrun)."""
    if ctx.p == 1:
        return
    c, rank, p = ctx.c, ctx.rank, ctx.p
    for root in range(p):
        if rank == root:
            srcs = []
            for _ in range(2 * (p - 1)):
                t = unwritten(3)
                srcs.append(dist.recv(t, tag=5))
                c.check(torch.all(t == srcs[-1]), f"any-source payload from {srcs[-1]}")
            c.check(sorted(srcs) == sorted([q for q in range(p) if q != root] * 2),
                    f"any-source senders at root {root}: {srcs}")
        else:
            for _ in range(2):
                dist.send(torch.full((3,), float(rank)), root, tag=5)


def check_strided_recv(ctx: Ctx) -> None:
    """A non-contiguous receive buffer."""
    if ctx.p == 1:
        return
    rank, p = ctx.rank, ctx.p
    if rank == 0:
        m = torch.zeros(4, 6)
        dist.recv(m[:, ::2], src=p - 1, tag=9)
        ctx.c.check(torch.equal(m[:, ::2], torch.arange(12.).view(4, 3)) and
                    torch.all(m[:, 1::2] == 0), "recv into a strided view")
    elif rank == p - 1:
        dist.send(torch.arange(12.).view(4, 3).t().contiguous().t(), 0, tag=9)


def check_p2p_futures(ctx: Ctx) -> None:
    """Futures and wait() on the same messages, many times (one thread may test an MPI
    request at a time); an irecv's future."""
    if ctx.p == 1:
        return
    c, rank = ctx.c, ctx.rank
    for k in range(20):
        if rank == 0:
            w = dist.isend(torch.full((1000,), float(k)), 1, tag=20)
        elif rank == 1:
            buf = unwritten(1000)
            w = dist.irecv(buf, 0, tag=20)
        else:
            continue
        f = w.get_future()
        w.wait()
        f.wait()
        if rank == 1:
            c.check(torch.all(buf == k), f"irecv {k} with future and wait")
    fut_t = unwritten(3)
    if rank == 0:
        dist.send(torch.ones(3), (rank + 1) % ctx.p, tag=4)
    if rank == 1:
        fut = dist.irecv(fut_t, 0, tag=4).get_future()
        fut.wait()
        c.check(torch.all(fut_t == 1), "irecv future")


def check_object_collectives(ctx: Ctx) -> None:
    """all_gather_object, broadcast_object_list, gather_object, scatter_object_list."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    objs = [None] * p
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    c.check(objs == [{"rank": q, "s": "x" * q} for q in range(p)], f"all_gather_object {objs}")
    lst = [rank, "hello"] if rank == p - 1 else [None, None]
    dist.broadcast_object_list(lst, src=p - 1)
    c.check(lst == [p - 1, "hello"], "broadcast_object_list")
    gathered = [None] * p if rank == 0 else None
    dist.gather_object(("r", rank), gathered, dst=0)
    if rank == 0:
        c.check(gathered == [("r", q) for q in range(p)], "gather_object")
    out = [None]
    dist.scatter_object_list(out, [q * q for q in range(p)] if rank == 0 else None, src=0)
    c.check(out[0] == rank * rank, "scatter_object_list")


def check_coalesced(ctx: Ctx) -> None:
    """all_reduce_coalesced, and all_gather_into_tensor under a coalescing manager."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    ts = [torch.full((3,), float(rank)), torch.full((5,), 2.0 * rank), torch.ones(2, 2)]
    if c.run("all_reduce_coalesced", dist.all_reduce_coalesced, ts) is None:
        c.check(same(ts[0], torch.full((3,), float(sum(range(p))))) and
                same(ts[1], torch.full((5,), 2.0 * sum(range(p)))) and
                same(ts[2], torch.full((2, 2), float(p))), "all_reduce_coalesced")
    outs_ = [unwritten(p * 4), unwritten(p * 2)]
    ins_ = [torch.full((4,), float(rank)), torch.full((2,), -float(rank))]

    def coalesced_gather():
        with dist._coalescing_manager(async_ops=True) as cm:
            for o, i in zip(outs_, ins_):
                dist.all_gather_into_tensor(o, i)
        cm.wait()

    if c.run("coalesced all_gather_into_tensor", coalesced_gather) is None:
        c.check(same(outs_[0], torch.arange(p).float().repeat_interleave(4)),
                "coalesced all_gather_into_tensor: first output")
        c.check(same(outs_[1], -torch.arange(p).float().repeat_interleave(2)),
                "coalesced all_gather_into_tensor: second output")


def check_functional(ctx: Ctx) -> None:
    """Functional collectives (what torch.compile and DTensor use), against gloo; with
    ``--compile``, dist.all_reduce under torch.compile."""
    import torch.distributed._functional_collectives as fc

    c, rank, p = ctx.c, ctx.rank, ctx.p

    def functional(name, fn, x):
        ours = c.run(f"fc.{name}", lambda: fc.wait_tensor(fn(x.clone(), dist.group.WORLD)))
        ref = fc.wait_tensor(fn(x.clone(), ctx.gloo))
        if ours is not None:
            c.check(same(ours, ref), f"fc.{name} != gloo")

    x = data(rank, (p * 3,))
    functional("all_reduce", lambda t, g: fc.all_reduce(t, "sum", g), x)
    functional("all_gather_tensor", lambda t, g: fc.all_gather_tensor(t, 0, g), x)
    functional("reduce_scatter_tensor", lambda t, g: fc.reduce_scatter_tensor(t, "sum", 0, g), x)
    functional("broadcast", lambda t, g: fc.broadcast(t, p - 1, g), x)
    functional("all_to_all_single", lambda t, g: fc.all_to_all_single(t, None, None, g), x)
    if "--compile" in sys.argv:
        def step(t):
            dist.all_reduce(t)
            return t * 2
        y = c.run("torch.compile(dist.all_reduce)", torch.compile(step), torch.full((3,), 1.0 + rank))
        if y is not None:
            c.check(same(y, torch.full((3,), 2.0 * sum(1.0 + q for q in range(p)))),
                    f"compiled all_reduce: {y}")


def raises(c: Checker, what, needle, fn, *args, **kw) -> None:
    """``fn`` raises a ValueError, RuntimeError or TypeError naming ``needle``."""
    try:
        fn(*args, **kw)
    except (ValueError, RuntimeError, TypeError) as e:
        c.case(what, e)
        c.check(needle.lower() in str(e).lower(), f"{what}: message {str(e)[:200]}")
    else:
        c.check(False, f"{what}: no error")


def check_bad_input(ctx: Ctx) -> None:
    """Bad input: clear errors, group still usable."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    raises(c, "gather root out of range", "out of range", dist.gather, torch.ones(2), None,
           dst=p + 1)
    raises(c, "all_to_all_single bad splits", "split", dist.all_to_all_single,
           unwritten(p), unwritten(p), [p + 1] + [0] * (p - 1), [1] * p)
    raises(c, "reduce_scatter_tensor wrong size", "elements", dist.reduce_scatter_tensor,
           unwritten(3), unwritten(3 * p + 1))
    raises(c, "all_gather_into_tensor wrong size", "world size x input",
           dist.all_gather_into_tensor,
           unwritten(3 * p + 2), unwritten(3))
    raises(c, "send to self", "same as the rank of the current process", dist.send,
           torch.ones(1), rank)
    # torch refuses that one itself; ringcomm's own check, called directly:
    raises(c, "send to self (ringcomm)", "cannot send to/from itself",
           dist.group.WORLD.send, [torch.ones(1)], rank, 0)
    t = torch.ones(4)
    dist.all_reduce(t)
    c.check(same(t, torch.full((4,), float(p))), "usable after refused calls")


#: run in this order on every rank (the ranks must issue the same collectives)
CHECKS = [check_reduce, check_gather_into_and_reduce_scatter_tensor,
          check_strided_gather_and_avg, check_reduce_scatter_list, check_all_to_all,
          check_gather_scatter, check_native_gather_scatter, check_tagged_p2p,
          check_any_source, check_any_source_every_root, check_strided_recv,
          check_p2p_futures, check_object_collectives, check_coalesced, check_functional,
          check_bad_input]


def main() -> None:
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    ctx = Ctx(rank, dist.get_world_size(), Checker(rank), dist.new_group(backend="gloo"))
    run_checks(CHECKS, ctx)
    done(ctx.c)


if __name__ == "__main__":
    sys.exit(main())
