"""An in-process NCCL stand-in that enforces NCCL's point-to-point rules on CPU tensors.

:class:`SimComm` implements the interface
:class:`~ringcomm.execution.executors.GroupProgram` drives
(:class:`~ringcomm.execution.executors.GroupComm`: group start, send, receive,
group end, local work on the stream), so the code that runs on the real NCCL runs here in CI. Groups, matching and
progress follow :mod:`ringcomm.execution.nccl_rules`; a schedule that would hang on a GPU
ends here in :class:`SimulatorError` naming the ranks and steps of the cycle.

Two ways to drive it:

* one thread: enqueue every rank's work, then :meth:`SimFabric.drain`;
* one thread per rank, as processes would: each enqueues and calls
  :meth:`SimComm.synchronize` (like ``stream.synchronize()``). When every rank
  is blocked or gone and nothing can move, each blocked rank gets the error.
"""
from __future__ import annotations

import threading
import time

import torch

from ringcomm import ops
from ringcomm.schedule import ScheduleError
from ringcomm.execution.nccl_rules import Rules


class SimulatorError(RuntimeError):
    """The enqueued work cannot complete under NCCL's rules (deadlock, unmatched
    message, size mismatch)."""


class SimFabric:
    """The shared streams of ``size`` simulated ranks."""

    def __init__(self, size: int):
        self.size = size
        self.rules = Rules(size, unit="bytes")
        self._cv = threading.Condition()
        self._blocked: set[int] = set()
        self._gone: set[int] = set()
        self._aborted: set[int] = set()
        self._error: str | None = None

    def comm(self, rank: int) -> "SimComm":
        return SimComm(self, rank)

    def drain(self) -> None:
        """Run all enqueued work to completion (single-threaded use).

        Raises:
            SimulatorError: it cannot complete under NCCL's rules.
        """
        with self._cv:
            try:
                self.rules.drain()
            except ScheduleError as e:
                raise SimulatorError(str(e)) from None

    def _progress(self) -> None:
        try:
            while self.rules.step_round():
                pass
        except ScheduleError as e:
            self._error = str(e)

    def _sync(self, rank: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._blocked.add(rank)
            try:
                while True:
                    if rank in self._aborted:
                        raise SimulatorError(f"rank {rank}: the communicator was aborted")
                    self._progress()
                    self._cv.notify_all()
                    if self._error is not None:
                        raise SimulatorError(self._error)
                    if not self.rules.queues[rank]:
                        return
                    # a blocked rank whose work is done is about to return, not stuck
                    waiting = {r for r in self._blocked if self.rules.queues[r]}
                    if len(waiting | self._gone) == self.size:
                        self._error = self.rules.stuck_report()
                        self._cv.notify_all()
                        raise SimulatorError(self._error)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise SimulatorError(f"rank {rank}: synchronize timed out after "
                                             f"{timeout_s:g}s with work pending")
                    self._cv.wait(min(left, 1.0))
            finally:
                self._blocked.discard(rank)

    def _leave(self, rank: int) -> None:
        with self._cv:
            self._gone.add(rank)
            self._cv.notify_all()

    def _abort(self, rank: int) -> None:
        with self._cv:
            self._aborted.add(rank)
            self._gone.add(rank)
            # its kernels end: nothing of its queued work runs any more, and no peer's
            # message lands in its buffers (which its owner may free now); peers that
            # wait for it are stuck, as on a GPU
            self.rules.queues[rank].clear()
            self._cv.notify_all()


class SimComm:
    """Rank ``rank``'s communicator and stream on a :class:`SimFabric`."""

    def __init__(self, fabric: SimFabric, rank: int):
        self.fabric = fabric
        self.rank = rank
        self.size = fabric.size
        self._group: list | None = None
        self._depth = 0

    # -- the GroupComm interface --------------------------------------------------
    def group_start(self) -> None:
        if self._depth == 0:
            self._group = []
        self._depth += 1

    def group_end(self, label: str = "") -> None:
        if self._depth == 0:
            raise SimulatorError(f"rank {self.rank}: group_end without group_start")
        self._depth -= 1
        if self._depth == 0:
            group, self._group = self._group, None
            with self.fabric._cv:
                self.fabric.rules.add_group(self.rank, group, label or "group")
                self.fabric._cv.notify_all()

    def close_groups(self) -> None:
        """Drop a group an exception left open (nothing of it was enqueued)."""
        self._depth, self._group = 0, None

    def send(self, buf: torch.Tensor, peer: int) -> None:
        self._op("send", buf, peer, lambda: buf)

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        def put(data: torch.Tensor) -> None:
            _bytes(buf).copy_(_bytes(data))
        self._op("recv", buf, peer, put)

    def local_reduce(self, dst: torch.Tensor, src: torch.Tensor, op,
                     src_first: bool = False) -> None:
        self._local(lambda: ops.reduce_(dst, src, op, src_first))

    def local_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._local(lambda: dst.copy_(src))

    # -- stream control -------------------------------------------------------------
    def synchronize(self, timeout_s: float = 30.0) -> None:
        """Block until this rank's enqueued work completed.

        Raises:
            SimulatorError: it cannot complete under NCCL's rules.
        """
        self.fabric._sync(self.rank, timeout_s)

    def close(self) -> None:
        """This rank enqueues nothing more."""
        self.fabric._leave(self.rank)

    def abort(self) -> None:
        """Like ``ncclCommAbort``: a :meth:`synchronize` of this rank, running or
        later, raises; peers waiting for this rank get the stuck report."""
        self.fabric._abort(self.rank)

    def _op(self, kind: str, buf: torch.Tensor, peer: int, payload) -> None:
        nbytes = buf.numel() * buf.element_size()
        if self._group is not None:
            self._group.append((kind, peer, nbytes, payload))
        else:  # NCCL wraps a lone call in a group of its own
            with self.fabric._cv:
                self.fabric.rules.add_group(self.rank, [(kind, peer, nbytes, payload)], kind)
                self.fabric._cv.notify_all()

    def _local(self, fn) -> None:
        if self._group is not None:
            raise SimulatorError(f"rank {self.rank}: local work inside a group")
        with self.fabric._cv:
            self.fabric.rules.add_local(self.rank, fn, "local")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)
