"""``RINGCOMM_DEBUG=DETAIL``: before each collective, every rank's call is compared
with every other's (its operation, sizes, reduce op, root and dtype), so a
mismatch is named with the ranks that differ instead of hanging or mixing data.

A fingerprint is a fixed-length row of bytes; the rows are exchanged with the
built-in ring allgather, never with the group's choice of algorithm (that
choice is what may be wrong).
"""
from __future__ import annotations

import zlib

import torch

from ringcomm.algorithms import ring as _ring
from ringcomm.front.lanes import Lane
from ringcomm.front.planner import Planner, program

#: the operation's name in this many bytes, then this many int64 fields
NAME_BYTES, FINGERPRINT_FIELDS = 32, 5


def fingerprint(op: str, fields: list[int]) -> torch.Tensor:
    """The row that stands for a call: ``op`` then up to FINGERPRINT_FIELDS numbers."""
    if len(fields) > FINGERPRINT_FIELDS:
        raise ValueError(f"ringcomm: a DETAIL fingerprint has {FINGERPRINT_FIELDS} fields, "
                         f"{op} gave {len(fields)}")
    name = op.encode()[:NAME_BYTES].ljust(NAME_BYTES, b"\0")
    nums = torch.zeros(FINGERPRINT_FIELDS, dtype=torch.int64)
    nums[:len(fields)] = torch.tensor(fields, dtype=torch.int64)
    return torch.cat([torch.frombuffer(bytearray(name), dtype=torch.uint8),
                      nums.view(torch.uint8)])


def dtype_code(dtype: torch.dtype) -> int:
    """A dtype as a number for the fingerprint."""
    return zlib.crc32(str(dtype).encode())


_DTYPES = {dtype_code(d): str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}


def describe(row: torch.Tensor) -> str:
    """A fingerprint as text: the operation and its fields, dtypes by name."""
    name = bytes(row[:NAME_BYTES].tolist()).rstrip(b"\0").decode(errors="replace")
    fields = [_DTYPES.get(x, x) for x in row[NAME_BYTES:].clone().view(torch.int64).tolist()]
    return f"{name or '?'} [{', '.join(map(str, fields))}]"


class Fingerprints:
    """One group's comparisons: an allgather program per lane, made again when the
    planner starts a new epoch (its messages carry the epoch's tags)."""

    def __init__(self, planner: Planner):
        self.planner = planner
        self._programs: dict = {}
        self._epoch = planner.epoch

    def compare(self, lane: Lane, op: str, fields: list[int]) -> None:
        """Raise unless every rank runs ``op`` with these ``fields``.

        Raises:
            RuntimeError: naming this rank's call and every rank whose call differs.
        """
        pl = self.planner
        if pl.size == 1:
            return
        if self._epoch != pl.epoch:
            for prog in self._programs.values():
                prog.close()
            self._programs.clear()
            self._epoch = pl.epoch
        mine = fingerprint(op, fields)
        dev = lane.tp.device
        rows = torch.empty(pl.size, mine.numel(), dtype=torch.uint8, device=dev)
        prog = self._programs.get(lane)
        if prog is None:
            plan = pl.plan("allgather", "ring", _ring.allgather, (mine.numel(),) * pl.size,
                           0, torch.uint8)
            prog = self._programs[lane] = program(lane.tp, plan, torch.uint8, None, pl.epoch)
        prog.run([*rows.unbind(0), mine.to(dev)])
        rows = rows.cpu()  # on a stream: waits for the exchange
        bad = [r for r in range(pl.size) if not torch.equal(rows[r], mine)]
        if bad:
            theirs = "; ".join(f"rank {r} runs {describe(rows[r])}" for r in bad)
            raise RuntimeError(f"collective mismatch: rank {pl.rank} runs {describe(mine)}, "
                               f"but {theirs}")
