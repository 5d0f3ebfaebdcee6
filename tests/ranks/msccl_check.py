"""Per-rank program (3 ranks): MSCCL algorithms registered with ringcomm.register_msccl
run through torch.distributed and give gloo's results.

The hand-written XML files in DIR (tests/test_msccl.py writes them) and exports of
ringcomm's own schedules (ring allreduce, allgather and reduce-scatter, pairwise
all-to-all) are registered on every rank and chosen with set_algorithm; each
collective runs at sizes that are multiples of the chunks (one of them cut into
slices by a small segment) and is compared with gloo. A size the chunks do not
divide is refused with the multiple it needs, and the group goes on.

Usage: msccl_check.py DIR
"""
from __future__ import annotations

import pathlib
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm
from ringcomm import msccl
from _common import Checker


def main(folder: str) -> None:
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    rank, p = dist.get_rank(), dist.get_world_size()
    c = Checker(rank)
    gloo = dist.new_group(backend="gloo")
    small = dist.new_group(backend="ringcomm", pg_options=ringcomm.Options(segment_bytes=64))
    names = _register(folder, p)
    c.check(sorted(names) == ["allgather", "allreduce", "alltoall", "broadcast", "reduce",
                              "reduce_scatter"], f"registered {names}")
    g = torch.Generator().manual_seed(rank)
    for group in (None, small):
        for coll, algos in names.items():
            for name in algos:
                ringcomm.set_algorithm(coll, name, group=group)
                for n in (6, 600, 6006):
                    _compare(c, coll, name, n, group, gloo, g, rank, p)
                ringcomm.set_algorithm(coll, "auto", group=group)
    _chosen_by_options(c, rank, p)
    _refusals(c, p)
    _auto_band(c, rank, p)
    dist.barrier()
    dist.destroy_process_group()
    c.finish()


def _register(folder: str, p: int) -> dict[str, list[str]]:
    """The XML files in ``folder`` and exports of ringcomm's schedules, registered:
    collective -> names."""
    names: dict[str, list[str]] = {}
    for f in sorted(pathlib.Path(folder).glob("*.xml")):
        alg = msccl.load(f)
        names.setdefault(alg.collective, []).append(ringcomm.register_msccl(f))
    for coll, algo in (("allreduce", "ring"), ("allgather", "ring"),
                       ("reduce_scatter", "ring"), ("alltoall", "pairwise"),
                       ("broadcast", "tree"), ("reduce", "tree")):
        names.setdefault(coll, []).append(ringcomm.register_msccl(
            msccl.to_xml(coll, algo, p, chunks=2 * p), name=f"exported_{algo}_{coll}"))
    return names


def _compare(c: Checker, coll: str, name: str, n: int, group, gloo, g: torch.Generator,
             rank: int, p: int) -> None:
    """One call of ``coll`` (``n`` elements a block) on ``group`` with algorithm
    ``name`` gives gloo's result."""
    whole = coll in ("allreduce", "broadcast", "reduce")
    x = torch.randn(n if whole else n * p, generator=g)
    what = f"{coll}[{name}] n={n}{' seg64' if group else ''}"
    if coll in ("broadcast", "reduce"):  # exported for root 0
        ours, ref = x.clone(), x.clone()
        fn = dist.broadcast if coll == "broadcast" else dist.reduce
        c.run(what, fn, ours, 0, group=group)
        fn(ref, 0, group=gloo)
        if coll == "reduce" and rank != 0:  # only the root's is defined
            ours, ref = ours[:0], ref[:0]
    elif coll == "allreduce":
        ours, ref = x.clone(), x.clone()
        c.run(what, dist.all_reduce, ours, group=group)
        dist.all_reduce(ref, group=gloo)
    elif coll == "allgather":
        x = x[:n].contiguous()
        ours, ref = torch.empty(n * p), torch.empty(n * p)
        c.run(what, dist.all_gather_into_tensor, ours, x, group=group)
        dist.all_gather_into_tensor(ref, x, group=gloo)
    elif coll == "reduce_scatter":
        ours, ref = torch.empty(n), torch.empty(n)
        c.run(what, dist.reduce_scatter_tensor, ours, x, group=group)
        dist.reduce_scatter_tensor(ref, x, group=gloo)
    else:
        ours, ref = torch.empty(n * p), torch.empty(n * p)
        c.run(what, dist.all_to_all_single, ours, x, group=group)
        dist.all_to_all_single(ref, x, group=gloo)
    c.check(torch.allclose(ours, ref, rtol=1e-5, atol=1e-5),
            f"{what}: max diff {(ours - ref).abs().max().item() if ours.numel() else 0}")


def _chosen_by_options(c: Checker, rank: int, p: int) -> None:
    """Chosen for a group through Options(algorithms=...), as RINGCOMM_ALGO does."""
    chosen = dist.new_group(backend="ringcomm", pg_options=ringcomm.Options(
        algorithms={"allreduce": "exported_ring_allreduce"}))
    c.check(ringcomm.get_group(chosen).get_algorithm("allreduce") == "exported_ring_allreduce",
            "Options(algorithms=...) did not choose the MSCCL algorithm")
    t = torch.full((6 * p,), float(rank))
    c.run("allreduce on the Options group", dist.all_reduce, t, group=chosen)
    c.check(torch.equal(t, torch.full_like(t, float(sum(range(p))))), f"Options group: {t}")


def _refusals(c: Checker, p: int) -> None:
    """Another root than the XML's, and a count the chunks do not divide: refused on
    every rank, and the group goes on."""
    ringcomm.set_algorithm("broadcast", "exported_tree_broadcast")
    try:
        dist.broadcast(torch.ones(6), 1)
        c.check(False, "a broadcast from root 1 ran on an algorithm for root 0")
    except ValueError as e:
        c.check("this call's root is 1" in str(e), str(e))
    ringcomm.set_algorithm("broadcast", "auto")
    ringcomm.set_algorithm("allreduce", "exported_ring_allreduce")
    t = torch.ones(7)
    try:
        dist.all_reduce(t)
        c.check(False, "an allreduce of 7 elements over 6 chunks ran")
    except ValueError as e:
        c.case("msccl: a count the chunks do not divide", e)
        c.check("needs a multiple of 6 elements, got 7" in str(e), str(e))
    ringcomm.set_algorithm("allreduce", "auto")
    t = torch.ones(7)
    dist.all_reduce(t)
    c.check(torch.equal(t, torch.full((7,), float(p))), f"after the refusal: {t}")


def _auto_band(c: Checker, rank: int, p: int) -> None:
    """auto=True: auto runs it in its byte range (here all sizes), and a count its
    chunks do not divide runs auto's usual choice."""
    banded = ringcomm.register_msccl(msccl.to_xml("allreduce", "ring", p, chunks=2 * p),
                                     name="auto_ring", auto=True)
    c.check(ringcomm.get_group().algorithm_for("allreduce", 24) == banded,
            f"auto picks {ringcomm.get_group().algorithm_for('allreduce', 24)}")
    for n in (6 * p, 7, 6006):
        t = torch.full((n,), float(rank + 1))
        c.run(f"auto with the band, n={n}", dist.all_reduce, t)
        c.check(torch.equal(t, torch.full_like(t, float(sum(range(1, p + 1))))),
                f"auto with the band, n={n}: {t[:4]}")
    ringcomm.unregister_algorithm("allreduce", banded)
    c.check(ringcomm.get_group().algorithm_for("allreduce", 24) != banded, "band kept")


if __name__ == "__main__":
    main(sys.argv[1])
