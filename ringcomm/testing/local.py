"""An in-process transport: ranks are threads, messages are tensor copies.

For developing and testing algorithms without MPI: run any algorithm on any
number of ranks in one process (see :func:`ringcomm.testing.run_ranks`).
Matching follows MPI: messages between a pair with the same tag arrive in
the order they were sent.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Sequence

import torch

from ringcomm.transport.base import Handle, Transport, TransportAborted, TransportTimeout


class _Req:
    __slots__ = ("done", "error")

    def __init__(self):
        self.done = False
        self.error: str | None = None


class LocalFabric:
    """The shared mailboxes of ``size`` in-process ranks."""

    def __init__(self, size: int):
        self.size = size
        self.cv = threading.Condition()
        self._sends: dict = collections.defaultdict(collections.deque)
        self._recvs: dict = collections.defaultdict(collections.deque)

    def transport(self, rank: int) -> "LocalTransport":
        return LocalTransport(self, rank)

    def _post(self, box: dict, key: tuple, req: _Req, buf: torch.Tensor) -> None:
        with self.cv:
            box[key].append((req, buf))
            sends, recvs = self._sends[key], self._recvs[key]
            while sends and recvs:
                (sreq, sbuf), (rreq, rbuf) = sends.popleft(), recvs.popleft()
                src, dst = sbuf.view(-1).view(torch.uint8), rbuf.view(-1).view(torch.uint8)
                if src.numel() != dst.numel():
                    rreq.error = (f"received {src.numel()} bytes from rank {key[0]} where "
                                  f"{dst.numel()} were expected")
                else:
                    dst[:src.numel()].copy_(src)
                sreq.done = rreq.done = True
            self.cv.notify_all()


class LocalTransport(Transport):
    """Rank ``rank`` of a :class:`LocalFabric`."""

    def __init__(self, fabric: LocalFabric, rank: int):
        super().__init__(rank, fabric.size, torch.device("cpu"))
        self.fabric = fabric

    def send_init(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        return Handle(None, buf, peer, "send", None, tag)

    def recv_init(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        if not buf.is_contiguous():
            raise ValueError("ringcomm local transport: buffers must be contiguous")
        return Handle(None, buf, peer, "recv", None, tag)

    def start(self, batch: Sequence[Handle]) -> None:
        fabric = self.fabric
        for h in batch:
            h.req = _Req()
            if h.kind == "send":
                fabric._post(fabric._sends, (self.rank, h.peer, h.tag), h.req, h.buf)
            else:
                fabric._post(fabric._recvs, (h.peer, self.rank, h.tag), h.req, h.buf)

    def wait(self, handles: Sequence[Handle]) -> None:
        with self.fabric.cv:
            while not all(h.req.done for h in handles):
                if self._stop is not None:
                    raise TransportAborted(self._stop)
                left = self._deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeout(self.timeout_message(
                        [h for h in handles if not h.req.done]))
                self.fabric.cv.wait(min(left, 0.05))
        for h in handles:
            if h.req.error:
                raise RuntimeError(h.req.error)

    def abandon(self, handles: Sequence[Handle], keep=None) -> None:
        self.end()
