"""A CPU transport of your own, in one file: messages through the c10d store.

The template that docs/architecture.md's "Writing a transport" walks through. It
is slow (every message is a store round trip) and needs nothing but torch, so it
shows the contract and nothing else. A real transport (TCP, UCX, an RDMA
library) keeps the same four methods and the same waits.

Use it from a training script::

    import store_transport                  # registers "store"
    dist.init_process_group("ringcomm")     # with RINGCOMM_TRANSPORT=store

or, for one group, ``Options(transport="store")``.
"""
from __future__ import annotations

import collections
import time
from typing import Sequence

import torch

import ringcomm
from ringcomm.transport import Handle, Transport, TransportAborted, TransportTimeout

#: the longest sleep between two looks at the store (a wait backs off to it)
_MAX_SLEEP_S = 0.01


class StoreTransport(Transport):
    """Rank ``rank`` of ``size``; a message is the store key
    ``{channel}/{src}-{dst}/{tag}/{n}``, its n-th with that tag from that sender,
    so messages with one tag between a pair match in the order they were started."""

    def __init__(self, store, rank: int, size: int, channel: int):
        super().__init__(rank, size, torch.device("cpu"))
        self.store, self.channel = store, channel
        self._sent: collections.Counter = collections.Counter()
        self._received: collections.Counter = collections.Counter()

    # 1. persistent requests: made once per prepared call, started many times
    def send_init(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        return Handle(None, buf, peer, "send", None, tag)

    def recv_init(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        if not buf.is_contiguous():
            raise ValueError("store transport: buffers must be contiguous")
        return Handle(None, buf, peer, "recv", None, tag)

    # 2. start: a send may complete at once (the store keeps a copy); a receive
    # learns which message it is
    def start(self, batch: Sequence[Handle]) -> None:
        for h in batch:
            src, dst = (self.rank, h.peer) if h.kind == "send" else (h.peer, self.rank)
            count = self._sent if h.kind == "send" else self._received
            n = count[h.peer, h.tag]
            count[h.peer, h.tag] = n + 1
            h.req = f"{self.channel}/{src}-{dst}/{h.tag}/{n}"
            if h.kind == "send":
                self.store.set(h.req, h.buf.view(-1).view(torch.uint8).numpy().tobytes())

    # 3. wait: every receive of the batch, by the collective's deadline, and ended
    # by interrupt(); a receive must get exactly its buffer's size
    def wait(self, batch: Sequence[Handle]) -> None:
        for h in batch:
            if h.kind == "send":
                continue
            sleep = 1e-5
            while not self.store.check([h.req]):
                if self._stop is not None:
                    raise TransportAborted(self._stop)
                if time.monotonic() >= self._deadline:
                    raise TransportTimeout(self.timeout_message([h]))
                time.sleep(sleep)
                sleep = min(2 * sleep, _MAX_SLEEP_S)
            data = self.store.get(h.req)
            self.store.delete_key(h.req)
            dst = h.buf.view(-1).view(torch.uint8)
            if len(data) != dst.numel():
                raise RuntimeError(f"received {len(data)} bytes from rank {h.peer} where "
                                   f"{dst.numel()} were expected")
            dst.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def connect(setup: ringcomm.GroupSetup) -> tuple[list, tuple]:
    """The factory ringcomm calls on every rank when a group is made: one transport
    per channel, and every rank's host number (found through the store)."""
    transports = [StoreTransport(setup.store, setup.rank, setup.size, k)
                  for k in range(setup.options.num_channels)]
    return transports, setup.hosts()


ringcomm.register_transport("store", connect, replace=True)
