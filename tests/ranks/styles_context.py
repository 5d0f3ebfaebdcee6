"""Per-rank program: torch's context parallelism
(``torch.distributed.tensor.experimental.context_parallel``) on CPU tensors, with the
sequence dimension sharded over ringcomm, against one process and against gloo.

What runs on CPU, and what does not (torch 2.13, read from
torch/distributed/tensor/experimental/_context_parallel/_attention.py):

  * torch's ring attention itself does not. ``_sdpa_handler`` dispatches only
    aten._scaled_dot_product_{flash,efficient,cudnn}_attention (and their
    backwards) to the ring kernels, and otherwise raises "CP only supports flash
    attention and memory efficient attention now."; none of those three ops has a
    CPU kernel ("Could not run 'aten::_scaled_dot_product_flash_attention' with
    arguments from the 'CPU' backend"). On CPU, SDPA's default choice is
    aten._scaled_dot_product_flash_attention_for_cpu, for which DTensor has no
    sharding strategy: with ``is_causal=True`` the forward raises, and with
    ``is_causal=False`` the backward raises (torch/distributed/tensor/
    _sharding_prop.py, propagate_op_sharding_non_cached):
        NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu
        [_backward].default does not have a sharding strategy registered.
    The SDPA backends EFFICIENT_ATTENTION and CUDNN_ATTENTION have no CPU kernel
    ("No viable backend for scaled_dot_product_attention was found").
  * What does run: inside ``context_parallel`` (which shards q, k, v along the
    sequence, with its head-tail load balancer when the length divides by 2 x world)
    SDPA forced to the MATH backend (``sdpa_kernel(SDPBackend.MATH)``) with
    ``is_causal=False``: the DTensor decomposition all-gathers the sharded k/v
    (all_gather_into_tensor) and reduce-scatters their gradients
    (reduce_scatter_tensor), both over the mesh's group. The default backend with
    ``is_causal=False`` runs forward only, correctly, but its first call spends
    75-90 s in DTensor's DecompShardingStrategy (sharding propagation through the
    decomposition of _scaled_dot_product_flash_attention_for_cpu), on gloo as on
    ringcomm, so it is left out (``forward_only`` in a case turns it on).
    ``is_causal=True`` with MATH raises
    "aten.add.Tensor got mixed torch.Tensor and DTensor" (the causal mask is a
    plain tensor), on gloo as on ringcomm.

Checked, over a DeviceMesh built on the ringcomm default group and on a gloo group
over the same ranks: the output and the gradients of q, k and v, put back in order
with ``context_parallel_unshard``, equal one process's SDPA on the whole sequence,
and equal the gloo run; the collectives are the same on both (CommDebugMode) and
there are some; q, k, v are restored whole after the context. Cases: float64 and
float32, a load-balanced sequence (4 x world) and one that is not (5 x world), and
an explicit ``scale``.

Run:
  OMP_NUM_THREADS=1 PYTHONPATH=. mpiexec -n 2 python tests/ranks/styles_context.py
  python -m torch.distributed.run --standalone --nproc-per-node=2 \
      tests/ranks/styles_context.py
(3 ranks work too.)
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import context_parallel_unshard
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Checker, done, init  # noqa: E402

BATCH, HEADS, HEAD_DIM = 2, 2, 4
TOL = {torch.float64: (1e-10, 1e-12), torch.float32: (1e-5, 1e-6)}


def cases(world: int) -> list[dict]:
    # name, dtype, sequence length, scale; forward_only (the default SDPA backend)
    # works too but is left out: see the module docstring
    return [
        {"name": "float64 balanced", "dtype": torch.float64, "seq": 4 * world},
        {"name": "float64 unbalanced", "dtype": torch.float64, "seq": 5 * world},
        {"name": "float32 balanced", "dtype": torch.float32, "seq": 4 * world},
        {"name": "float64 scale 0.3", "dtype": torch.float64, "seq": 4 * world, "scale": 0.3},
    ]


def inputs(case: dict) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(case["seq"] * 7 + (case["dtype"] == torch.float32))
    return [torch.randn(BATCH, HEADS, case["seq"], HEAD_DIM, generator=g, dtype=case["dtype"])
            for _ in range(3)]


def cotangent(out: torch.Tensor) -> torch.Tensor:
    """An elementwise function of the output: the same whether sharded or whole."""
    return 0.5 + out.detach()


def reference(case: dict) -> list[torch.Tensor]:
    """One process, the whole sequence: output, then the gradients of q, k, v."""
    q, k, v = (t.clone().requires_grad_(not case.get("forward_only")) for t in inputs(case))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, scale=case.get("scale"))
    if case.get("forward_only"):
        return [out.detach()]
    out.backward(cotangent(out))
    return [out.detach(), q.grad, k.grad, v.grad]


def sharded(case: dict, group) -> dict:
    """The same SDPA inside context_parallel over ``group``; results unsharded."""
    mesh = DeviceMesh.from_group(group, "cpu")
    whole = inputs(case)
    q, k, v = (t.clone() for t in whole)
    forward_only = case.get("forward_only", False)
    comm = CommDebugMode()
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        local_len = q.shape[2]
        try:
            for t in (q, k, v):
                t.requires_grad_(not forward_only)
            kernel = contextlib.nullcontext() if forward_only else sdpa_kernel(SDPBackend.MATH)
            with comm, kernel:
                out = F.scaled_dot_product_attention(q, k, v, scale=case.get("scale"))
                if not forward_only:
                    out.backward(cotangent(out))
            local = [out.detach().clone()]
            if not forward_only:
                local += [t.grad.clone() for t in (q, k, v)]
        finally:
            for t in (q, k, v):  # the context resizes them back on exit
                t.requires_grad_(False)
                t.grad = None
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    return {"results": context_parallel_unshard(mesh, local, [2] * len(local)),
            "local_len": local_len, "counts": counts,
            "restored": all(torch.equal(a, b) for a, b in zip((q, k, v), whole))}


def close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=atol)


def diff(a: torch.Tensor, b: torch.Tensor):
    return (a - b).abs().max().item() if a.shape == b.shape else f"shapes {a.shape}, {b.shape}"


def check_case(c: Checker, case: dict, ring, gloo, world: int) -> None:
    name = case["name"]
    rtol, atol = TOL[case["dtype"]]
    want = reference(case)
    ours = c.run(f"{name}: over ringcomm", sharded, case, ring)
    theirs = c.run(f"{name}: over gloo", sharded, case, gloo)
    if ours is None:
        return
    labels = ["output", "q.grad", "k.grad", "v.grad"][:len(want)]
    c.check(ours["local_len"] == case["seq"] // world,
            f"{name}: local sequence {ours['local_len']}, expected {case['seq'] // world}")
    c.check(ours["restored"], f"{name}: q, k, v not restored after the context")
    c.check(len(ours["results"]) == len(want), f"{name}: {len(ours['results'])} results")
    for label, got, ref in zip(labels, ours["results"], want):
        c.check(close(got, ref, rtol, atol),
                f"{name}: {label} differs from one process's SDPA: max diff {diff(got, ref)}")
    if theirs is None:
        return
    c.check(ours["counts"] == theirs["counts"],
            f"{name}: collectives {ours['counts']} differ from gloo's {theirs['counts']}")
    c.check(any("all_gather" in op and n > 0 for op, n in ours["counts"].items()),
            f"{name}: no all_gather recorded ({ours['counts']}): not distributed")
    for label, got, other in zip(labels, ours["results"], theirs["results"]):
        c.check(close(got, other, rtol, atol),
                f"{name}: {label} differs from gloo's: max diff {diff(got, other)}")


def main() -> None:
    rank, world, groups, c = init()
    ring, gloo = groups["ringcomm"], groups["gloo"]
    c.check(dist.get_backend(ring) == "ringcomm", f"default group is {dist.get_backend(ring)}")
    for case in cases(world):
        check_case(c, case, ring, gloo, world)
    done(c)


if __name__ == "__main__":
    main()
