"""The algorithm library (``ringcomm/library``), in-process: every algorithm proved
by the checker (world sizes 1-8 and some larger; even, uneven and empty layouts),
run on in-process ranks under both executors (point-to-point threads, as on MPI;
one group per step under the NCCL-rules simulator, as on NCCL) against a
single-process computation for every reduce op and dtype, hierarchical on
unequal host layouts, the composition helper ``Builder.include``, and that the
library uses nothing but ringcomm's public API."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import ringcomm
from ringcomm.execution import checker
from ringcomm import ops
from ringcomm.algorithms import BUILTIN, REGISTRY, TRUSTED, is_schedule, select
from ringcomm.library import ALGORITHMS, double_tree, hierarchical
from ringcomm.schedule import (Builder, Context, Reduce, Region, ScheduleError, binomial_tree,
                               pieces, split_even)
from ringcomm.testing import run_schedule

NAMES = sorted(ALGORITHMS)
ALLREDUCE = [n for c, n in NAMES if c == "allreduce"]
DEPTHS = (1, 5)  # segments per chunk
#: a few larger world sizes per algorithm (powers of two and not)
LARGER = {"rabenseifner": (12, 32), "double_tree": (13, 32), "hierarchical": (13,),
          "bruck": (13, 32), "pairwise": (12, 16), "one_shot": (13,), "two_shot": (13, 16),
          "direct": (13,)}
#: host layouts for hierarchical: unequal hosts, interleaved ranks, one rank per host
HOSTS = [(0, 0, 1), (0, 1, 1), (0, 0, 1, 1, 2), (0, 1, 0, 1), (0, 0, 0, 1, 1, 1, 1),
         (0, 1, 2, 3, 4), (0, 0, 0, 0, 0, 1), (0, 0, 1, 2, 2, 2, 3, 3)]


def ids(pairs):
    return [f"{c}-{n}" for c, n in pairs]


def _hosts(p: int) -> tuple:
    """A multi-host layout for hierarchical on p ranks: hosts of 2 ranks (the last
    host smaller when p is odd), as RINGCOMM_LOCAL_SIZE=2 makes."""
    return tuple(r // 2 for r in range(p)) if p > 2 else ()


#: the root of a rooted collective on p ranks: neither always 0 nor always the last
ROOTS = {p: (p // 2 + 1) % p for p in range(1, 64)}


@pytest.mark.parametrize("collective,name", NAMES, ids=ids(NAMES))
def test_checker_proves_every_library_algorithm(collective, name):
    build = ALGORITHMS[collective, name]
    n = 0
    for p in (*range(1, 9), *LARGER[name]):
        for k in DEPTHS if p <= 8 else (2,):
            for layout, seg in checker.shapes(collective, p, k):
                for hosts in ((), _hosts(p)) if name == "hierarchical" else ((),):
                    checker.check(build, collective, p, layout, seg=seg, hosts=hosts,
                                  root=ROOTS[p])
                    n += 1
    assert n >= 25


@pytest.mark.parametrize("hosts", HOSTS, ids=[str(h) for h in HOSTS])
def test_hierarchical_on_unequal_hosts_talks_across_hosts_only_between_leaders(hosts):
    p = len(hosts)
    leaders = {min(r for r in range(p) if hosts[r] == h) for h in set(hosts)}
    for layout, seg in checker.shapes("allreduce", p, 3):
        checker.check(hierarchical.allreduce, "allreduce", p, layout, seg=seg, hosts=hosts)
        for s in checker.schedules(hierarchical.allreduce, "allreduce", p, layout, seg=seg,
                                   hosts=hosts):
            r = s.ctx.rank
            for st in s.steps:
                for x in (*st.sends, *st.recvs):
                    if hosts[x.peer] != hosts[r]:
                        assert r in leaders and x.peer in leaders, (hosts, r, x)
        bufs, want = _allreduce_inputs(p, layout[0], torch.int64, "SUM", seed=p)
        for executor in ("threads", "nccl-sim"):
            run = [[b.clone()] for b in bufs]
            run_schedule(hierarchical.allreduce, "allreduce", p, layout, run, seg=seg,
                         executor=executor, hosts=hosts)
            assert all(torch.equal(b[0], want) for b in run), (hosts, layout, executor)


# -- runs against a single-process computation ------------------------------------------
def _allreduce_inputs(p: int, n: int, dtype: torch.dtype, op: str, seed: int):
    """Per-rank inputs whose reduction is exact in ``dtype`` whatever the order (small
    integers; for PRODUCT few factors of 2, so int8 and uint8 do not overflow), and
    the expected result computed in float64/int64 by torch, not by ringcomm."""
    g = torch.Generator().manual_seed(seed)
    if op == "PRODUCT":
        lo = 1 if dtype == torch.uint8 else -1
        xs = [torch.randint(lo, 2, (n,), generator=g) for _ in range(p)]
        for x in xs:
            x[x == 0] = 1
        for x in xs[:4]:  # at most 2**4 in magnitude
            x[torch.rand(n, generator=g) < 0.3] *= 2
    elif dtype == torch.uint8:
        xs = [torch.randint(0, 9, (n,), generator=g) for _ in range(p)]
    else:
        xs = [torch.randint(-4, 5, (n,), generator=g) for _ in range(p)]
    wide = torch.stack(xs).double()
    want = {"SUM": wide.sum(0), "AVG": wide.sum(0),  # a schedule sums; the group divides
            "PRODUCT": wide.prod(0), "MIN": wide.amin(0), "MAX": wide.amax(0)}[op]
    return [x.to(dtype) for x in xs], want.to(dtype)


def _inputs(collective: str, p: int, layout, seed: int):
    """Per rank: the caller's buffers and what each must hold afterwards (None: any)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(n):
        return torch.randint(-50, 50, (n,), generator=g, dtype=torch.int64)

    def junk(n):
        return torch.full((n,), -7777, dtype=torch.int64)

    if collective == "allreduce":
        xs = [rnd(layout[0]) for _ in range(p)]
        total = torch.stack(xs).sum(0)
        return [[x.clone()] for x in xs], [[total] for _ in range(p)]
    if collective == "allgather":
        xs = [rnd(n) for n in layout]
        return ([[junk(n) for n in layout] + [xs[r].clone()] for r in range(p)],
                [list(xs) + [None] for _ in range(p)])
    if collective == "broadcast":  # from ROOTS[p]
        x = rnd(layout[0])
        root = ROOTS[p]
        return ([[x.clone() if r == root else junk(layout[0])] for r in range(p)],
                [[x] for _ in range(p)])
    if collective == "reduce_scatter":
        xs = [[rnd(n) for n in layout] for _ in range(p)]
        return ([[c.clone() for c in xs[r]] + [junk(layout[r])] for r in range(p)],
                [[None] * p + [sum(xs[i][r] for i in range(p))] for r in range(p)])
    sent = [[rnd(layout[i][j]) for j in range(p)] for i in range(p)]  # alltoall
    return ([[s.clone() for s in sent[r]] + [junk(layout[i][r]) for i in range(p)]
             for r in range(p)],
            [[None] * p + [sent[i][r] for i in range(p)] for r in range(p)])


@pytest.mark.parametrize("executor", ["threads", "nccl-sim", "events"])
@pytest.mark.parametrize("collective,name", NAMES, ids=ids(NAMES))
def test_runs_match_single_process(collective, name, executor):
    build = ALGORITHMS[collective, name]
    runs = 0
    for p in range(1, 9):
        for k in (1, 3):
            for layout, seg in checker.shapes(collective, p, k):
                bufs, want = _inputs(collective, p, layout, seed=p * 100 + k)
                hosts = _hosts(p) if name == "hierarchical" else ()
                run_schedule(build, collective, p, layout, bufs, seg=seg, executor=executor,
                             hosts=hosts, timeout_s=20, root=ROOTS[p])
                for r in range(p):
                    for b, w in enumerate(want[r]):
                        if w is not None:
                            assert torch.equal(bufs[r][b], w), (p, k, layout, r, b)
                runs += 1
    assert runs >= 32


DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.int8, torch.uint8)
OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")


@pytest.mark.parametrize("executor", ["threads", "nccl-sim", "events"])
@pytest.mark.parametrize("name", ALLREDUCE)
def test_every_reduce_op_and_dtype(name, executor):
    # 5 ranks: rabenseifner folds one rank, double_tree's second tree is shifted;
    # hierarchical on hosts of 2, 2 and 1 ranks. 13 elements in segments of 4.
    p, n = 5, 13
    for dtype in DTYPES:
        for op in OPS:
            xs, want = _allreduce_inputs(p, n, dtype, op, seed=hash((dtype, op)) % 1000)
            bufs = [[x.clone()] for x in xs]
            run_schedule(REGISTRY["allreduce"][name], "allreduce", p, (n,), bufs,
                         op=getattr(ops, op), seg=4, executor=executor, hosts=_hosts(p))
            for r in range(p):
                assert torch.equal(bufs[r][0], want), (name, dtype, op, r, bufs[r][0], want)


@pytest.mark.parametrize("name", ALLREDUCE)
def test_floats_end_bit_identical_on_every_rank(name):
    # Every element is reduced on one rank and copied to the others, so ranks agree
    # to the bit even where rounding depends on the order.
    p, n = 6, 1001
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, generator=g) for _ in range(p)]
    bufs = [[x.clone()] for x in xs]
    run_schedule(REGISTRY["allreduce"][name], "allreduce", p, (n,), bufs, seg=64,
                 executor="nccl-sim", hosts=_hosts(p))
    assert all(torch.equal(b[0], bufs[0][0]) for b in bufs)
    assert torch.allclose(bufs[0][0].double(), torch.stack(xs).double().sum(0), atol=1e-5)


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_min_max_of_signed_zeros_agree_on_every_rank(p):
    """MIN and MAX of +0 and -0 return one operand's sign, so an allreduce whose ranks
    combine the same values in other operand orders ends with ranks disagreeing on the
    sign of a zero (one_shot did, and recursive doubling's higher partner of each
    pair). Every built-in allreduce must give every rank the same bits."""
    g = torch.Generator().manual_seed(p)
    n = 64
    xs = [torch.where(torch.rand(n, generator=g) < 0.5, 0.0, -0.0) for _ in range(p)]
    names = sorted(algo for coll, algo in BUILTIN | set(ALGORITHMS)
                   if coll == "allreduce" and is_schedule(REGISTRY["allreduce"][algo]))
    assert {"recursive_doubling", "one_shot", "ring", "hierarchical"} <= set(names), names
    # numpy's reductions (float32) and torch's (bfloat16), on MPI's executor and on
    # NCCL's (where the local work is torch's)
    cases = [(name, op, dtype, executor) for name in names for op in (ops.MIN, ops.MAX)
             for dtype, executor in ((torch.float32, "threads"), (torch.bfloat16, "threads"),
                                     (torch.float32, "nccl-sim"))]
    for name, op, dtype, executor in cases:
        bufs = [[x.to(dtype, copy=True)] for x in xs]
        run_schedule(REGISTRY["allreduce"][name], "allreduce", p, (n,), bufs, op=op,
                     seg=16, hosts=_hosts(p), executor=executor)
        signs = [torch.signbit(b[0]) for b in bufs]
        assert all(torch.equal(signs[0], s) for s in signs[1:]), (name, op, dtype, executor)
        assert bool((bufs[0][0] == 0).all()), (name, op, dtype, executor)


def test_step_counts_are_the_documented_ones():
    def rounds(coll, name, p, layout, seg=1 << 30):
        return checker.check(REGISTRY[coll][name], coll, p, layout, seg=seg).rounds

    # rabenseifner: 2 log2 p rounds; +2 for the fold when p is not a power of two
    assert rounds("allreduce", "rabenseifner", 8, (64,)) == 6
    assert rounds("allreduce", "rabenseifner", 6, (64,)) == 2 * 2 + 2
    # bruck: ceil(log2 p) rounds; pairwise: p - 1
    assert [rounds("allgather", "bruck", p, (1,) * p) for p in (2, 3, 4, 5, 8, 9)] == \
        [1, 2, 2, 3, 3, 4]
    assert rounds("alltoall", "pairwise", 7, ((1,) * 7,) * 7) == 6
    # double tree: k segments per half finish after about k + 2 * height rounds, far
    # fewer than the binomial tree's reduce-then-broadcast
    # the direct ones: one step, or two for two_shot, at any p (k per segment)
    assert [rounds("allreduce", "one_shot", p, (4 * p,)) for p in (2, 3, 5, 8)] == [1] * 4
    assert [rounds("allreduce", "two_shot", p, (4 * p,)) for p in (2, 3, 5, 8)] == [2] * 4
    assert rounds("allreduce", "two_shot", 5, (5 * 12,), seg=4) == 3 + 1
    assert rounds("reduce_scatter", "direct", 5, (8,) * 5, seg=4) == 2
    assert rounds("allgather", "direct", 7, (3,) * 7) == 1
    assert rounds("broadcast", "direct", 7, (30,)) == 1
    dt = rounds("allreduce", "double_tree", 16, (16 * 64,), seg=16)
    assert dt <= 32 + 2 * 4 + 2 < rounds("allreduce", "tree", 16, (16 * 64,), seg=16)


# -- NCCL's double binary tree ------------------------------------------------------------
def test_double_tree_shapes_are_complementary_spanning_trees():
    for p in range(1, 130):
        for t in (0, 1):
            parent = {r: double_tree.trees(r, p)[t][0] for r in range(p)}
            assert sum(x is None for x in parent.values()) == 1
            for r in range(p):
                kids = double_tree.trees(r, p)[t][1]
                assert len(kids) <= 2 and all(parent[k] == r for k in kids)
                hops, x = 0, r
                while parent[x] is not None:  # reaches the root, no cycle
                    x, hops = parent[x], hops + 1
                    assert hops < p
        # an inner node of one tree is a leaf of the other, except at most one rank
        both = [r for r in range(p) if all(k for _, k in double_tree.trees(r, p))]
        assert len(both) <= 1, (p, both)
    # NCCL's pictures (src/graph/trees.cc): 12 ranks mirrored, 13 shifted
    assert double_tree.trees(8, 12)[0] == (0, [4, 10]) and double_tree.trees(3, 12)[1][0] == 11
    assert double_tree.trees(1, 13)[1][0] is None and double_tree.trees(0, 13)[1] == (9, [11])


# -- composition ---------------------------------------------------------------------------
def halves(ctx: Context):
    """Allreduce by halves: the first over the ring, the second by recursive doubling,
    each included with its buffer mapped onto a region of the data."""
    b = Builder(ctx)
    n = ctx.layout[0]
    everyone = list(range(ctx.size))
    for half, name in zip(split_even((0, 0, n), 2), ("ring", "recursive_doubling")):
        sub = REGISTRY["allreduce"][name](Context("allreduce", ctx.size, ctx.rank, (half.n,),
                                                  seg=ctx.seg))
        b.include(sub, ranks=everyone, buffers=[half])
    return b.build()


def test_include_maps_peers_regions_and_scratch():
    for p in range(1, 7):
        for layout, seg in checker.shapes("allreduce", p, 2):
            checker.check(halves, "allreduce", p, layout, seg=seg)
    # a subgroup: the odd ranks allreduce among themselves, mapped through ranks
    ctx = Context("allreduce", 6, 3, (10,), seg=4)
    b = Builder(ctx)
    sub = REGISTRY["allreduce"]["ring"](Context("allreduce", 3, 1, (10,), seg=4))
    b.include(sub, ranks=[1, 3, 5], buffers=[0])
    s = b.build()
    assert {x.peer for st in s.steps for x in (*st.sends, *st.recvs)} == {1, 5}
    assert len(s.scratch) == len(sub.scratch) and all(
        op.src.buf == 1 for st in s.steps for op in st.local)


def test_include_refuses_what_does_not_fit():
    ctx = Context("allreduce", 4, 1, (8,))
    sub = REGISTRY["allreduce"]["ring"](Context("allreduce", 2, 1, (8,)))
    with pytest.raises(ValueError, match="ranks lists 3 ranks, the schedule was built for 2"):
        Builder(ctx).include(sub, ranks=[0, 1, 2], buffers=[0])
    with pytest.raises(ValueError, match="must be distinct ranks of this group"):
        Builder(ctx).include(sub, ranks=[1, 1], buffers=[0])
    with pytest.raises(ValueError, match="maps to rank 3, not to this rank"):
        Builder(ctx).include(sub, ranks=[1, 3], buffers=[0])
    with pytest.raises(ValueError, match="buffer 0 has 8 elements, but is mapped onto"):
        Builder(ctx).include(sub, ranks=[0, 1], buffers=[(0, 0, 4)])
    with pytest.raises(ValueError, match="buffers names buffer 1; the schedule has 1"):
        Builder(ctx).include(sub, ranks=[0, 1], buffers={0: 0, 1: 0})
    with pytest.raises(ValueError, match="its buffer 0, which buffers does not map"):
        Builder(ctx).include(sub, ranks=[0, 1], buffers={})


def test_hierarchical_make_composes_any_registered_allreduce():
    hosts = (0, 0, 0, 1, 1, 2, 2, 2)
    for inter in ("ring", "tree", "rabenseifner", "double_tree", REGISTRY["allreduce"]["ring"]):
        build = hierarchical.make(inter=inter)
        for layout, seg in checker.shapes("allreduce", 8, 2):
            checker.check(build, "allreduce", 8, layout, seg=seg, hosts=hosts)
    ctx = Context("allreduce", 4, 0, (8,), hosts=(0, 0, 1, 1))
    with pytest.raises(ValueError, match="'native' is not a registered schedule builder"):
        hierarchical.make(inter="native")(ctx)
    with pytest.raises(ValueError, match="'nope' is not a registered schedule builder"):
        hierarchical.make(inter="nope")(ctx)
    with pytest.raises(TypeError, match="must be a name or a builder"):
        hierarchical.make(inter=3)
    # the default: recursive doubling across hosts for small buffers, ring for large
    small = hierarchical.allreduce(Context("allreduce", 4, 0, (8,), hosts=(0, 0, 1, 1)))
    big = hierarchical.allreduce(Context("allreduce", 4, 0, (hierarchical.SMALL_BYTES // 4 + 1,),
                                         hosts=(0, 0, 1, 1)))
    assert len(small.steps) < len(big.steps)
    # by the message's bytes: as many bfloat16 elements are half the bytes, and where
    # float32 takes the ring they still take recursive doubling
    n = hierarchical.SMALL_BYTES // 2
    assert hierarchical.leaders_algorithm(2, n, itemsize=4) == "ring"
    assert hierarchical.leaders_algorithm(2, n, itemsize=2) == "recursive_doubling"
    half = [hierarchical.allreduce(Context("allreduce", 4, 0, (n,), hosts=(0, 0, 1, 1),
                                           itemsize=k)) for k in (2, 4)]
    assert len(half[0].steps) < len(half[1].steps)
    # the planner gives builders the call's element size, and keeps the plans apart
    from ringcomm.front.planner import Planner

    planner = Planner(0, 4, ringcomm.Options().resolve(), hosts=(0, 0, 1, 1))
    build = REGISTRY["allreduce"]["hierarchical"]
    plans = [planner.plan("allreduce", "hierarchical", build, (n,), 0, dt)
             for dt in (torch.bfloat16, torch.float32)]
    assert [pl.ctx.itemsize for pl in plans] == [2, 4]
    assert plans[0].nsteps < plans[1].nsteps
    # on more hosts the leaders run what auto's modelled rows give for that many ranks:
    # not a ring of 256 leaders (510 steps) for 64 KiB
    from ringcomm.algorithms import select
    assert hierarchical.leaders_algorithm(2, 8) == "recursive_doubling"
    assert hierarchical.leaders_algorithm(256, 16384) == select.choose(
        select.MODELLED, "allreduce", 65536, 256, bands=False) != "ring"
    assert hierarchical.leaders_algorithm(256, 1 << 28) == "ring"


# -- the public helpers, and the library's use of the public API only ----------------------
def test_public_helpers():
    assert [x.n for x in split_even((0, 0, 10), 4)] == [3, 3, 2, 2]
    assert [x.off for x in split_even(Region(2, 5, 10), 4)] == [5, 8, 11, 13]
    assert [tuple(x) for x in pieces((1, 3, 7), 3)] == [(1, 3, 3), (1, 6, 3), (1, 9, 1)]
    assert pieces((0, 0, 0), 3) == []
    assert binomial_tree(0, 8, 0) == (None, [4, 2, 1]) and binomial_tree(6, 8, 0) == (4, [7])
    for bad in (lambda: split_even((0, 0, 4), 0), lambda: pieces((0, 0, 4), 0),
                lambda: binomial_tree(5, 4, 0)):
        with pytest.raises(ValueError):
            bad()


# the registry's names come from its own module (the package re-exports them): a
# builder imports nothing above its layer (tests/test_layers.py)
PUBLIC = {"ringcomm.algorithms": {"register_algorithm", "REGISTRY", "select"},
          "ringcomm.schedule": {"Builder", "Context", "Region", "Reduce", "Copy", "Schedule",
                                "split_even", "pieces", "binomial_tree", "SCRATCH_SLOTS"}}


def test_library_imports_only_public_names():
    root = pathlib.Path(ringcomm.__file__).parent / "library"
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                if node.module == "ringcomm.library":  # its own modules
                    continue
                if node.module.startswith("ringcomm"):
                    names = {a.name for a in node.names}
                    assert names <= PUBLIC.get(node.module, set()), (path.name, node.module,
                                                                     names)
                else:
                    assert node.module in ("__future__", "typing"), (path.name, node.module)
            elif isinstance(node, ast.Import):
                # importlib and pkgutil: the package finds its modules (__init__.py)
                assert {a.name for a in node.names} <= {"functools", "importlib", "pkgutil"}, \
                    path.name


def test_registered_like_a_users_algorithm_and_tuning_names_only_registered_ones():
    for (coll, name), build in ALGORITHMS.items():
        # registered as a user would, trusted as the built-ins are (this file proves them)
        assert REGISTRY[coll][name] is build and (coll, name) not in BUILTIN
        assert (coll, name) in TRUSTED
    for coll, rows_by_size in select.DEFAULT_TUNING.items():
        for rows in rows_by_size.values():
            assert all(algo in REGISTRY[coll] for _, algo in rows), (coll, rows)


def test_first_use_check_refuses_nothing_at_realistic_shapes():
    # what the planner runs on the first call of each shape: the real shape without
    # contents, the contents at a smaller shape with as many segments per chunk
    from ringcomm.execution.user_checks import check_user_schedule

    seg = (2 << 20) // 4  # the default 2 MiB segments of float32
    for (coll, name), build in ALGORITHMS.items():
        p = 8
        n = (8 << 20) // 4 if coll == "allreduce" else 1 << 18
        layout = {"allreduce": (n,), "allgather": (n,) * p, "broadcast": (n,),
                  "reduce_scatter": (n,) * p, "alltoall": ((n,) * p, (n,) * p)}[coll]
        ctx = Context(coll, p, 3, layout, seg=seg, hosts=_hosts(p))
        assert check_user_schedule(build, ctx, name).ctx == ctx


def test_a_wrong_schedule_is_still_refused():
    def rabenseifner_without_fold(ctx):  # forgets the folded ranks' contribution
        s = ALGORITHMS["allreduce", "rabenseifner"](ctx)
        if ctx.rank == 1:
            b = Builder(ctx)
            for n in s.scratch:
                b.scratch(n)
            for st in s.steps:
                b.step(st.sends, st.recvs, [op for op in st.local
                                            if not (isinstance(op, Reduce) and op.dst.n == 6)])
            return b.build()
        return s

    with pytest.raises(ScheduleError, match=r"rank \d buffer 0 element 0 ends as element 0 "
                                            r"from ranks \{1, 2\}, expected"):
        checker.check(rabenseifner_without_fold, "allreduce", 3, (6,))


# -- auto ----------------------------------------------------------------------------------
def test_auto_follows_the_library_rows():
    table = select.load_tuning(None)
    mib = 1 << 20
    # rabenseifner takes the ring's band up to a threshold that grows with p (2 ranks:
    # measured rows, tests/test_docs.py)
    assert [select.choose(table, "allreduce", mib, p) for p in (3, 4, 5, 8, 9, 16)] == \
        ["ring", "ring", "ring", "rabenseifner", "rabenseifner", "rabenseifner"]
    assert select.choose(table, "allreduce", 512 << 10, 4) == "rabenseifner"
    assert select.choose(table, "allreduce", 4096, 8) == "recursive_doubling"
    assert select.choose(table, "allreduce", 40000, 8) == "rabenseifner"
    assert select.choose(table, "allreduce", 40000, 7) == "rabenseifner"
    assert select.choose(table, "allreduce", 30000, 7) == "tree"
    assert select.choose(table, "allreduce", 1 << 30, 8) == "ring"
    # ranges: the largest ">=N" that fits; an exact world size before any range
    assert select.choose(table, "allreduce", 10 * mib, 100) == "double_tree"
    assert select.choose(table, "allreduce", 10 * mib, 47) == "ring"
    assert select.choose(table, "allreduce", 10 * mib, 256) == "rabenseifner"
    # bruck for small chunks from 4 ranks on (the size is one rank's chunk; 2 ranks:
    # measured rows, tests/test_docs.py)
    assert [select.choose(table, "allgather", 1000, p) for p in (3, 4, 64)] == \
        ["ring", "bruck", "bruck"]
    assert select.choose(table, "allgather", 4 * mib, 64) == "ring"
    # several hosts with several ranks on one: recursive doubling up to 16 KiB, then
    # hierarchical (measured across namespace hosts, docs/multi-node.md)
    for hosts, want in (((0, 0, 1, 1), "hierarchical"), ((0, 1, 1), "hierarchical"),
                        ((0, 1, 2, 3), "rabenseifner"), ((), "rabenseifner")):
        assert select.choose(table, "allreduce", 65536, len(hosts) or 4, hosts) == want, hosts
    assert select.choose(table, "allreduce", 16384, 4, (0, 0, 1, 1)) == "recursive_doubling"
    assert select.choose(table, "allreduce", 1 << 30, 6, (0, 0, 0, 1, 1, 1)) == "hierarchical"
    assert select.choose(table, "broadcast", 64, 4, (0, 0, 1, 1)) == "tree"


def test_planner_chooses_hierarchical_on_a_multi_host_group():
    from ringcomm.front.planner import Planner

    options = ringcomm.Options().resolve()
    assert Planner(0, 4, options, hosts=(0, 0, 1, 1)).choose("allreduce", 1 << 20) == \
        "hierarchical"
    assert Planner(0, 4, options).choose("allreduce", 512 << 10) == "rabenseifner"


def test_a_tuning_file_default_replaces_the_builtin_size_rows(tmp_path):
    import json

    f = tmp_path / "t.json"
    f.write_text(json.dumps({"allreduce": {"default": [[None, "tree"]],
                                           ">=100": [[None, "double_tree"]]}}))
    table = select.load_tuning(str(f))
    assert select.choose(table, "allreduce", 1 << 20, 8) == "tree"
    assert select.choose(table, "allreduce", 1 << 20, 128) == "double_tree"
    assert select.choose(table, "allreduce", 1 << 20, 8, (0, 0, 1, 1, 2, 2, 3, 3)) == \
        "hierarchical"
    f.write_text(json.dumps({"allreduce": {"<=4": [[None, "tree"]]}}))
    with pytest.raises(ValueError, match="bad key '<=4'"):
        select.load_tuning(str(f))


def test_shipped_rows_follow_the_cost_model(tmp_path):
    """The library's rows in DEFAULT_TUNING are within 30% (predicted) of the model's
    choice at every size (scripts/library_tuning.py; the rest of its world sizes are in
    docs/data/library_tuning.json), and the committed bands are the script's."""
    import importlib.util
    import json

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("library_tuning",
                                                  ROOT / "scripts" / "library_tuning.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "bands.json"
    assert script.main(["--ranks", "5,8", "--collectives", "allreduce,allgather",
                        "--json", str(out)]) == 0
    fresh = json.loads(out.read_text())["collectives"]
    committed = json.loads((ROOT / "docs" / "data" / "library_tuning.json").read_text())
    for coll, report in fresh.items():
        for p, got in report["bands"].items():
            assert got["shipped_table"]["worst_slowdown"] <= 1.3, (coll, p, got)
            assert got == committed["collectives"][coll]["bands"][p], (coll, p)


def test_verify_false_trusts_a_builder_and_verify_true_checks_it():
    """The first use of a checked builder builds every rank's schedule (to check
    them); a trusted one builds only this rank's."""
    import ringcomm
    from ringcomm.front.planner import Planner

    calls = []

    def counted(ctx):
        calls.append(ctx.rank)
        return ALGORITHMS[("allreduce", "rabenseifner")](ctx)

    try:
        for verify, want in ((True, [0, 1, 2]), (False, [1])):
            calls.clear()
            ringcomm.register_algorithm("allreduce", "counted", counted, replace=True,
                                        verify=verify)
            Planner(1, 3, ringcomm.Options().resolve()).plan(
                "allreduce", "counted", counted, (10,), 0, torch.float32)
            assert sorted(calls) == sorted(want), (verify, calls)
    finally:
        REGISTRY["allreduce"].pop("counted", None)
        TRUSTED.discard(("allreduce", "counted"))
