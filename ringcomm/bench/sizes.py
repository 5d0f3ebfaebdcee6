"""What one row of the benchmark measures: the collectives, data types and ops it
knows, message sizes as nccl-tests counts them (parsing ``64M``, printing
``64 MiB``, the list from ``-b`` to ``-e``), and how a size becomes a buffer shape.

Pure Python: no torch, no MPI, so the offline analysis can use it too.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Callable

COLLECTIVES = ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall")
#: the collectives that take a reduction op (the others are listed with op "none")
REDUCING = {"allreduce", "reduce_scatter"}
#: nccl-tests' bus bandwidth factors: busbw = algbw * factor(p)
BUSBW_FACTOR: dict[str, Callable[[int], float]] = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "alltoall": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
}
#: nccl-tests type names -> bytes per element; aliases map to these names
ELEMENT_SIZE = {"int8": 1, "uint8": 1, "int32": 4, "int64": 8, "half": 2, "float": 4,
                "double": 8, "bfloat16": 2}
DTYPE_NAMES = tuple(ELEMENT_SIZE)
DTYPE_ALIASES = {"char": "int8", "int": "int32", "long": "int64", "float16": "half",
                 "fp16": "half", "float32": "float", "fp32": "float", "float64": "double",
                 "fp64": "double", "bf16": "bfloat16"}
#: the torch attribute of each data type name (``getattr(torch, TORCH_DTYPE[name])``)
TORCH_DTYPE = {"int8": "int8", "uint8": "uint8", "int32": "int32", "int64": "int64",
               "half": "float16", "float": "float32", "double": "float64",
               "bfloat16": "bfloat16"}
FLOATING = ("half", "float", "double", "bfloat16")
OP_NAMES = ("sum", "prod", "max", "min", "avg")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``"4"``, ``"64K"``, ``"1M"``, ``"2GiB"`` (K/M/G/T are powers of 1024).

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    m = _SIZE_RE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use bytes with an optional K, M, G or T suffix (e.g. 64M)")
    mult = 1024 ** " kmgt".index((m.group(2) or " ").lower())
    value = float(m.group(1)) * mult
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes")
    return int(value)


def format_size(n: float) -> str:
    """``4096`` -> ``"4 KiB"``; sizes that are not whole units keep bytes."""
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{int(n // mult)} {unit}"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{int(n)} B"


def message_sizes(minbytes: int, maxbytes: int, factor: float | None,
                  step: int | None) -> list[int]:
    """The requested sizes from ``minbytes`` to ``maxbytes`` (both included when reached)."""
    sizes, s = [], minbytes
    while s <= maxbytes:
        sizes.append(int(s))
        if minbytes == maxbytes:
            break
        nxt = s + step if step else (s * factor if s > 0 else 1)
        s = max(int(nxt), int(s) + 1)
    return sizes


@dataclasses.dataclass
class Shape:
    """One message: ``size`` bytes as nccl-tests reports it, ``count`` elements in all."""

    collective: str
    size: int
    count: int
    per_rank: int  # elements each rank contributes / receives per block


def shape_for(collective: str, size: int, esize: int, p: int) -> Shape:
    """Round ``size`` to whole elements (and whole blocks per rank where the
    collective splits the buffer), at least one element per rank."""
    if collective in ("allreduce", "broadcast"):
        count = max(1, size // esize)
        return Shape(collective, count * esize, count, count)
    per = max(1, size // esize // p)
    return Shape(collective, per * p * esize, per * p, per)


def auto_nbytes(collective: str, shape: Shape, esize: int) -> int:
    """The size ringcomm's ``auto`` is asked with: the tensor a rank passes in
    (the whole buffer for allreduce/broadcast/alltoall, one rank's block for
    allgather and reduce_scatter)."""
    if collective in ("allgather", "reduce_scatter"):
        return shape.per_rank * esize
    return shape.count * esize
