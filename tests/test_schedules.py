"""Every built-in schedule, three ways: proved by the checker (world sizes 1-9, 12 and 16),
run under the NCCL-rules simulator and on in-process point-to-point ranks (world
sizes 1-8), at 1, 2, 5 and 17 segments per chunk, with even, uneven and empty
chunks, against a single-process computation."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from ringcomm.execution import checker
from ringcomm import ops
from ringcomm.algorithms import BUILTIN as SHIPPED
from ringcomm.algorithms import REGISTRY, common, is_schedule
from ringcomm.execution.executors import GroupProgram, P2PProgram
from ringcomm.execution.plan import Plan
from ringcomm.execution.simulator import SimFabric
from ringcomm.schedule import Context
from ringcomm.testing import run_ranks, run_schedule
from ringcomm.testing.local import LocalFabric, LocalTransport

# the built-in schedules; the algorithm library (registered like a user's) has
# tests/test_library.py
BUILTIN = sorted((c, n) for c, algos in REGISTRY.items() for n, b in algos.items()
                 if is_schedule(b) and (c, n) in SHIPPED)
DEPTHS = (1, 2, 5, 17)


def ids(pairs):
    return [f"{c}-{n}" for c, n in pairs]


@pytest.mark.parametrize("collective,name", BUILTIN, ids=ids(BUILTIN))
def test_checker_proves_every_builtin(collective, name):
    build = REGISTRY[collective][name]
    n = 0
    for p in (*range(1, 10), 12, 16):  # every shape of fold up to 9, and larger powers of 2
        # rooted collectives: every root up to 5 ranks, then the first, one inside, the last
        roots = range(p) if p <= 5 else sorted({0, p // 2, p - 1})
        for k in DEPTHS:
            for layout, seg in checker.shapes(collective, p, k):
                for root in roots if collective in checker.ROOTED else [0]:
                    checker.check(build, collective, p, layout, root=root, seg=seg)
                    n += 1
    assert n >= 40  # at least one shape per world size and depth


def _inputs(collective: str, p: int, layout, root: int, seed: int):
    """Per rank: the caller's buffers, and what each must hold afterwards (None: any)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(n):
        return torch.randint(-50, 50, (n,), generator=g, dtype=torch.int64)

    def junk(n):
        return torch.full((n,), -7777, dtype=torch.int64)

    bufs, want = [], []
    if collective in ("allreduce", "broadcast", "reduce"):
        xs = [rnd(layout[0]) for _ in range(p)]
        total = torch.stack(xs).sum(0) if p else None
        for r in range(p):
            bufs.append([xs[r].clone()])
            if collective == "allreduce":
                want.append([total])
            elif collective == "broadcast":
                want.append([xs[root]])
            else:
                want.append([total if r == root else None])
    elif collective == "allgather":
        xs = [rnd(n) for n in layout]
        for r in range(p):
            bufs.append([junk(n) for n in layout] + [xs[r].clone()])
            want.append(list(xs) + [None])
    elif collective == "reduce_scatter":
        blocks = [[rnd(n) for n in layout] for _ in range(p)]
        for r in range(p):
            bufs.append([b.clone() for b in blocks[r]] + [junk(layout[r])])
            want.append([None] * p + [sum(blocks[q][r] for q in range(p))])
    elif collective in ("gather", "scatter"):
        xs = [rnd(n) for n in layout]
        for r in range(p):
            if collective == "gather":
                chunks = [junk(n) for n in layout] if r == root else [None] * p
                bufs.append(chunks + [xs[r].clone()])
                want.append((list(xs) if r == root else [None] * p) + [None])
            else:
                chunks = [x.clone() for x in xs] if r == root else [None] * p
                bufs.append(chunks + [junk(layout[r])])
                want.append([None] * p + [xs[r]])
    elif collective == "alltoall":
        sent = [[rnd(layout[i][j]) for j in range(p)] for i in range(p)]
        for r in range(p):
            bufs.append([s.clone() for s in sent[r]] + [junk(layout[i][r]) for i in range(p)])
            want.append([None] * p + [sent[i][r] for i in range(p)])
    elif collective == "barrier":
        for r in range(p):
            bufs.append([torch.ones(1, dtype=torch.int64)])
            want.append([None])
    return bufs, want


@pytest.mark.parametrize("executor", ["threads", "nccl-sim", "events"])
@pytest.mark.parametrize("collective,name", BUILTIN, ids=ids(BUILTIN))
def test_runs_match_single_process(collective, name, executor):
    build = REGISTRY[collective][name]
    runs = 0
    for p in range(1, 9):
        for k in DEPTHS:
            for layout, seg in checker.shapes(collective, p, k):
                roots = sorted({0, p - 1}) if collective in checker.ROOTED else [0]
                for root in roots:
                    bufs, want = _inputs(collective, p, layout, root, seed=p * 1000 + k)
                    run_schedule(build, collective, p, layout, bufs, root=root, seg=seg,
                                 executor=executor, timeout_s=20)
                    for r in range(p):
                        for b, w in enumerate(want[r]):
                            if w is not None:
                                assert torch.equal(bufs[r][b], w), (p, k, layout, root, r, b)
                    runs += 1
    assert runs >= 32


@pytest.mark.parametrize("executor", ["threads", "nccl-sim", "events"])
@pytest.mark.parametrize("op", [ops.MAX, ops.MIN, ops.PRODUCT, ops.BXOR])
def test_reduce_ops(op, executor):
    p = 5
    xs = [torch.randint(1, 4, (50,), generator=torch.Generator().manual_seed(r)) for r in range(p)]
    wide = torch.stack(xs)
    want = {ops.MAX: wide.amax(0), ops.MIN: wide.amin(0), ops.PRODUCT: wide.prod(0),
            ops.BXOR: xs[0] ^ xs[1] ^ xs[2] ^ xs[3] ^ xs[4]}[op]
    for name in REGISTRY["allreduce"]:
        if not is_schedule(REGISTRY["allreduce"][name]):
            continue
        bufs = [[x.clone()] for x in xs]
        run_schedule(REGISTRY["allreduce"][name], "allreduce", p, (50,), bufs, op=op, seg=4,
                     executor=executor)
        assert all(torch.equal(b[0], want) for b in bufs), (name, op)


def test_bf16_and_fp16_bit_identical_on_every_rank():
    for dtype in (torch.bfloat16, torch.float16):
        xs = [torch.randint(-50, 50, (77,), generator=torch.Generator().manual_seed(r))
              .to(dtype) for r in range(5)]
        want = torch.stack([x.double() for x in xs]).sum(0).to(dtype)
        for name, build in REGISTRY["allreduce"].items():
            if not is_schedule(build):
                continue
            bufs = [[x.clone()] for x in xs]
            run_schedule(build, "allreduce", 5, (77,), bufs, seg=16)
            assert all(torch.equal(b[0], want) for b in bufs), (dtype, name)


def test_barrier_waits_for_everyone():
    for p in range(1, 9):
        arrived = []
        lock = threading.Lock()
        plans = [Plan(REGISTRY["barrier"]["dissemination"](Context("barrier", p, r, (1,))))
                 for r in range(p)]

        def body(tp):
            with lock:
                arrived.append(tp.rank)
            token = torch.ones(1, dtype=torch.uint8)
            plan = plans[tp.rank]
            P2PProgram(plan, tp, [torch.empty(n, dtype=torch.uint8) for n in plan.scratch],
                       None).run([token])
            with lock:
                return len(arrived)

        assert run_ranks(p, body) == [p] * p


def test_mismatched_sizes_fail_instead_of_hanging():
    # rank 0 believes in 10 elements, rank 1 in 20: the transfer fails loudly
    plans = [Plan(REGISTRY["allreduce"]["tree"](Context("allreduce", 2, r, (n,))))
             for r, n in ((0, 10), (1, 20))]
    bufs = [torch.ones(10), torch.ones(20)]
    with pytest.raises(RuntimeError):
        run_ranks(2, lambda tp: P2PProgram(plans[tp.rank], tp, [
            torch.empty(n) for n in plans[tp.rank].scratch], ops.SUM).run([bufs[tp.rank]]),
            timeout_s=2)


def test_tree_shapes():
    for p in range(1, 20):
        for root in range(p):
            edges = {}
            for r in range(p):
                parent, kids = common.binomial(r, p, root)
                assert (parent is None) == (r == root)
                for k in kids:
                    assert common.binomial(k, p, root)[0] == r
                edges[r] = parent
            for r in range(p):  # every rank reaches the root in at most log2 p hops
                hops, x = 0, r
                while edges[x] is not None:
                    x, hops = edges[x], hops + 1
                assert x == root and hops <= max(p - 1, 0).bit_length()


def test_split_even():
    parts = common.split_even(common.whole(0, 10), 4)
    assert [x.n for x in parts] == [3, 3, 2, 2]
    assert [x.off for x in parts] == [0, 3, 6, 8]
    assert [x.n for x in common.split_even(common.whole(0, 2), 5)] == [1, 1, 0, 0, 0]


def _ring_allreduce_runs(make_program, run):
    """A 3-rank ring allreduce (its local work slices the caller's buffer) run by
    ``run(programs, bufs)`` on the same tensors, on the same tensor objects moved to
    new memory, on fresh flat views of 2-D tensors, on other tensors and on tensors
    allocated where freed ones lay, each checked against a sum computed here."""
    p, n = 3, 30
    plans = [Plan(REGISTRY["allreduce"]["ring"](Context("allreduce", p, r, (n,))))
             for r in range(p)]
    programs = [make_program(pl) for pl in plans]

    def check(bufs, seed):
        want = sum(torch.arange(n, dtype=torch.float32) * (r + seed) for r in range(p))
        assert all(torch.equal(b, want) for b in bufs), seed

    def fresh(seed):
        return [torch.arange(n, dtype=torch.float32) * (r + seed) for r in range(p)]

    same = fresh(1)
    run(programs, same)
    check(same, 1)
    for r in range(p):  # the same tensors again
        same[r].copy_(fresh(2)[r])
    run(programs, same)
    check(same, 2)
    for r in range(p):  # the same tensor objects moved to new memory
        same[r].set_(fresh(3)[r])
    run(programs, same)
    check(same, 3)
    grid = [g.view(5, 6) for g in fresh(5)]  # a flat view made at every call
    run(programs, [g.view(-1) for g in grid])
    for r in range(p):
        grid[r].copy_(fresh(6)[r].view(5, 6))
    run(programs, [g.view(-1) for g in grid])
    check([g.view(-1) for g in grid], 6)
    other = fresh(4)
    run(programs, other)
    check(other, 4)
    del other  # new tensors, most likely where the freed ones lay
    again = fresh(7)
    run(programs, again)
    check(again, 7)
    return programs, again


class _ByAddress(LocalTransport):
    """The in-process transport holding each message's memory by address, as MPI's
    persistent requests do: no reference to the caller's tensor."""

    @staticmethod
    def _raw(t):
        return (torch.frombuffer(ops.memory(t.data_ptr(), t.nbytes), dtype=torch.uint8)
                if t.nbytes else torch.empty(0, dtype=torch.uint8))

    def send_init(self, buf, peer, tag):
        return super().send_init(self._raw(buf), peer, tag)

    def recv_init(self, buf, peer, tag):
        return super().recv_init(self._raw(buf), peer, tag)


def test_p2p_local_work_follows_the_callers_memory():
    # a binding's local work runs on arrays over the addresses of its regions: bound
    # once per address and reused, right whatever tensor sits at those addresses, and
    # never keeping a caller's tensor alive
    fabric = LocalFabric(3)
    transports = [_ByAddress(fabric, r) for r in range(3)]
    bound = []

    def run(programs, bufs):
        run_ranks(3, lambda tp: programs[tp.rank].run([bufs[tp.rank]]), 10.0, transports)
        bound.append({k: id(v) for k, v in programs[0]._bindings.items()})

    plans_made = iter(range(3))
    programs, again = _ring_allreduce_runs(
        lambda pl: P2PProgram(pl, transports[next(plans_made)],
                              [torch.empty(k) for k in pl.scratch], ops.SUM), run)
    assert bound[1] == bound[0], "the same tensors again were bound again"
    assert len(bound[2]) == 2, "tensors moved to new memory did not get a binding of their own"
    watched = weakref.ref(again[0])
    key = again[0].data_ptr()
    assert key in programs[0]._bindings
    del again
    assert watched() is None, "a binding kept the caller's tensor alive"
    assert key in programs[0]._bindings
    # float16 reduces with torch's op, on tensors over the same memory
    plans = [Plan(REGISTRY["allreduce"]["ring"](Context("allreduce", 3, r, (30,))))
             for r in range(3)]
    bufs = [torch.full((30,), r + 1.0, dtype=torch.float16) for r in range(3)]
    run_ranks(3, lambda tp: P2PProgram(plans[tp.rank], tp, [
        torch.empty(k, dtype=torch.float16) for k in plans[tp.rank].scratch], ops.SUM).run(
            [bufs[tp.rank]]))
    assert all(torch.equal(b, torch.full((30,), 6.0, dtype=torch.float16)) for b in bufs)


def test_p2p_local_work_outside_its_buffer_is_refused():
    # raw memory has no bounds: a malformed (unchecked) schedule's region past its
    # buffer is refused when the binding is made, and nothing is written
    from ringcomm.schedule import Builder, Copy, Region

    def build(ctx):
        b = Builder(ctx)
        tmp = b.scratch(4)
        b.step(local=[Copy(Region(tmp, 2, 4), Region(0, 0, 4))])
        return b.build()

    plan = Plan(build(Context("allreduce", 1, 0, (4,))))
    backing = torch.zeros(16)
    program = P2PProgram(plan, None, [backing[:4]], ops.SUM)
    with pytest.raises(RuntimeError, match="ValueError: .*malformed schedule"):
        run_ranks(1, lambda tp: setattr(program, "tp", tp) or program.run([torch.arange(4.0)]))
    assert torch.equal(backing, torch.zeros(16))
    # and memory that is not the CPU's is never taken by address
    fine = Plan(REGISTRY["allreduce"]["ring"](Context("allreduce", 2, 0, (4,))))
    with pytest.raises(RuntimeError, match="ValueError: .*CPU memory; buffer 0 is on meta"):
        run_ranks(1, lambda tp: P2PProgram(fine, tp, [torch.empty(k) for k in fine.scratch],
                                           ops.SUM).run([torch.empty(4, device="meta")]))


def test_group_program_keeps_slices_while_the_callers_tensors_live():
    # the NCCL-rules executor slices the caller's buffers (tensors, for the stream):
    # the last call's slices are kept while the tensors they are slices of live
    kept, fabric = [], SimFabric(3)

    def run(programs, bufs):
        for r, pr in enumerate(programs):
            pr.run([bufs[r]])
        fabric.drain()
        kept.append(programs[0]._sliced)

    comms = iter(range(3))

    def make(pl):
        return GroupProgram(pl, fabric.comm(next(comms)), [torch.empty(k) for k in pl.scratch],
                            ops.SUM)

    programs, again = _ring_allreduce_runs(make, run)
    assert programs[0]._callers, "the ring's local work should slice the caller's buffer"
    assert kept[1] is kept[0], "the same tensors again were sliced again"
    assert kept[4] is kept[3], "a new flat view of the same tensor was sliced again"
    assert kept[2] is not kept[1], "tensors moved to new memory kept their old slices"
    kept.clear()
    for pr in programs:
        pr._bindings.clear()
    del again  # the caller's tensors are gone: their slices are not kept
    gc.collect()  # the simulator's finished work holds them in reference cycles
    assert all(pr._sliced is None for pr in programs)
