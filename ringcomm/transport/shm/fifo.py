"""The FIFOs between two ranks on one host: each rank's outbox to a peer is a ring
of slots with a head counter (chunks published), and the peer's tail counter
(chunks consumed) frees them. A message is cut into slot-sized chunks, each
published with its tag and the message's size: messages between a pair match in
the order they were started, and one of another call or size shows at its first
chunk (:func:`refuse`). Every publication is *data, fence, counter* and every
consumption *counter, fence, data, fence, counter* (the package's docstring)."""
from __future__ import annotations

import collections
from typing import Any, Sequence

import numpy as np

from ringcomm import ops
from ringcomm.transport.base import Handle, TransportMismatch

_copy = ops.serial_copy


class Pair:
    """This rank's side of the two FIFOs with one peer on its host. ``out`` and
    ``in_`` are this rank's and the peer's segments as 8-byte integers; the other
    integer fields are places in them."""

    __slots__ = ("peer", "out", "in_", "head_out", "meta_out", "tail_in", "head_in", "meta_in",
                 "tail_peer", "slots_out", "slots_in", "sent", "got", "sendq", "recvq", "held")

    def __init__(self, peer: int):
        self.peer = peer
        self.sent = 0  # chunks published to the peer (the value at head_out)
        self.got = 0  # chunks consumed from the peer (the value at tail_in)
        self.sendq: collections.deque = collections.deque()
        self.recvq: collections.deque = collections.deque()
        #: received messages left in the peer's slots until a local step reads them
        #: (``ShmTransport.recv_held_init``), oldest first
        self.held: collections.deque = collections.deque()


class Msg:
    """One message of a schedule over shared memory: its chunks of the caller's memory,
    each with its view of every slot it may go through, and its progress."""

    __slots__ = ("pair", "chunks", "views", "n", "nbytes", "tag", "i", "done", "held", "first")

    def __init__(self, pair: Pair, mem: np.ndarray, tag: int, slots: list,
                 held: bool = False):
        size = slots[0].size
        self.pair, self.tag, self.nbytes = pair, tag, mem.size
        #: a receive whose data stays in the sender's slots, from chunk ``first`` on
        self.held, self.first = held, 0
        # at least one chunk: an empty message still takes its place in the order
        self.chunks = [mem[a:a + size] for a in range(0, max(mem.size, 1), size)]
        self.views = [[slot[:c.size] for slot in slots] for c in self.chunks]
        self.n = len(self.chunks)
        self.i = 0
        self.done = True  # inactive until started


class Batch:
    """Handles started or waited for together: their shared-memory messages (receives,
    sends, all) and the MPI transport's batch of the others."""

    __slots__ = ("recvs", "sends", "msgs", "handles", "mpi", "remote")

    def __init__(self, handles: Sequence[Handle], mpi: Any, remote: int):
        self.handles = tuple(handles)
        self.remote = remote
        self.recvs = tuple(h.req for h in handles if h.kind == "recv")
        self.sends = tuple(h.req for h in handles if h.kind == "send")
        self.msgs = self.recvs + self.sends
        self.mpi = mpi


def push(pair: Pair, nslots: int, fence) -> None:
    """Publish chunks of the pair's queued sends while slots are free."""
    q, out, meta = pair.sendq, pair.out, pair.meta_out
    k0 = k = pair.sent
    free = nslots - k + pair.in_[pair.tail_peer]
    while q and free > 0:
        m = q[0]
        i, n, chunks, views = m.i, m.n, m.chunks, m.views
        while i < n and free > 0:
            s = k % nslots
            c = chunks[i]
            if c.size:
                _copy(views[i][s], c)
            at = meta + 2 * s
            out[at] = m.tag
            out[at + 1] = m.nbytes
            i += 1
            k += 1
            free -= 1
        m.i = i
        if i < n:
            break
        q.popleft()
        m.done = True
    if k != k0:
        pair.sent = k
        fence()  # the chunks and their tags before the count that publishes them
        out[pair.head_out] = k


def pull(pair: Pair, nslots: int, fence) -> None:
    """Consume the chunks the peer published, into the pair's queued receives."""
    q, inp = pair.recvq, pair.in_
    k0 = k = pair.got
    avail = inp[pair.head_in] - k
    if avail <= 0 or not q:
        return
    fence()  # the count before the chunks it published
    meta = pair.meta_in
    while q and avail > 0:
        m = q[0]
        i, n, chunks, views = m.i, m.n, m.chunks, m.views
        if m.held:  # taken whole, left where it lies
            if avail < n:
                break
            at = meta + 2 * (k % nslots)
            if inp[at] != m.tag or inp[at + 1] != m.nbytes:
                refuse(pair, m, k0, k, inp[at], inp[at + 1], fence)
            m.first = k
            k += n
            avail -= n
            pair.held.append(m)
            q.popleft()
            m.done = True
            continue
        while i < n and avail > 0:
            s = k % nslots
            if i == 0:
                at = meta + 2 * s
                if inp[at] != m.tag or inp[at + 1] != m.nbytes:
                    refuse(pair, m, k0, k, inp[at], inp[at + 1], fence)
            c = chunks[i]
            if c.size:
                _copy(c, views[i][s])
            i += 1
            k += 1
            avail -= 1
        m.i = i
        if i < n:
            break
        q.popleft()
        m.done = True
    pair.got = k
    fence()  # the reads of the slots before the count that frees them
    pair.out[pair.tail_in] = pair.held[0].first if pair.held else k


def refuse(pair: Pair, m: Msg, k0: int, k: int, tag: int, size: int, fence) -> None:
    """The first chunk of the next message from the peer is not the one ``m``
    awaits (messages between a pair arrive in the order they were sent: another
    is the peer's other call): raise, having freed what was consumed."""
    if k != k0:
        pair.got = k
        fence()
        pair.out[pair.tail_in] = pair.held[0].first if pair.held else k
    if tag != m.tag:
        raise TransportMismatch(pair.peer, m.tag, tag)
    raise RuntimeError(f"received {size} bytes from rank {pair.peer} where {m.nbytes} "
                       "were expected: ranks passed different sizes to this collective")


def consume(work: tuple, m: Msg, nslots: int, fence) -> None:
    """A held receive read by its local step: ``work`` (fn, targets, sources) applied
    to the chunks where they lie, then the slots freed."""
    fn, targets, sources = work
    k = m.first
    for t, per_slot in zip(targets, sources):
        fn(t, per_slot[k % nslots])
        k += 1
    pair = m.pair
    held = pair.held
    held.remove(m)
    fence()  # the reads of the slots before the count that frees them
    pair.out[pair.tail_in] = held[0].first if held else pair.got
