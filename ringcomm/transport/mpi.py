"""MPI point-to-point transport for CPU tensors (mpi4py).

Tensors are handed to MPI by address (``MPI.buffer.fromaddress``), as bytes:
no copy, and every dtype (bfloat16 included) travels the same way.

Waiting polls ``Testall`` so every wait can honour the collective's deadline
(``MPI_Wait`` cannot time out). MPI moves large shared-memory
messages only inside MPI calls on both sides, so a rank that sleeps stalls
its peers' transfers: polling spins (yielding the core to co-located ranks
between polls) for up to ``RINGCOMM_SPIN_US`` (50 ms), which covers every
healthy transfer, and only then naps with exponential backoff up to
``RINGCOMM_MAX_SLEEP_US``, for peers that are late to a collective.
"""
from __future__ import annotations

import os
import time
from typing import Sequence

import torch
from mpi4py import MPI

from .base import Handle, Transport, TransportTimeout

_monotonic = time.monotonic
_yield = os.sched_yield
_testall = MPI.Request.Testall
_fromaddress = MPI.buffer.fromaddress
_BYTE = MPI.BYTE


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError as e:
        raise ValueError(f"ringcomm: environment variable {name} must be a number, "
                         f"got {os.environ[name]!r}") from e


class MPITransport(Transport):
    """Transport over an MPI intracommunicator whose ranks are the group's ranks.

    Args:
        comm: communicator owned by this transport (freed by :meth:`close`).
    """

    def __init__(self, comm: MPI.Intracomm):
        super().__init__(comm.Get_rank(), comm.Get_size(), torch.device("cpu"))
        self.comm = comm
        self.spin_s = _env_float("RINGCOMM_SPIN_US", 50000.0) * 1e-6
        self.max_sleep_s = _env_float("RINGCOMM_MAX_SLEEP_US", 500.0) * 1e-6
        self._inflight: list[Handle] = []
        self._abandoned: list[Handle] = []

    @staticmethod
    def _mem(buf: torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"ringcomm MPI transport: tensor on {buf.device}; only CPU tensors")
        if not buf.is_contiguous():
            raise ValueError("ringcomm MPI transport: buffers must be contiguous")
        return [_fromaddress(buf.data_ptr(), buf.numel() * buf.element_size()), _BYTE]

    def isend(self, buf: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        h = Handle(self.comm.Isend(self._mem(buf), peer, tag), buf, peer, "send")
        self._inflight.append(h)
        return h

    def irecv(self, buf: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        h = Handle(self.comm.Irecv(self._mem(buf), peer, tag), buf, peer, "recv")
        self._inflight.append(h)
        return h

    def wait_all(self, handles: Sequence[Handle]) -> None:
        reqs = [h.req for h in handles]
        if _testall(reqs):
            return
        spin_until = _monotonic() + self.spin_s
        nap = 20e-6
        while not _testall(reqs):
            now = _monotonic()
            if now >= self._deadline:
                pending = [h for h in handles if not h.req.Get_status()]
                raise TransportTimeout(self.timeout_message(pending))
            if now < spin_until:
                _yield()  # lets co-located ranks run when cores are oversubscribed
            else:
                time.sleep(nap)
                nap = min(nap * 2, self.max_sleep_s)

    def end(self) -> None:
        super().end()
        self._inflight.clear()

    def abandon(self) -> None:
        super().end()
        for h in self._inflight:
            try:
                if h.req.Get_status():
                    continue
                if h.kind == "recv":
                    h.req.Cancel()
            except MPI.Exception:
                pass
            self._abandoned.append(h)  # MPI may still touch h.buf
        self._inflight.clear()

    def close(self) -> None:
        if self.comm != MPI.COMM_NULL and not self._abandoned:
            try:
                self.comm.Free()
            except MPI.Exception:
                pass
        self.comm = MPI.COMM_NULL
