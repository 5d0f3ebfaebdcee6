"""Per-rank program: DTensor redistribution and collective-backed DTensor ops on
ringcomm device meshes, checked against gloo meshes and single-process references.

Run with ``mpiexec -n 4`` (1-D mesh of 4 and a 2x2 mesh) or ``mpiexec -n 3`` (1-D
mesh only; more uneven shards), or torchrun ``--nproc-per-node=4``::

    OMP_NUM_THREADS=1 PYTHONPATH=. mpiexec -n 4 python tests/ranks/styles_dtensor.py

Checked:

* distribute_tensor for Shard(d) / Replicate() placements, with rank 0's tensor as
  the source (the other ranks pass a perturbed one, which must not leak into the
  result): local shards equal torch.chunk of the global tensor (DTensor's split,
  empty shards included) and gloo's local shards.
* every redistribution the public ``redistribute`` API allows between Shard(d),
  Replicate() and Partial(op) (op: sum, avg, max, min, product; Partial sources
  built with ``DTensor.from_local`` from per-rank addends that reduce to the
  global tensor): on a 1-D mesh for an even shape, uneven shapes (7 and 10 rows
  or columns, a dimension of 3 on 4 ranks giving an empty shard) and a 3-D
  tensor; on a 2x2 mesh every pair of placements from {Shard(0), Shard(1),
  Replicate(), Partial(sum)} per mesh dimension (nested (Shard(0), Shard(0)),
  (Partial, Shard) -> (Replicate, Shard), ...), plus Partial(avg/max) sources.
  For each: the placements, the local tensor against the torch.chunk oracle and
  against gloo's local tensor of the same redistribution, and full_tensor()
  against the global tensor.
* DTensor ops needing collectives: matmuls of sharded operands (Partial results
  included), sum / amax / vector_norm over a sharded dimension, softmax over a
  sharded dimension, and gradients through redistribute, against plain tensors
  and against gloo.

Values are small integers in float64 (also float32 / int64 for a few cases), so
sums are exact and ringcomm must equal gloo bitwise; avg, softmax and norms are compared
with a 1e-12 tolerance.

Shard(i) -> Shard(j) redistribution on a CPU mesh gathers and chunks in torch (it
never calls all_to_all); the all-to-all op it would use, _dtensor.shard_dim_alltoall,
is checked directly, per mesh dim, on even shapes.

An empty local shard (6 rows on 4 ranks) makes amax over that dim raise on the
rank holding it, on any backend ("IndexError: amax(): Expected reduction dim 0 to
have non-zero size."): the op checks use 8 x 12 tensors.

torch refuses (public API, any backend): redistributing to a Partial placement
other than the current one ("Can not redistribute from R to P(sum),
redistributing to Partial is for internal use only!"); those pairs are printed
by rank 0 as ``refused:`` lines (run on gloo), not counted as checks.
"""
from __future__ import annotations

import itertools
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Checker, done, init  # noqa: E402

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import (  # noqa: E402
    DTensor, Partial, Replicate, Shard, distribute_tensor)

PARTIAL_OPS = ("sum", "avg", "max", "min", "product")


def diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if a.numel() == 0:
        return "max diff 0 (empty)"
    return f"max diff {(a.double() - b.double()).abs().max().item():.3g}"


def same(a: torch.Tensor, b: torch.Tensor, tol: float = 0.0) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if tol == 0.0:
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=tol, atol=tol)


def name(placements) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


def chunk_of(t: torch.Tensor, dim: int, n: int, k: int) -> torch.Tensor:
    """Shard k of n along dim, as DTensor splits: torch.chunk, missing chunks empty."""
    chunks = torch.chunk(t, n, dim=dim)
    if k < len(chunks):
        return chunks[k]
    shape = list(t.shape)
    shape[dim] = 0
    return t.new_empty(shape)


def oracle_local(value_at, placements, coords, shape) -> torch.Tensor:
    """The local tensor of a DTensor: ``value_at(partial coords)`` (the addend this
    rank holds before sharding), then sharded over the mesh dims in order."""
    partial_coords = tuple(c if p.is_partial() else None for p, c in zip(placements, coords))
    t = value_at(partial_coords)
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            t = chunk_of(t, p.dim, shape[i], coords[i])
    return t.contiguous()


def rand_int(shape, seed: int, dtype, lo=-9, hi=10) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def addends(G: torch.Tensor, placements, shape, seed: int):
    """``value_at(partial coords)``: per-rank addends whose reduction (the Partial
    op of each Partial mesh dim) over the Partial mesh dims is exactly ``G``."""
    ops = {p.reduce_op for p in placements if p.is_partial()}
    assert len(ops) <= 1, "one reduce op per case"
    op = ops.pop() if ops else None
    pdims = [i for i, p in enumerate(placements) if p.is_partial()]

    def noise(i, k, lo=-9, hi=10):
        return rand_int(G.shape, seed * 1000 + 37 * i + k, G.dtype, lo, hi)

    def zero_sum(i, k):  # noise over coordinate k of mesh dim i, summing to zero over k
        if k > 0:
            return noise(i, k)
        return -sum(noise(i, j) for j in range(1, shape[i]))

    def value_at(pc):
        if op is None:
            return G
        first = all(pc[i] == 0 for i in pdims)
        if op == "sum":
            v = G.clone() if first else torch.zeros_like(G)
            for i in pdims:
                v = v + zero_sum(i, pc[i])
            return v
        if op == "avg":
            v = G.clone()
            for i in pdims:
                v = v + zero_sum(i, pc[i])
            return v
        if op == "max":
            return G.clone() if first else G - noise(pdims[0], 1 + sum(pc[i] for i in pdims), 0, 5)
        if op == "min":
            return G.clone() if first else G + noise(pdims[0], 1 + sum(pc[i] for i in pdims), 0, 5)
        if op == "product":
            # factors 2 on some elements of the other ranks, G / 2^count on the first: exact
            total = 1
            for i in pdims:
                total *= shape[i]
            idx = 0
            for i in pdims:
                idx = idx * shape[i] + pc[i]
            masks = [noise(pdims[0], 500 + j, 0, 2).bool() for j in range(1, total)]
            if idx == 0:
                count = sum(m.to(G.dtype) for m in masks) if masks else torch.zeros_like(G)
                return G * torch.pow(0.5, count)
            return torch.where(masks[idx - 1], 2.0, 1.0).to(G.dtype)
        raise ValueError(op)

    return value_at


def reduced(value_at, src, dst, shape):
    """``value_at`` for ``dst``: the source addends reduced over the mesh dims that are
    Partial in ``src`` and not in ``dst`` (a Partial kept in ``dst`` keeps its addends)."""
    gone = [i for i, p in enumerate(src) if p.is_partial() and not dst[i].is_partial()]
    op = next((p.reduce_op for p in src if p.is_partial()), None)

    def at(pc):
        vals = []
        for combo in itertools.product(*(range(shape[i]) for i in gone)):
            full = list(c if src[i].is_partial() else None for i, c in enumerate(pc)) \
                if pc else [None] * len(src)
            for i, k in zip(gone, combo):
                full[i] = k
            vals.append(value_at(tuple(full)))
        if not gone:
            return vals[0]
        v = torch.stack(vals)
        if op == "sum":
            return v.sum(0)
        if op == "avg":
            return v.sum(0) / len(vals)
        if op == "max":
            return v.amax(0)
        if op == "min":
            return v.amin(0)
        if op == "product":
            return v.prod(0)
        raise ValueError(op)

    return at


class Meshes:
    def __init__(self, ring: DeviceMesh, gloo: DeviceMesh):
        self.ring, self.gloo = ring, gloo
        self.shape = tuple(ring.shape)
        self.coords = tuple(ring.get_coordinate())
        assert self.coords == tuple(gloo.get_coordinate())


def make_source(G, placements, m: Meshes, mesh: DeviceMesh, seed: int, rank: int):
    """A DTensor with global value G: from_local for Partial placements, else
    distribute_tensor (other ranks pass a perturbed G: rank 0 is the source)."""
    if any(p.is_partial() for p in placements):
        local = oracle_local(addends(G, placements, m.shape, seed), placements, m.coords,
                             m.shape)
        return DTensor.from_local(local, mesh, placements, shape=G.shape, stride=G.stride())
    mine = G if rank == 0 else G + 100 + rank
    return distribute_tensor(mine, mesh, placements)


def check_pair(c: Checker, what: str, G, src, dst, m: Meshes, seed: int, rank: int):
    tol = 1e-12 if any(p.is_partial() and p.reduce_op == "avg" for p in src) else 0.0
    want_src = oracle_local(addends(G, src, m.shape, seed), src, m.coords, m.shape)
    outs = {}
    for backend, mesh in (("ringcomm", m.ring), ("gloo", m.gloo)):
        d = make_source(G, src, m, mesh, seed, rank)
        outs[backend] = (d, d.redistribute(mesh, dst) if backend == "gloo" else None)
    d_ring = outs["ringcomm"][0]
    out_gloo = outs["gloo"][1]
    if not any(p.is_partial() for p in src):  # distribute_tensor on ringcomm
        c.check(same(d_ring.to_local(), want_src),
                f"{what}: distribute_tensor local vs torch.chunk oracle: "
                f"{diff(d_ring.to_local(), want_src)}")
        c.check(same(d_ring.to_local(), outs["gloo"][0].to_local()),
                f"{what}: distribute_tensor local vs gloo: "
                f"{diff(d_ring.to_local(), outs['gloo'][0].to_local())}")
    out = c.run(f"{what}: redistribute on ringcomm", d_ring.redistribute, m.ring, dst)
    if out is None:
        return
    loc = out.to_local()
    want = oracle_local(reduced(addends(G, src, m.shape, seed), src, dst, m.shape), dst,
                        m.coords, m.shape)
    c.check(tuple(out.placements) == tuple(dst),
            f"{what}: placements {name(out.placements)}, wanted {name(dst)}")
    c.check(same(loc, want, tol), f"{what}: local vs torch.chunk oracle: {diff(loc, want)}")
    c.check(same(loc, out_gloo.to_local(), tol),
            f"{what}: local vs gloo's: {diff(loc, out_gloo.to_local())}")
    full = c.run(f"{what}: full_tensor on ringcomm", out.full_tensor)
    if full is not None:
        c.check(same(full, G, tol), f"{what}: full_tensor vs global tensor: {diff(full, G)}")


def one_dim_pairs(ndim: int):
    base = [Shard(d) for d in range(ndim)] + [Replicate()]
    for src in base + [Partial(op) for op in PARTIAL_OPS]:
        for dst in base + ([src] if src.is_partial() else []):
            yield [src], [dst]


def two_dim_pairs():
    per_dim = [Shard(0), Shard(1), Replicate(), Partial("sum")]
    for src in itertools.product(per_dim, per_dim):
        targets = [[Shard(0), Shard(1), Replicate()] + ([s] if s.is_partial() else [])
                   for s in src]
        for dst in itertools.product(*targets):
            yield list(src), list(dst)
    # other Partial ops on one or both mesh dims
    for op in ("avg", "max"):
        for src in ([Partial(op), Shard(0)], [Shard(1), Partial(op)], [Partial(op), Partial(op)]):
            for dst in ([Replicate(), Replicate()], [Shard(0), Shard(1)], [Shard(1), Shard(1)]):
                yield src, dst


def check_redistribute(c: Checker, m1: Meshes, m2: Meshes | None, rank: int):
    seed = 0
    cases = [((8, 6), torch.float64), ((7, 10), torch.float64), ((3, 5), torch.float64),
             ((5, 4, 3), torch.float64)]
    for shape, dtype in cases:
        G = rand_int(shape, 10 + len(shape) * 100 + shape[0], dtype)
        for src, dst in one_dim_pairs(len(shape)):
            seed += 1
            what = f"1-D mesh {m1.shape} {tuple(shape)} {name(src)}->{name(dst)}"
            check_pair(c, what, G, src, dst, m1, seed, rank)
    # other dtypes: shards and replicas (Partial sum too, for float32)
    for dtype in (torch.float32, torch.int64):
        G = rand_int((7, 6), 77, dtype)
        for src, dst in one_dim_pairs(2):
            if src[0].is_partial() and (dtype == torch.int64 or src[0].reduce_op != "sum"):
                continue
            seed += 1
            check_pair(c, f"1-D mesh {dtype} (7, 6) {name(src)}->{name(dst)}", G, src, dst,
                       m1, seed, rank)
    if m2 is None:
        return
    for shape in ((7, 5), (4, 6)):
        G = rand_int(shape, 500 + shape[0], torch.float64)
        for src, dst in two_dim_pairs():
            seed += 1
            what = f"2-D mesh {m2.shape} {shape} {name(src)}->{name(dst)}"
            check_pair(c, what, G, src, dst, m2, seed, rank)


def check_shard_alltoall(c: Checker, m: Meshes):
    """Shard(i) -> Shard(j) on a CPU mesh: DTensor's redistribute gathers and chunks
    (torch's _collective_utils.shard_dim_alltoall: "CPU process group does not support
    alltoall yet, falling back with allgather + chunk!"), so ringcomm's all_to_all is
    reached by calling the op that the fallback replaces, per mesh dim, directly."""
    from torch.distributed._functional_collectives import _group_or_group_name, _resolve_group

    for mesh_dim in range(len(m.shape)):
        n = m.shape[mesh_dim]
        k = m.coords[mesh_dim]
        G = rand_int((2 * n, 3 * n, 2), 40 + mesh_dim, torch.float64)
        for gather_dim, shard_dim in ((0, 1), (1, 0), (0, 2), (2, 1)):
            if G.shape[shard_dim] % n or G.shape[gather_dim] % n:
                continue
            local = chunk_of(G, gather_dim, n, k).contiguous()
            want = chunk_of(G, shard_dim, n, k).contiguous()
            outs = {}
            for backend, mesh in (("gloo", m.gloo), ("ringcomm", m.ring)):
                group = _group_or_group_name(_resolve_group((mesh, mesh_dim)))

                def op(group=group):
                    out = torch.ops._dtensor.shard_dim_alltoall(local, gather_dim, shard_dim,
                                                                group)
                    return torch.ops._c10d_functional.wait_tensor(out)
                outs[backend] = c.run(f"shard_dim_alltoall on {backend}", op) \
                    if backend == "ringcomm" else op()
            got = outs["ringcomm"]
            if got is None:
                continue
            what = (f"mesh {m.shape} dim {mesh_dim} shard_dim_alltoall "
                    f"S({gather_dim})->S({shard_dim})")
            c.check(same(got, want), f"{what} vs torch.chunk oracle: {diff(got, want)}")
            c.check(same(got, outs["gloo"]), f"{what} vs gloo's: {diff(got, outs['gloo'])}")


def report_refusals(m: Meshes, rank: int):
    """Redistributions torch refuses in its public API (on gloo too): printed, not checked."""
    G = rand_int((4, 4), 3, torch.float64)
    for src in (Replicate(), Shard(0), Partial("sum")):
        for dst in (Partial("sum"), Partial("avg")):
            if src == dst:
                continue
            d = make_source(G, [src], m, m.gloo, 1, rank)
            try:
                d.redistribute(m.gloo, [dst])
                msg = "accepted"
            except Exception as e:  # noqa: BLE001
                msg = f"{type(e).__name__}: {e}"
            if rank == 0:
                print(f"refused: {src} -> {dst} on gloo: {msg}", flush=True)


# -- ops ------------------------------------------------------------------------------
class _Ops:
    """What the op checks share: the checker, the meshes, the inputs, and a run of an
    op on ringcomm's mesh and gloo's compared with both and with plain tensors."""

    def __init__(self, c: Checker, m: Meshes, what_mesh: str):
        self.c, self.m, self.what_mesh = c, m, what_mesh
        self.one = len(m.shape) == 1
        self.A = rand_int((7, 6), 901, torch.float64)
        self.B = rand_int((6, 5), 902, torch.float64)
        self.X = rand_int((8, 12), 903, torch.float64) / 4  # no empty shard: amax refuses one
        if self.one:
            self.mm_cases = [([Shard(1)], [Shard(0)]), ([Shard(0)], [Replicate()]),
                             ([Replicate()], [Shard(1)]), ([Shard(0)], [Shard(1)]),
                             ([Shard(1)], [Replicate()])]
            self.red_cases = [[Shard(0)], [Shard(1)]]
        else:
            self.mm_cases = [([Shard(0), Shard(1)], [Replicate(), Shard(0)]),
                             ([Shard(1), Shard(1)], [Shard(0), Shard(0)]),
                             ([Replicate(), Shard(1)], [Shard(1), Replicate()])]
            self.red_cases = [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)]]

    def check(self, what: str, fn, want, tol: float = 0.0) -> None:
        """``fn(mesh) -> (local, full)`` on gloo's mesh, then on ringcomm's: the local
        parts agree with gloo's, the full tensor with ``want``."""
        gl = fn(self.m.gloo)
        got = self.c.run(f"{self.what_mesh}: op on ringcomm", fn, self.m.ring)
        if got is None:
            return
        g_loc, g_full = got
        what = f"{self.what_mesh}: {what}"
        self.c.check(same(g_loc, gl[0], tol), f"{what}: local vs gloo's: {diff(g_loc, gl[0])}")
        self.c.check(same(g_full, want, tol),
                     f"{what}: full vs plain tensors: {diff(g_full, want)}")


def _local_and_full(out):
    return out.to_local().clone(), out.full_tensor()


def check_matmuls(o: _Ops) -> None:
    for pa, pb in o.mm_cases:
        o.check(f"matmul {name(pa)} @ {name(pb)}",
                lambda mesh, pa=pa, pb=pb: _local_and_full(
                    distribute_tensor(o.A, mesh, pa) @ distribute_tensor(o.B, mesh, pb)),
                o.A @ o.B)


def check_reductions(o: _Ops) -> None:
    X = o.X
    for pl in o.red_cases:
        for dim in (0, 1):
            o.check(f"sum(dim={dim}) of {name(pl)}", lambda mesh, pl=pl, dim=dim: _local_and_full(
                distribute_tensor(X, mesh, pl).sum(dim=dim)), X.sum(dim=dim))
            o.check(f"amax(dim={dim}) of {name(pl)}", lambda mesh, pl=pl, dim=dim: _local_and_full(
                distribute_tensor(X, mesh, pl).amax(dim=dim)), X.amax(dim=dim))
            o.check(f"softmax(dim={dim}) of {name(pl)}",
                    lambda mesh, pl=pl, dim=dim: _local_and_full(
                        torch.softmax(distribute_tensor(X, mesh, pl), dim=dim)),
                    torch.softmax(X, dim=dim), tol=1e-12)
        o.check(f"vector_norm of {name(pl)}", lambda mesh, pl=pl: _local_and_full(
            torch.linalg.vector_norm(distribute_tensor(X, mesh, pl))),
            torch.linalg.vector_norm(X), tol=1e-12)
        o.check(f"sum() of {name(pl)}", lambda mesh, pl=pl: _local_and_full(
            distribute_tensor(X, mesh, pl).sum()), X.sum())


def check_backward(o: _Ops) -> None:
    """Backward through redistribute and through a sharded matmul."""
    X, W = o.X, rand_int((8, 12), 904, torch.float64)
    if o.one:
        bw_cases = [([Shard(0)], [Replicate()]), ([Replicate()], [Shard(1)]),
                    ([Shard(0)], [Shard(1)]), ([Shard(1)], [Shard(0)])]
    else:
        bw_cases = [([Shard(0), Shard(1)], [Replicate(), Replicate()]),
                    ([Replicate(), Shard(0)], [Shard(1), Replicate()]),
                    ([Shard(0), Shard(0)], [Shard(1), Shard(0)])]
    for src, dst in bw_cases:
        def f(mesh, src=src, dst=dst):
            x = distribute_tensor(X, mesh, src).requires_grad_(True)
            w = distribute_tensor(W, mesh, dst)
            y = x.redistribute(mesh, dst)
            (y * y * w).sum().backward()
            return _local_and_full(x.grad)
        o.check(f"grad through redistribute {name(src)}->{name(dst)}", f, 2 * X * W)
    pa, pb = o.mm_cases[0]
    for which in (0, 1):
        def f(mesh, which=which):
            a = distribute_tensor(o.A, mesh, pa).requires_grad_(True)
            b = distribute_tensor(o.B, mesh, pb).requires_grad_(True)
            (a @ b).redistribute(mesh, [Replicate()] * len(o.m.shape)).pow(2).sum().backward()
            return _local_and_full((a, b)[which].grad)
        a0, b0 = o.A.clone().requires_grad_(True), o.B.clone().requires_grad_(True)
        (a0 @ b0).pow(2).sum().backward()
        o.check(f"matmul {name(pa)} @ {name(pb)} grad of {'AB'[which]}", f,
                (a0.grad, b0.grad)[which])


def check_ops(c: Checker, m: Meshes, what_mesh: str, rank: int):
    """DTensor ops that need collectives, each against plain tensors and gloo."""
    o = _Ops(c, m, what_mesh)
    for check in (check_matmuls, check_reductions, check_backward):
        check(o)


def main() -> None:
    rank, world, groups, c = init()
    gloo = groups["gloo"]

    m1 = Meshes(init_device_mesh("cpu", (world,), mesh_dim_names=("x",)),
                DeviceMesh.from_group(gloo, "cpu", mesh_dim_names=("x",)))
    c.check(dist.get_backend(m1.ring.get_group()) == "ringcomm"
            and dist.get_backend(m1.gloo.get_group()) == "gloo",
            "1-D meshes are not on ringcomm and gloo")
    m2 = None
    if world == 4:
        m2 = Meshes(init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b")),
                    init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"),
                                     backend_override={"a": "gloo", "b": "gloo"}))
        c.check([dist.get_backend(m2.ring.get_group(i)) for i in range(2)] == ["ringcomm"] * 2
                and [dist.get_backend(m2.gloo.get_group(i)) for i in range(2)] == ["gloo"] * 2,
                "2-D meshes are not on ringcomm and gloo")

    check_redistribute(c, m1, m2, rank)
    check_ops(c, m1, f"1-D mesh {m1.shape}", rank)
    if m2 is not None:
        check_ops(c, m2, f"2-D mesh {m2.shape}", rank)
    check_shard_alltoall(c, m1)
    if m2 is not None:
        check_shard_alltoall(c, m2)
    report_refusals(m1, rank)

    done(c)


if __name__ == "__main__":
    main()
