"""What the process group needs from the layer below, for one device.

:class:`Channel`: rank, size, device, scratch buffers, running a compiled
schedule (:meth:`Channel.execute`) and the library's own collectives. Two kinds:

* :class:`Transport` (MPI for CPU tensors, threads in tests): non-blocking
  point-to-point requests that a caller waits on. It moves contiguous tensors
  between the ranks of one group and knows nothing of collectives. One
  collective runs on a transport at a time (the engine guarantees it);
  :meth:`Transport.begin` sets the deadline every wait of that collective honours.
* :class:`ringcomm.transport.nccl.NcclTransport` (CUDA tensors): NCCL groups
  enqueued on a stream, never waited on by the transport itself.
"""
from __future__ import annotations

import abc
import time
from typing import Any, Sequence

import torch



class TransportTimeout(TimeoutError):
    """A wait passed the deadline of the running collective."""


class TransportAborted(RuntimeError):
    """The process group was shut down or aborted while a wait was in progress."""


class Handle:
    """An outstanding send or receive. ``buf`` keeps the memory alive until it completes."""

    __slots__ = ("req", "buf", "peer", "kind", "status")

    def __init__(self, req: Any, buf: torch.Tensor, peer: int, kind: str, status: Any = None):
        self.req = req
        self.buf = buf
        self.peer = peer  # -1: any source
        self.kind = kind
        self.status = status


def packed(chunks: Sequence[torch.Tensor]) -> tuple[int, list[int], list[int]] | None:
    """(base address, byte counts, byte displacements) when 1-D ``chunks`` lie back
    to back in memory, else None."""
    counts = [c.numel() * c.element_size() for c in chunks]
    base = next((c.data_ptr() for c in chunks if c.numel()), 0)
    displs, off = [], 0
    for c, n in zip(chunks, counts):
        if n and c.data_ptr() != base + off:
            return None
        displs.append(off)
        off += n
    return base, counts, displs


class Channel(abc.ABC):
    """One group's link between ``size`` ranks on one device; this process is ``rank``."""

    rank: int
    size: int
    device: torch.device

    def __init__(self, rank: int, size: int, device: torch.device):
        self.rank = rank
        self.size = size
        self.device = device
        self._scratch: dict[int, torch.Tensor] = {}
        self._views: dict[tuple, torch.Tensor] = {}

    @abc.abstractmethod
    def execute(self, plan: Any, views: list, op: Any) -> None:
        """Run compiled schedule ``plan`` (:class:`ringcomm.executors.Plan`) on
        ``views``, the tensors of its regions, reducing with ``op``."""

    # -- the library's own collectives (algorithm "native") ------------------------
    def check_native(self, collective: str, dtype: torch.dtype, op: Any) -> None:
        """Raise ValueError unless :meth:`native` can run ``collective`` on ``dtype``
        with ``op`` (called before anything is enqueued)."""
        raise ValueError(f"ringcomm {collective}: algorithm 'native' needs a transport with "
                         f"collectives of its own; {type(self).__name__} has none")

    def native(self, collective: str, bufs: list, layout: tuple, dtype: torch.dtype, op: Any,
               root: int) -> None:
        """Run the transport library's own ``collective`` on the caller's buffers,
        ordered and sized as for a schedule (``ringcomm.schedule.BUFFERS``)."""
        raise NotImplementedError(f"{type(self).__name__} has no collectives of its own")

    # -- local work ----------------------------------------------------------
    def scratch(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reusable work buffer of ``numel`` elements, distinct per ``slot``.

        Cached across collectives: fresh allocations of large buffers would pay page
        faults on every call. Contents are undefined.
        """
        key = (slot, numel, dtype)
        view = self._views.get(key)
        if view is not None:  # small collectives ask for the same view every call
            return view
        nbytes = numel * dtype.itemsize
        buf = self._scratch.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
            self._scratch[slot] = buf
            self._views = {k: v for k, v in self._views.items() if k[0] != slot}
        view = self._views[key] = buf[:nbytes].view(dtype)
        if len(self._views) > 256:
            self._views.clear()
        return view

    def close(self) -> None:
        """Release communicators. The channel is unusable afterwards."""


class Transport(Channel):
    """Point-to-point messaging among ``size`` ranks; this process is ``rank``.

    Subclasses implement :meth:`isend`, :meth:`irecv`, :meth:`wait_all` and
    :meth:`abandon`; helpers (send, recv, sendrecv) build on those. Schedules run
    on it with :func:`ringcomm.executors.run_p2p`.
    """

    #: collective tags are taken modulo this
    tag_limit: int = 1 << 30

    def __init__(self, rank: int, size: int, device: torch.device):
        super().__init__(rank, size, device)
        self._deadline = float("inf")
        self._what = ""
        self._tag = 0
        self._stop: str | None = None

    def interrupt(self, reason: str) -> None:
        """End every wait, running or later, with :class:`TransportAborted` (``reason``)
        within milliseconds; the transport is unusable afterwards."""
        self._stop = reason

    def stopped(self) -> bool:
        return self._stop is not None

    def execute(self, plan: Any, views: list, op: Any) -> None:
        from ..executors import run_p2p  # executors drive transports, not the reverse
        run_p2p(plan, self, views, op)

    # -- per-collective state ------------------------------------------------
    def begin(self, what: str, timeout_s: float, tag: int = 0) -> None:
        """Start a collective named ``what``; every wait in it ends by ``timeout_s`` from
        now, and its messages carry ``tag`` unless an algorithm passes its own."""
        self._what = what
        self._tag = tag
        self._deadline = time.monotonic() + timeout_s if timeout_s > 0 else float("inf")

    def end(self) -> None:
        """The collective finished normally."""
        self._deadline = float("inf")

    @abc.abstractmethod
    def abandon(self) -> None:
        """The collective failed: cancel what can be cancelled and keep the buffers of
        anything still in flight alive, so a late message cannot land in freed memory."""

    # -- messaging -----------------------------------------------------------
    @abc.abstractmethod
    def isend(self, buf: torch.Tensor, peer: int, tag: int | None = None) -> Handle:
        """Start sending contiguous ``buf`` to ``peer``; messages between a pair with
        the same tag arrive in the order they were sent. ``tag`` defaults to the
        running collective's."""

    @abc.abstractmethod
    def irecv(self, buf: torch.Tensor, peer: int, tag: int | None = None) -> Handle:
        """Start receiving into contiguous ``buf`` from ``peer``."""

    @abc.abstractmethod
    def wait_all(self, handles: Sequence[Handle]) -> None:
        """Block until every handle completed.

        Raises:
            TransportTimeout: the collective's deadline passed first.
            TransportAborted: :meth:`interrupt` was called.
        """

    def wait(self, handle: Handle) -> None:
        self.wait_all((handle,))

    def send(self, buf: torch.Tensor, peer: int, tag: int | None = None) -> None:
        self.wait(self.isend(buf, peer, tag))

    def recv(self, buf: torch.Tensor, peer: int, tag: int | None = None) -> None:
        self.wait(self.irecv(buf, peer, tag))

    def sendrecv(self, sendbuf: torch.Tensor, dst: int, recvbuf: torch.Tensor, src: int,
                 tag: int | None = None) -> None:
        """Send to ``dst`` and receive from ``src`` at once (deadlock-free in rings)."""
        r = self.irecv(recvbuf, src, tag)
        s = self.isend(sendbuf, dst, tag)
        self.wait_all((r, s))

    # -- user point-to-point (dist.send / dist.recv) ----------------------------
    # A channel of its own, apart from collectives, so user tags never mix with
    # collective traffic, and not bound to the running collective's deadline.
    def p2p_isend(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        """Start a user send (``dist.isend``)."""
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point channel")

    def p2p_irecv(self, buf: torch.Tensor, peer: int | None, tag: int) -> Handle:
        """Start a user receive; ``peer=None`` receives from any rank."""
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point channel")

    def p2p_wait(self, handle: Handle, deadline: float) -> bool:
        """Wait for a user send/receive until ``deadline`` (time.monotonic);
        False if it is still pending then."""
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point channel")

    def p2p_done(self, handle: Handle) -> bool:
        """True once the user send/receive completed (does not block)."""
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point channel")

    def p2p_cancel(self, handle: Handle) -> None:
        """Give up on a pending user receive (its buffer stays referenced)."""

    def p2p_source(self, handle: Handle) -> int:
        """The sender of a completed receive."""
        return handle.peer

    def timeout_message(self, pending: Sequence[Handle]) -> str:
        peers = sorted({f"{h.kind} {'to' if h.kind == 'send' else 'from'} rank {h.peer}"
                        for h in pending})
        return f"waiting for {', '.join(peers) or 'peers'}"

