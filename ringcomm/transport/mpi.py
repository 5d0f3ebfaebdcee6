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
import threading
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
# One thread in MPI at a time, process-wide. MPI_THREAD_MULTIPLE is requested, but
# under torchrun (singletons joined through ports, UCX netmod) MPICH 4.3.2 lost
# messages when one thread posted receives while another tested requests (seen:
# a user irecv never matched while its message sat in UCX's unexpected queue).
# Each call is short and the polling loops release the lock between calls.
_mpi_lock = threading.Lock()


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError as e:
        raise ValueError(f"ringcomm: environment variable {name} must be a number, "
                         f"got {os.environ[name]!r}") from e


def poll(test, deadline: float, spin_s: float, max_sleep_s: float) -> bool:
    """Call ``test()`` until it returns True (then True) or ``deadline`` passes (False)."""
    if test():
        return True
    start = _monotonic()
    busy_until, spin_until = start + 20e-6, start + spin_s
    nap = 20e-6
    while not test():
        now = _monotonic()
        if now >= deadline:
            return False
        if now < busy_until:
            continue  # a peer on another core answers within microseconds
        if now < spin_until:
            _yield()  # lets co-located ranks run when cores are oversubscribed
        else:
            time.sleep(nap)
            nap = min(nap * 2, max_sleep_s)
    return True


def _locked_testall(reqs: list, statuses: list) -> bool:
    with _mpi_lock:
        return _testall(reqs, statuses)


class MPITransport(Transport):
    """Transport over an MPI intracommunicator whose ranks are the group's ranks.

    Args:
        comm: communicator owned by this transport (freed by :meth:`close`); a
            duplicate of it carries the user's point-to-point messages.
    """

    def __init__(self, comm: MPI.Intracomm):
        super().__init__(comm.Get_rank(), comm.Get_size(), torch.device("cpu"))
        self.comm = comm
        self.p2p_comm = comm.Dup()
        self.tag_ub = comm.Get_attr(MPI.TAG_UB) or 32767
        self.tag_limit = self.tag_ub + 1
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

    def isend(self, buf: torch.Tensor, peer: int, tag: int | None = None) -> Handle:
        mem = self._mem(buf)
        with _mpi_lock:
            req = self.comm.Isend(mem, peer, self._tag if tag is None else tag)
        h = Handle(req, buf, peer, "send")
        self._inflight.append(h)
        return h

    def irecv(self, buf: torch.Tensor, peer: int, tag: int | None = None) -> Handle:
        mem = self._mem(buf)
        with _mpi_lock:
            req = self.comm.Irecv(mem, peer, self._tag if tag is None else tag)
        h = Handle(req, buf, peer, "recv")
        self._inflight.append(h)
        return h

    def wait_all(self, handles: Sequence[Handle]) -> None:
        """Also checks that every receive got exactly its buffer's size: MPI reports
        only messages that are too long, and a short one would leave stale data."""
        reqs = [h.req for h in handles]
        statuses = [MPI.Status() for _ in reqs]
        try:
            done = poll(lambda: _locked_testall(reqs, statuses), self._deadline, self.spin_s,
                        self.max_sleep_s)
        except MPI.Exception as e:
            if e.Get_error_class() in (MPI.ERR_TRUNCATE, MPI.ERR_IN_STATUS):
                raise RuntimeError(
                    "a message was larger than its receive buffer: ranks passed different "
                    "sizes to this collective") from e
            raise
        if not done:
            with _mpi_lock:
                pending = [h for h in handles if not h.req.Get_status()]
            raise TransportTimeout(self.timeout_message(pending))
        for h, st in zip(handles, statuses):
            if h.kind == "recv":
                want = h.buf.numel() * h.buf.element_size()
                got = st.Get_count(_BYTE)
                if got != want:
                    raise RuntimeError(f"received {got} bytes from rank {h.peer} where {want} "
                                       "were expected: ranks passed different sizes to this "
                                       "collective")

    def _check_tag(self, tag: int) -> None:
        if not 0 <= tag <= self.tag_ub:
            raise ValueError(f"ringcomm: tag {tag} is out of range [0, {self.tag_ub}]")

    def p2p_isend(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        self._check_tag(tag)
        mem = self._mem(buf)
        with _mpi_lock:
            req = self.p2p_comm.Isend(mem, peer, tag)
        return Handle(req, buf, peer, "send")

    def p2p_irecv(self, buf: torch.Tensor, peer: int | None, tag: int) -> Handle:
        self._check_tag(tag)
        src = MPI.ANY_SOURCE if peer is None else peer
        mem = self._mem(buf)
        with _mpi_lock:
            req = self.p2p_comm.Irecv(mem, src, tag)
        return Handle(req, buf, -1 if peer is None else peer, "recv", MPI.Status())

    def p2p_wait(self, handle: Handle, deadline: float) -> bool:
        return poll(lambda: self.p2p_done(handle), deadline, self.spin_s, self.max_sleep_s)

    def p2p_done(self, handle: Handle) -> bool:
        # Test with a status: an any-source receive learns its sender here.
        with _mpi_lock:
            return handle.req == MPI.REQUEST_NULL or handle.req.Test(handle.status)

    def p2p_cancel(self, handle: Handle) -> None:
        try:
            with _mpi_lock:
                if handle.kind == "recv" and not handle.req.Get_status():
                    handle.req.Cancel()
        except MPI.Exception:
            pass
        self._abandoned.append(handle)

    def p2p_source(self, handle: Handle) -> int:
        return handle.peer if handle.peer >= 0 else handle.status.Get_source()

    def end(self) -> None:
        super().end()
        self._inflight.clear()

    def abandon(self) -> None:
        super().end()
        for h in self._inflight:
            try:
                with _mpi_lock:
                    if h.req.Get_status():
                        continue
                    if h.kind == "recv":
                        h.req.Cancel()
            except MPI.Exception:
                pass
            self._abandoned.append(h)  # MPI may still touch h.buf
        self._inflight.clear()

    def close(self) -> None:
        if not self._abandoned:
            for comm in (self.comm, self.p2p_comm):
                if comm != MPI.COMM_NULL:
                    try:
                        with _mpi_lock:
                            comm.Free()
                    except MPI.Exception:
                        pass
        self.comm = self.p2p_comm = MPI.COMM_NULL
