"""Per-rank program: the algorithm library (ringcomm/library) under a real launcher,
against gloo on the same ranks (same call, same inputs) and, where gloo lacks an
op or a form, against a single-process computation from every rank's inputs.

* allreduce with ``rabenseifner``, ``double_tree`` and ``hierarchical``: every reduce
  op and dtype on an odd size (gloo's where it has them, the local oracle for AVG and
  the rest), sizes 0, 1, p-1 and 7, and 3 MiB on the world group (2 MiB segments) and
  on a group with 64 KiB segments (dozens of segments per call);
* allreduce with ``one_shot`` and ``two_shot`` as the three above;
* allgather with ``bruck``: ``all_gather`` (equal and uneven sizes) and
  ``all_gather_into_tensor``;
* ``direct`` allgather, broadcast (every root) and reduce_scatter: against gloo, on
  both groups (the 64 KiB segments cut reduce_scatter's chunks), with an uneven
  all_gather and reduce_scatter against the inputs;
* alltoall with ``pairwise``: ``all_to_all_single`` (equal, uneven with zeros) and
  ``all_to_all`` lists;
* the host layout the group saw (``--hosts 0,0,1`` or ``--hosts none`` for one host)
  and that ``auto`` runs ``hierarchical`` on a multi-host layout.

Run under mpiexec or torchrun; exits non-zero listing every failed check.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm
from _common import Checker, done, run_checks
from collectives_check import data, oracle, same, valid  # inputs and oracle shared

R = dist.ReduceOp
OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.int8, torch.uint8)
ALLREDUCE = ("rabenseifner", "double_tree", "hierarchical", "one_shot", "two_shot")
#: the direct algorithms of the other collectives (ringcomm/library/direct.py)
DIRECT = ("allgather", "broadcast", "reduce_scatter")


@dataclass
class Ctx:
    """What every check shares: this rank, the world size, the checker, a gloo group
    over the same ranks, a ringcomm group with 64 KiB segments, the dtypes to run, and
    the command line."""
    rank: int
    p: int
    c: Checker
    gloo: object
    small_seg: object
    dtypes: tuple
    args: argparse.Namespace


def check_host_layout(ctx: Ctx) -> None:
    """The host layout, from the launcher or RINGCOMM_LOCAL_SIZE, and what ``auto``
    chooses on it (hierarchical on several hosts) gives the right sum."""
    c, p = ctx.c, ctx.p
    hosts_arg = ctx.args.hosts
    want_hosts = () if hosts_arg == "none" else tuple(int(h) for h in hosts_arg.split(","))
    hosts = ringcomm.get_group().planner.hosts
    c.check(hosts == want_hosts, f"host layout {hosts}, expected {want_hosts}")
    c.check(ringcomm.get_group(ctx.small_seg).planner.hosts == want_hosts, "subgroup host layout")
    multi = bool(want_hosts) and len(set(want_hosts)) < len(want_hosts)
    for nbytes in (8, 1 << 20):  # multi-host: recursive doubling up to 16 KiB
        chosen = ringcomm.get_group().algorithm_for("allreduce", nbytes)
        c.check((chosen == "hierarchical") == (multi and nbytes > 16384),
                f"auto chose {chosen} for {nbytes} B on hosts {want_hosts}")
    t = torch.full((5,), float(ctx.rank + 1))
    dist.all_reduce(t)
    c.check(same(t, torch.full((5,), p * (p + 1) / 2)), "auto allreduce")


# Gloo is the slow side here (several ms a call on oversubscribed cores), and its
# answer does not depend on our algorithm: one gloo call per case, every algorithm
# compared with it.
def reference(ctx: Ctx, inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """gloo's allreduce of this rank's input, or the oracle's where gloo lacks it."""
    ref = inputs[ctx.rank].clone()
    try:
        dist.all_reduce(ref, op=getattr(R, op), group=ctx.gloo)
    except (RuntimeError, ValueError):  # gloo lacks it (AVG, some dtypes)
        ref = oracle(inputs, op)
    return ref


def allreduce_case(ctx: Ctx, what: str, inputs: list[torch.Tensor], op: str,
                   want: torch.Tensor, group=None) -> None:
    """Every library allreduce of this rank's input gives ``want``."""
    c = ctx.c
    for algo in ALLREDUCE:
        ringcomm.set_algorithm("allreduce", algo, group=group)
        ours = inputs[ctx.rank].clone()
        name = f"allreduce[{algo}] {what}"
        if c.run(name, dist.all_reduce, ours, op=getattr(R, op), group=group) is None:
            c.check(same(ours, want), f"{name}: got {ours[:6].tolist()}, want "
                                      f"{want[:6].tolist()}")
    ringcomm.set_algorithm("allreduce", "auto", group=group)


def check_allreduce_ops(ctx: Ctx) -> None:
    """allreduce: every op x dtype (odd size: uneven blocks and halves)."""
    for op in OPS:
        for dtype in ctx.dtypes:
            if valid(op, dtype):
                inputs = [data(q, 1001, dtype, op) for q in range(ctx.p)]
                allreduce_case(ctx, f"{op} {dtype} n=1001", inputs, op,
                               reference(ctx, inputs, op))


def check_allreduce_sizes(ctx: Ctx) -> None:
    """allreduce sizes: empty, one element, fewer than the ranks, odd (dtypes of one
    size: every new call shape is checked on first use, like a user's algorithm, and
    that check is most of this program's time on oversubscribed cores)."""
    p = ctx.p
    for n in sorted({0, 1, max(p - 1, 1), 7}):
        for dtype, op in ((torch.float32, "SUM"), (torch.int32, "MAX"), (torch.float32, "AVG")):
            inputs = [data(q, n, dtype, op) for q in range(p)]
            allreduce_case(ctx, f"{op} {dtype} n={n}", inputs, op, reference(ctx, inputs, op))


def check_allreduce_large(ctx: Ctx) -> None:
    """A few MiB: a couple of 2 MiB segments on the world group, dozens of 64 KiB ones
    on the other. Floats against gloo with a tolerance; integers bit for bit."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    n = (3 << 20) // 4 + 1
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    ref = x.clone()
    dist.all_reduce(ref, group=ctx.gloo)
    big = [data(q, n, torch.int32) for q in range(p)]
    want = oracle(big, "SUM")
    for group, gname in ((None, "world"), (ctx.small_seg, "seg64k")):
        for algo in ALLREDUCE:
            ringcomm.set_algorithm("allreduce", algo, group=group)
            ours = x.clone()
            what = f"allreduce[{algo},{gname}] float32 n={n}"
            if c.run(what, dist.all_reduce, ours, group=group) is None:
                c.check(torch.allclose(ours, ref, rtol=1e-4, atol=1e-4),
                        f"{what}: max diff {(ours - ref).abs().max().item()}")
            if group is not None:  # the same shape: exact integers
                ours = big[rank].clone()
                if c.run(what + " int32", dist.all_reduce, ours, group=group) is None:
                    c.check(same(ours, want), what + " int32")
        ringcomm.set_algorithm("allreduce", "auto", group=group)


def _bruck_equal(ctx: Ctx, dtype, n: int) -> None:
    """all_gather on both groups and all_gather_into_tensor, against gloo."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    x = data(rank, n, dtype, salt=3) if dtype != torch.bool else data(rank, n, dtype) > 0
    refs = [torch.empty(n, dtype=dtype) for _ in range(p)]
    dist.all_gather(refs, x.clone(), group=ctx.gloo)
    for group, gname in ((None, "world"), (ctx.small_seg, "seg64k")):
        outs = [torch.empty(n, dtype=dtype) for _ in range(p)]
        what = f"all_gather[bruck,{gname}] {dtype} n={n}"
        if c.run(what, dist.all_gather, outs, x.clone(), group=group) is None:
            c.check(same(outs, refs), what)
    out = torch.empty(p * n, dtype=dtype)
    what = f"all_gather_into_tensor[bruck] {dtype} n={n}"
    if c.run(what, dist.all_gather_into_tensor, out, x.clone()) is None:
        c.check(same(out, torch.cat(refs)), what)


def check_allgather_bruck(ctx: Ctx) -> None:
    """allgather with bruck: equal sizes against gloo, uneven against the inputs."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    ringcomm.set_algorithm("allgather", "bruck")
    ringcomm.set_algorithm("allgather", "bruck", group=ctx.small_seg)
    for dtype in ctx.dtypes if ctx.args.quick else (torch.float32, torch.int32, torch.int8,
                                                   torch.bool):
        for n in sorted({0, 1, max(p - 1, 1), 1001, 200003}):
            _bruck_equal(ctx, dtype, n)
    for base in (0, 4000):  # uneven: rank q contributes base + q elements (gloo: equal only)
        inputs = [data(q, base + q, torch.float32, salt=4) for q in range(p)]
        outs = [torch.empty(base + q) for q in range(p)]
        what = f"all_gather[bruck] uneven base={base}"
        if c.run(what, dist.all_gather, outs, inputs[rank].clone()) is None:
            c.check(same(outs, inputs), what)
    ringcomm.set_algorithm("allgather", "auto")
    ringcomm.set_algorithm("allgather", "auto", group=ctx.small_seg)


def check_alltoall_pairwise(ctx: Ctx) -> None:
    """alltoall with pairwise: all_to_all_single (equal, uneven with zeros) against
    gloo, all_to_all lists against the inputs."""
    c, rank, p, gloo = ctx.c, ctx.rank, ctx.p, ctx.gloo
    ringcomm.set_algorithm("alltoall", "pairwise")
    for dtype in ctx.dtypes if ctx.args.quick else (torch.float32, torch.int32, torch.bfloat16):
        for n in (0, 1, 7, 70001):
            x = data(rank, p * n, dtype, salt=5)
            ours, ref = torch.empty(p * n, dtype=dtype), torch.empty(p * n, dtype=dtype)
            what = f"all_to_all_single[pairwise] {dtype} n={n}"
            if c.run(what, dist.all_to_all_single, ours, x.clone()) is None:
                dist.all_to_all_single(ref, x.clone(), group=gloo)
                c.check(same(ours, ref), what)
    for scale in (1, 1000):  # uneven splits with zeros: rank r sends (r+j)%3*scale rows to j
        ins_split = [(rank + j) % 3 * scale for j in range(p)]
        outs_split = [(j + rank) % 3 * scale for j in range(p)]
        x = data(rank, sum(ins_split) * 3, torch.float32, salt=6).view(-1, 3)
        ours, ref = torch.empty(sum(outs_split), 3), torch.empty(sum(outs_split), 3)
        what = f"all_to_all_single[pairwise] uneven x{scale}"
        if c.run(what, dist.all_to_all_single, ours, x.clone(), outs_split, ins_split) is None:
            dist.all_to_all_single(ref, x.clone(), outs_split, ins_split, group=gloo)
            c.check(same(ours, ref), what)
    ins = [data(rank * 13 + j, rank + j + 1, torch.float32) for j in range(p)]
    outs = [torch.empty(j + rank + 1) for j in range(p)]  # gloo needs equal sizes: oracle
    if c.run("all_to_all[pairwise] lists", dist.all_to_all, outs, [t.clone() for t in ins]) \
            is None:
        c.check(same(outs, [data(j * 13 + rank, j + rank + 1, torch.float32) for j in range(p)]),
                "all_to_all[pairwise] lists of uneven sizes")
    ringcomm.set_algorithm("alltoall", "auto")


def check_direct(ctx: Ctx) -> None:
    """allgather, broadcast (from every root) and reduce_scatter with ``direct``, against
    gloo: equal sizes (with and without segments cutting the chunks), then uneven
    all_gather and reduce_scatter against the inputs."""
    c, rank, p, gloo = ctx.c, ctx.rank, ctx.p, ctx.gloo
    groups = ((None, "world"), (ctx.small_seg, "seg64k"))
    for coll in DIRECT:
        for group, _ in groups:
            ringcomm.set_algorithm(coll, "direct", group=group)
    for dtype in (torch.float32, torch.int32):
        for n in sorted({0, 1, 1001, 40003}):
            x = data(rank, n, dtype, salt=7)
            refs = [torch.empty(n, dtype=dtype) for _ in range(p)]
            dist.all_gather(refs, x.clone(), group=gloo)
            chunks = [data(rank * p + j, n, dtype, salt=8) for j in range(p)]
            rs_ref = torch.empty(n, dtype=dtype)  # data() sums exactly in any order
            dist.reduce_scatter(rs_ref, [t.clone() for t in chunks], group=gloo)
            for group, gname in groups:
                outs = [torch.empty(n, dtype=dtype) for _ in range(p)]
                what = f"all_gather[direct,{gname}] {dtype} n={n}"
                if c.run(what, dist.all_gather, outs, x.clone(), group=group) is None:
                    c.check(same(outs, refs), what)
                for root in range(p):
                    t = x.clone() if rank == root else torch.zeros(n, dtype=dtype)
                    what = f"broadcast[direct,{gname}] root={root} {dtype} n={n}"
                    if c.run(what, dist.broadcast, t, src=root, group=group) is None:
                        c.check(same(t, refs[root]), what)
                out = torch.empty(n, dtype=dtype)
                what = f"reduce_scatter[direct,{gname}] {dtype} n={n}"
                if c.run(what, dist.reduce_scatter, out, [t.clone() for t in chunks],
                         group=group) is None:
                    c.check(same(out, rs_ref), what)
    # uneven (gloo: equal sizes only): rank q's block has 3000 + q elements
    sizes = [3000 + q for q in range(p)]
    inputs = [data(q, sizes[q], torch.int64, salt=9) for q in range(p)]
    outs = [torch.empty(m, dtype=torch.int64) for m in sizes]
    if c.run("all_gather[direct] uneven", dist.all_gather, outs, inputs[rank].clone()) is None:
        c.check(same(outs, inputs), "all_gather[direct] uneven")
    mine = [data(rank * p + j, sizes[j], torch.int64, salt=10) for j in range(p)]
    want = sum(data(q * p + rank, sizes[rank], torch.int64, salt=10) for q in range(p))
    out = torch.empty(sizes[rank], dtype=torch.int64)
    if c.run("reduce_scatter[direct] uneven", dist.reduce_scatter, out, mine) is None:
        c.check(same(out, want), "reduce_scatter[direct] uneven")
    for coll in DIRECT:
        for group, _ in groups:
            ringcomm.set_algorithm(coll, "auto", group=group)


def check_algorithm_context(ctx: Ctx) -> None:
    """The same through ringcomm.algorithm(...) on the subgroup, restored after."""
    c, small_seg = ctx.c, ctx.small_seg
    for algo in ALLREDUCE:
        with ringcomm.algorithm(algo, group=small_seg):
            t = torch.full((9,), float(ctx.rank))
            dist.all_reduce(t, group=small_seg)
        c.check(same(t, torch.full((9,), float(sum(range(ctx.p))))),
                f"ringcomm.algorithm({algo!r})")
        c.check(ringcomm.get_group(small_seg).get_algorithm("allreduce") == "auto",
                "algorithm() restores auto")


#: run in this order on every rank (the ranks must issue the same collectives)
CHECKS = [check_host_layout, check_allreduce_ops, check_allreduce_sizes,
          check_allreduce_large, check_allgather_bruck, check_alltoall_pairwise,
          check_direct, check_algorithm_context]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", default="none",
                    help="the host layout the group must see: 'none' (one host) or 0,0,1,...")
    ap.add_argument("--quick", action="store_true",
                    help="two dtypes (float32, int32) instead of all eight: for the runs "
                         "that exercise a launcher, not the algorithms")
    args = ap.parse_args()
    dtypes = (torch.float32, torch.int32) if args.quick else DTYPES
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    small_seg = dist.new_group(backend="ringcomm", pg_options=ringcomm.Options(segment_bytes=65536))
    ctx = Ctx(rank, dist.get_world_size(), Checker(rank), gloo, small_seg, dtypes, args)
    run_checks(CHECKS, ctx)
    done(ctx.c)


if __name__ == "__main__":
    sys.exit(main())
