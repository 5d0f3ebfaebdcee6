"""The correctness check (``-c``): known input on every rank, the expected result
computed here independently of any implementation, and a count of the elements
a column got wrong.

The inputs are small integers, exact in every dtype and in any sum or product
over a few ranks, so the expected results are exact too (int8/uint8 wrap around
as the hardware does).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ringcomm.bench.columns import torch_dtype
from ringcomm.bench.sizes import FLOATING, Shape


def pattern(rank: int, n: int, dtype_name: str, op: str, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s test data: small integers, exact in every dtype and in
    any sum over few ranks, so the expected result is exact too."""
    i = np.arange(n, dtype=np.int64)
    if op == "prod":  # products of +-1 (and 1 or 2 on rank 0 for unsigned) stay exact
        if dtype_name == "uint8":
            v = np.where((i + rank) % 5 == 0, 2 if rank == 0 else 1, 1)
        else:
            v = np.where((i * 3 + rank + salt) % 4 == 0, -1, 1)
    elif dtype_name == "uint8":
        v = (i * 3 + rank * 7 + salt) % 11
    else:
        v = (i * 3 + rank * 7 + salt) % 11 - 5
    return v.astype(np.float64)


def expected_reduction(n: int, dtype_name: str, op: str, p: int) -> np.ndarray:
    """The reduction with ``op`` of every rank's :func:`pattern` over ``p`` ranks."""
    parts = [pattern(r, n, dtype_name, op) for r in range(p)]
    if op in ("sum", "avg"):
        e = np.sum(parts, axis=0)
        if op == "avg":
            e = e / p if dtype_name in FLOATING else np.trunc(e / p)
    elif op == "prod":
        e = np.prod(parts, axis=0)
    elif op == "min":
        e = np.min(parts, axis=0)
    else:
        e = np.max(parts, axis=0)
    if dtype_name == "uint8":
        e = np.mod(e, 256)
    elif dtype_name == "int8":
        e = (e + 128) % 256 - 128
    return e


def _tensor(values: np.ndarray, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.from_numpy(values).to(dtype=dtype, device=device)


def check(device: str, coll: str, shape: Shape, dtype_name: str, op: str, bufs: dict,
          call: Callable[[], None], sync: Callable[[], None], *, rank: int, p: int,
          root: int) -> int:
    """Fill ``bufs`` (on ``device``) with this rank's known data, run ``call`` once
    and return the number of elements of the result that are wrong on this rank."""
    dtype = torch_dtype(dtype_name)
    inp, out = bufs["inp"], bufs["out"]
    sentinel = 99
    if coll == "allreduce":
        inp.copy_(_tensor(pattern(rank, shape.count, dtype_name, op), dtype, device))
        expect = expected_reduction(shape.count, dtype_name, op, p)
    elif coll == "broadcast":
        if rank == root:
            inp.copy_(_tensor(pattern(root, shape.count, dtype_name, op), dtype, device))
        else:
            inp.fill_(sentinel)
        expect = pattern(root, shape.count, dtype_name, op)
    elif coll == "allgather":
        inp.copy_(_tensor(pattern(rank, shape.per_rank, dtype_name, op), dtype, device))
        out.fill_(sentinel)
        expect = np.concatenate([pattern(j, shape.per_rank, dtype_name, op) for j in range(p)])
    elif coll == "reduce_scatter":
        inp.copy_(_tensor(pattern(rank, shape.count, dtype_name, op), dtype, device))
        out.fill_(sentinel)
        full = expected_reduction(shape.count, dtype_name, op, p)
        expect = full[rank * shape.per_rank:(rank + 1) * shape.per_rank]
    else:  # alltoall: block j of rank r goes to rank j
        inp.copy_(_tensor(pattern(rank, shape.count, dtype_name, op, salt=rank), dtype, device))
        out.fill_(sentinel)
        c = shape.per_rank
        expect = np.concatenate([pattern(j, shape.count, dtype_name, op, salt=j)
                                 [rank * c:(rank + 1) * c] for j in range(p)])
    call()
    sync()
    got = out.detach().to("cpu", torch.float64).numpy()
    if dtype.is_floating_point:
        eps = torch.finfo(dtype).eps
        bad = ~(np.abs(got - expect) <= 2 * eps * np.maximum(1.0, np.abs(expect)))
    else:
        bad = got != expect
    return int(np.count_nonzero(bad))
