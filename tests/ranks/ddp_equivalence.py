"""DDP on k ranks == one process on the concatenated batch (any k, run with mpiexec -n k).

Model: TinyLM (embedding, convolution, BatchNorm in eval mode, linear, a head
tied to the embedding); see _ddp_common for why eval-mode BatchNorm makes the
concatenated batch a valid oracle. Each rank builds its replica from a
*different* seed: DDP must broadcast rank 0's parameters and buffers, and the
oracle is built from rank 0's seed. Three SGD-with-momentum steps per case;
gradients are compared every step, parameters and buffers at the end, and the
replicas must be bitwise identical across ranks.

Usage: ddp_equivalence.py [--quick]   (--quick: ringcomm only, two cases)
"""
from __future__ import annotations

import sys

import torch

from _ddp_common import (buffers, compare_tensors, done, grads, init, lm_batch, lm_loss, params,
                         rank_slice, same_on_all_ranks, sgd, tiny_lm)
from ddp import DistributedDataParallel as DDP

STEPS = 3
PER_RANK = 2

# (bucket_cap_mb, gradient_as_bucket_view, find_unused_parameters, dtype)
CASES = [
    (25, False, False, torch.float64),      # default cap: the 1 MiB first bucket holds all
    (0.001, True, False, torch.float64),    # ~1 KiB buckets, gradients living in buckets
    (0.0001, False, True, torch.float64),   # one parameter per bucket, unused-param search
    (0.004, True, True, torch.float32),     # float32, view + unused search together
]
TOL = {torch.float64: (1e-9, 1e-12), torch.float32: (1e-4, 1e-6)}


def run_case(c, rank, world, group, backend, cap, view, unused, dtype):
    what = f"{backend} world={world} cap={cap}MB view={view} unused={unused} {dtype}"
    oracle = tiny_lm(seed=1000, dtype=dtype)
    model = tiny_lm(seed=1000 + rank, dtype=dtype)  # rank 0 matches the oracle
    ddp = DDP(model, process_group=group, bucket_cap_mb=cap, gradient_as_bucket_view=view,
              find_unused_parameters=unused)
    compare_tensors(c, f"{what}: params after construction", params(model), params(oracle),
                    0, 0)
    compare_tensors(c, f"{what}: buffers after construction", buffers(model),
                    buffers(oracle), 0, 0)
    opt, opt_o = sgd(ddp), sgd(oracle)
    rtol, atol = TOL[dtype]
    for step in range(STEPS):
        tokens, targets = lm_batch(seed=50 + step, n=PER_RANK * world)
        opt_o.zero_grad()
        lm_loss(oracle(tokens), targets).backward()
        opt.zero_grad()
        lm_loss(ddp(rank_slice(tokens, rank, world)), rank_slice(targets, rank, world)).backward()
        compare_tensors(c, f"{what}: step {step} grads", grads(model), grads(oracle), rtol, atol)
        opt.step()
        opt_o.step()
    compare_tensors(c, f"{what}: final params", params(model), params(oracle), rtol, atol)
    compare_tensors(c, f"{what}: final buffers", buffers(model), buffers(oracle), 0, 0)
    same_on_all_ranks(c, f"{what}: replicas", list(model.parameters()), group)


def main() -> None:
    quick = "--quick" in sys.argv
    rank, world, groups, c = init()
    backends = ["ringcomm"] if quick else ["ringcomm", "gloo"]
    cases = CASES[:2] if quick else CASES
    for backend in backends:
        for cap, view, unused, dtype in cases:
            c.run(f"{backend} cap={cap} view={view} unused={unused} {dtype}", run_case, c,
                  rank, world, groups[backend], backend, cap, view, unused, dtype)
    done(c)


if __name__ == "__main__":
    main()
