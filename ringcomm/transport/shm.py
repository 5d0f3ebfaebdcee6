"""Shared-memory transport: the ranks of a group that share a host exchange a
schedule's messages through memory they all map, without MPI's request machinery.

Each rank owns one segment (a file in ``RINGCOMM_SHM_DIR``, ``/dev/shm`` by
default) holding, for every other rank on its host, an outbox: a FIFO of
``RINGCOMM_SHM_SLOTS`` slots of ``RINGCOMM_SHM_SLOT_BYTES`` each, and a counter of
the chunks it published there (``head``). A receiver keeps, in its own segment, a
counter of the chunks it consumed from each peer (``tail``). A message is cut into
slot-sized chunks; the sender copies a chunk into the next free slot, writes its
tag and the message's size beside it and advances ``head``; the receiver, seeing
``head`` ahead of ``tail``, checks the tag and size, copies the chunk out and
advances ``tail``, which frees the slot. Messages between a pair therefore match in
the order they were started, as MPI's do; a message of another call shows at once
(its tag), as does one of another size.

Ranks on other hosts (a group over several hosts) are reached through the MPI
transport this one wraps, as are users' ``dist.send``/``dist.recv`` and MPI's own
collectives (``native``): a schedule's messages go over shared memory where the
peer shares the host, over MPI elsewhere, within one step.

Memory ordering (x86 orders plain stores but not non-temporal ones, which large
copies use; ARM orders neither): every publication is *data, fence, counter* and
every consumption *counter, fence, data, fence, counter*. The fence is
``MPI_Win_sync`` on a window of this process, which MPICH implements as a full
memory barrier (``MPL_atomic_read_write_barrier``: ``mfence`` on x86, ``dmb ish``
on ARM). A counter is one aligned 8-byte store or load (numpy's element access),
which neither architecture tears. A sender reads ``tail`` before it overwrites a
slot and only writes once that load has returned a value that frees the slot: a
store that depends on a load through a branch is not made visible before the load
on either architecture (docs/architecture.md, "Shared memory").

Never hang, never leak: every wait honours the collective's deadline and backs off
from spinning to sleeping (:class:`ringcomm.backoff.Backoff`); a long wait looks at
the peers it waits on, and a peer whose process is gone, or that wrote a failure
into its segment, ends the wait with :class:`TransportPeerFailed` naming its rank
and host. Segments are unlinked as soon as every rank has mapped them, so a rank
killed afterwards leaves nothing in the directory; their space is allocated when
they are made (``posix_fallocate``), so a directory too small fails then, naming
what was needed and what was free, and the group runs over MPI instead.
"""
from __future__ import annotations

import collections
import logging
import mmap
import os
import socket
import time
import uuid
from typing import Any, Sequence

import numpy as np
import torch

from ringcomm import machine, mpi_serial, ops, settings
from ringcomm.backoff import Backoff
from ringcomm.transport import shm_direct
from ringcomm.mismatch import mismatch
from ringcomm.transport.base import (Handle, Signs, Transport, TransportAborted,
                                     TransportMismatch, TransportPeerFailed, TransportTimeout)

log = logging.getLogger("ringcomm")

_monotonic = time.monotonic
_INF = float("inf")
_copy = ops.serial_copy

#: a counter's own stretch of memory: two cache lines, so the adjacent-line prefetcher
#: never makes two writers share one
_LINE = 128
#: the header: ints (magic, pid, failure length) then the failure text
_HEADER = 512
_TEXT_AT, _TEXT_MAX = 128, _HEADER - 128
_MAGIC = 0x52494E47434F4D4D  # "RINGCOMM"
#: slots start page-aligned (copies of whole slots run at full speed)
_PAGE = 4096
#: spin this long before yielding the core
_BUSY_S = 100e-6
#: a wait this long starts looking at the peers it waits on (then at this interval)
_PROBE_S = 0.05
#: a shared-memory wait lets MPI progress this often
_POKE_S = 20e-6


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


class Geometry:
    """Where things lie in a segment of a rank with ``npeers`` peers on its host.

    Layout: the header; ``npeers`` tail counters (one per peer, in the order of the
    owner's peer list); ``npeers`` outboxes, each a head counter, ``slots`` (tag,
    size) pairs and ``slots`` data slots of ``slot_bytes``; where ``direct_bytes``,
    the window of :mod:`ringcomm.transport.shm_direct`: a page of two lines (one per
    buffer: round, signature, epoch) and two buffers of ``direct_bytes``.
    """

    __slots__ = ("npeers", "slots", "slot_bytes", "meta_bytes", "outbox_bytes",
                 "direct_bytes", "nbytes")

    def __init__(self, npeers: int, slots: int, slot_bytes: int, direct_bytes: int = 0):
        self.npeers, self.slots = npeers, slots
        self.slot_bytes = _round(slot_bytes, _PAGE)
        self.meta_bytes = _round(16 * slots, _LINE)
        self.outbox_bytes = _round(_LINE + self.meta_bytes, _PAGE) + slots * self.slot_bytes
        self.direct_bytes = _round(direct_bytes, _PAGE)
        self.nbytes = self.window_at() + (_PAGE + 2 * self.direct_bytes
                                          if self.direct_bytes else 0)

    def tail_at(self, j: int) -> int:
        return _HEADER + j * _LINE

    def outbox_at(self, j: int) -> int:
        return _round(_HEADER + self.npeers * _LINE, _PAGE) + j * self.outbox_bytes

    def slot_at(self, j: int, s: int) -> int:
        return self.outbox_at(j) + _round(_LINE + self.meta_bytes, _PAGE) + s * self.slot_bytes

    def window_at(self) -> int:
        """The window's page of lines; its buffers follow it."""
        return self.outbox_at(self.npeers)

    def line_at(self, b: int) -> int:
        """The line of window buffer ``b``: round, signature, epoch."""
        return self.window_at() + b * _LINE


class Window:
    """The windows of every rank of a group on one host (:mod:`ringcomm.transport.shm_direct`):
    ``nbytes`` per buffer; each rank's two buffers, and its two lines as word indices
    into its segment's words."""

    __slots__ = ("nbytes", "words", "lines", "_buffers")

    def __init__(self, geo: Geometry, maps_in_rank_order: list):
        self.nbytes = geo.direct_bytes
        #: per rank, its segment as 8-byte words
        self.words = [words for _, words in maps_in_rank_order]
        self.lines = (geo.line_at(0) // 8, geo.line_at(1) // 8)
        at = geo.window_at() + _PAGE
        self._buffers = tuple([np.frombuffer(mm, dtype=np.uint8, count=self.nbytes,
                                             offset=at + b * self.nbytes)
                               for mm, _ in maps_in_rank_order] for b in (0, 1))

    def buffers(self, b: int) -> list:
        """Buffer ``b`` of every rank, in rank order (bytes)."""
        return self._buffers[b]


def _fence_window():
    """``MPI_Win_sync`` of a window over this process (a full memory barrier in MPICH)
    and the window (to free)."""
    from mpi4py import MPI

    mem = np.zeros(1, dtype=np.int64)
    with mpi_serial.LOCK:
        win = MPI.Win.Create(mem, comm=MPI.COMM_SELF)
        win.Lock_all()  # Win_sync needs a passive-target epoch
    return win.Sync, (win, mem)


class _Pair:
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
        #: (:meth:`ShmTransport.recv_held_init`), oldest first
        self.held: collections.deque = collections.deque()


class _Msg:
    """One message of a schedule over shared memory: its chunks of the caller's memory,
    each with its view of every slot it may go through, and its progress."""

    __slots__ = ("pair", "chunks", "views", "n", "nbytes", "tag", "i", "done", "held", "first")

    def __init__(self, pair: _Pair, mem: np.ndarray, tag: int, slots: list,
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


class _Batch:
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


class ShmTransport(Transport):
    """Shared memory to the ranks on this host, ``inner`` (MPI) to the others.

    Made by :func:`connect`, collectively; ``pairs`` maps each local peer to its
    FIFOs. ``inner`` is owned (closed by :meth:`close`).
    """

    Mismatch = TransportMismatch

    holds_receives = True

    def __init__(self, inner: Transport, pairs: dict[int, _Pair], geometry: Geometry,
                 maps: list, map_index: dict[int, int], pids: dict[int, int], host: str):
        super().__init__(inner.rank, inner.size, inner.device)
        self.inner = inner
        self.tag_limit = inner.tag_limit
        self.pairs = pairs
        self.geometry = geometry
        self._pair_list = list(pairs.values())
        self._maps = maps  # (mmap, its int64 view) per segment mapped: own first
        self._map_index = map_index  # rank -> its segment's place in _maps
        #: the files the segments were made as (unlinked once every rank mapped them)
        self.segments: list[str] = []
        self._pids = pids  # peer -> pid, where this process can see the peer's
        self._host = host
        self._nslots = geometry.slots
        self._fence, self._window = _fence_window()
        #: the memory barrier (a full one: MPI_Win_sync)
        self.fence = self._fence
        self._broken: str | None = None
        #: messages numbered like awaited ones but of other calls, seen on the other path
        #: in the running wait (:meth:`_same_number`)
        self._signs = Signs()
        #: MPI progress while waiting on shared memory (its transfers to other hosts and
        #: users' messages move only inside MPI calls), at most every _POKE_S
        self._poke = inner.poke
        self._user_pending = inner.user_pending
        self._next_poke = 0.0
        #: messages to other hosts started and not yet waited for
        self._mpi_out = 0
        inner.idle_hook = self.progress
        inner.probe_hook = self._came_here
        #: every rank's window, where every rank of the group is on this host
        #: (:mod:`ringcomm.transport.shm_direct`); None elsewhere
        self.direct: Window | None = None
        #: rounds of shm_direct done (the same on every rank between collectives)
        self.rounds = 0
        #: messages below this size go over MPI, whose eager path is faster there
        self.min_bytes = settings.get("RINGCOMM_SHM_MIN_BYTES")
        self.spin_s = settings.get("RINGCOMM_SPIN_US") * 1e-6
        self.max_sleep_s = settings.get("RINGCOMM_MAX_SLEEP_US") * 1e-6

    # -- the group's front sets peer_failure; MPI's waits look at it too ---------------
    @property
    def peer_failure(self):  # type: ignore[override]
        return self.inner.peer_failure

    @peer_failure.setter
    def peer_failure(self, fn) -> None:
        self.inner.peer_failure = fn

    def local_peers(self) -> list[int]:
        """The group ranks reached through shared memory."""
        return sorted(self.pairs)

    # -- per collective -------------------------------------------------------------
    def begin(self, timeout_s: float) -> None:
        super().begin(timeout_s)
        self.inner.begin(timeout_s)

    def end(self) -> None:
        super().end()
        self.inner.end()
        self._mpi_out = 0

    def interrupt(self, reason: str) -> None:
        super().interrupt(reason)
        self.inner.interrupt(reason)

    # -- persistent messages -------------------------------------------------------
    def _memory(self, buf: torch.Tensor) -> np.ndarray:
        if not buf.is_cpu:
            raise ValueError(f"ringcomm shared-memory transport: tensor on {buf.device}; "
                             "only CPU tensors")
        if not buf.is_contiguous():
            raise ValueError("ringcomm shared-memory transport: buffers must be contiguous")
        return ops.memory(buf.data_ptr(), buf.nbytes)

    def _route(self, buf: torch.Tensor, peer: int) -> _Pair | None:
        """The pair a message of ``buf`` to or from ``peer`` goes through; None: MPI
        (another host, or a message below ``RINGCOMM_SHM_MIN_BYTES``: both sides decide
        alike from the size, and a receive of another size than its send is found by
        :meth:`_came_here` or :meth:`_look_at_peers`)."""
        return self.pairs.get(peer) if buf.nbytes >= self.min_bytes else None

    def carrier(self, messages: Sequence[tuple[int, int]]) -> Transport:
        """The MPI transport itself where none of ``messages`` takes shared memory (all
        below ``RINGCOMM_SHM_MIN_BYTES`` or to other hosts): a small collective's
        starts and waits then skip this wrapper (``scripts/bench_layers.py`` times
        the transport layer). Its waits still look at the peers through the hooks
        this transport set on it."""
        pairs, least = self.pairs, self.min_bytes
        if any(n >= least and peer in pairs for peer, n in messages):
            return self
        return self.inner

    def send_init(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        pair = self._route(buf, peer)
        if pair is None:
            return self.inner.send_init(buf, peer, tag)
        msg = _Msg(pair, self._memory(buf), tag, pair.slots_out)
        return Handle(msg, None, peer, "send", None, tag, buf.nbytes)

    def recv_init(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        pair = self._route(buf, peer)
        if pair is None:
            return self.inner.recv_init(buf, peer, tag)
        msg = _Msg(pair, self._memory(buf), tag, pair.slots_in)
        return Handle(msg, None, peer, "recv", None, tag, buf.nbytes)

    def recv_held_init(self, buf: torch.Tensor, peer: int, tag: int) -> Handle | None:
        """A receive of ``buf``'s size whose data stays in the sender's slots once it
        completes, until the local step made by :meth:`held_work` reads it from
        there: a reduction from the sender's memory, with no copy into ``buf`` first.
        None where that cannot be: a peer on another host, or a message larger than
        the FIFO (it could never lie there whole)."""
        pair = self._route(buf, peer)
        if pair is None or max(buf.nbytes, 1) > self.geometry.slots * self.geometry.slot_bytes:
            return None
        msg = _Msg(pair, self._memory(buf), tag, pair.slots_in, held=True)
        return Handle(msg, None, peer, "recv", None, tag, buf.nbytes)

    def held_work(self, handle: Handle, dst: np.ndarray, dtype: torch.dtype,
                  reduce_fn=None) -> tuple:
        """The local step that reads held receive ``handle``: ``(fn, a, b)`` for
        ``fn(a, b)``, which reduces (``reduce_fn(dst, src)`` on
        :func:`ringcomm.ops.operand` s of ``dtype``) or, without one, copies the
        message from the sender's slots into ``dst`` (raw memory of the message's
        size) and frees the slots."""
        m = handle.req
        if dst.size != m.nbytes:
            raise ValueError(f"ringcomm: a held receive of {m.nbytes} bytes read into "
                             f"{dst.size}: a malformed schedule")
        size = self.geometry.slot_bytes
        parts = [dst[a:a + size] for a in range(0, max(dst.size, 1), size)]
        if reduce_fn is None:
            targets = parts
            sources = m.views
            fn = ops.serial_copy
        else:
            targets = [ops.operand(p, dtype) for p in parts]
            sources = [[ops.operand(v, dtype) for v in per_slot] for per_slot in m.views]
            fn = reduce_fn
        return self._consume, (fn, targets, sources), m

    def _consume(self, work: tuple, m: _Msg) -> None:
        fn, targets, sources = work
        nslots, k = self._nslots, m.first
        for t, per_slot in zip(targets, sources):
            fn(t, per_slot[k % nslots])
            k += 1
        pair = m.pair
        held = pair.held
        held.remove(m)
        self._fence()  # the reads of the slots before the count that frees them
        pair.out[pair.tail_in] = held[0].first if held else pair.got

    def batch(self, handles: Sequence[Handle]) -> _Batch:
        local = [h for h in handles if isinstance(h.req, _Msg)]
        remote = [h for h in handles if not isinstance(h.req, _Msg)]
        return _Batch(local, self.inner.batch(remote) if remote else None, len(remote))

    def start(self, batch: _Batch) -> None:
        if self._broken is not None:
            raise RuntimeError(self._broken)
        for m in batch.recvs:
            m.i, m.done = 0, False
            m.pair.recvq.append(m)
        for m in batch.sends:
            m.i, m.done = 0, False
            q = m.pair.sendq
            q.append(m)
            if len(q) == 1:  # first in line: out now, as far as slots allow
                self._push(m.pair)
        if batch.mpi is not None:
            self.inner.start(batch.mpi)
            self._mpi_out += batch.remote

    def _push(self, pair: _Pair) -> None:
        """Publish chunks of the pair's queued sends while slots are free."""
        q, nslots, out, meta = pair.sendq, self._nslots, pair.out, pair.meta_out
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
            self._fence()  # the chunks and their tags before the count that publishes them
            out[pair.head_out] = k

    def _pull(self, pair: _Pair) -> None:
        """Consume the chunks the peer published, into the pair's queued receives."""
        q, inp = pair.recvq, pair.in_
        k0 = k = pair.got
        avail = inp[pair.head_in] - k
        if avail <= 0 or not q:
            return
        self._fence()  # the count before the chunks it published
        nslots, meta = self._nslots, pair.meta_in
        while q and avail > 0:
            m = q[0]
            i, n, chunks, views = m.i, m.n, m.chunks, m.views
            if m.held:  # taken whole, left where it lies
                if avail < n:
                    break
                at = meta + 2 * (k % nslots)
                if inp[at] != m.tag or inp[at + 1] != m.nbytes:
                    self._refuse(pair, m, k0, k, inp[at], inp[at + 1])
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
                        self._refuse(pair, m, k0, k, inp[at], inp[at + 1])
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
        self._fence()  # the reads of the slots before the count that frees them
        pair.out[pair.tail_in] = pair.held[0].first if pair.held else k

    def _refuse(self, pair: _Pair, m: _Msg, k0: int, k: int, tag: int, size: int) -> None:
        """The first chunk of the next message from the peer is not the one ``m``
        awaits (messages between a pair arrive in the order they were sent: another
        is the peer's other call): raise, having freed what was consumed."""
        if k != k0:
            pair.got = k
            self._fence()
            pair.out[pair.tail_in] = pair.held[0].first if pair.held else k
        if tag != m.tag:
            raise TransportMismatch(pair.peer, m.tag, tag)
        raise RuntimeError(f"received {size} bytes from rank {pair.peer} where {m.nbytes} "
                           "were expected: ranks passed different sizes to this collective")

    def progress(self) -> None:
        """Move what can move on every pair (sends into free slots, chunks out to
        receives)."""
        for pair in self._pair_list:
            if pair.recvq:
                self._pull(pair)
            if pair.sendq:
                self._push(pair)

    def wait(self, batch: _Batch) -> None:
        self._signs.clear()
        for m in batch.msgs:
            if not m.done:
                self._wait_shm(batch)
                break
        if batch.mpi is not None:
            self.inner.wait(batch.mpi)
            self._mpi_out -= batch.remote

    def _wait_shm(self, batch: _Batch) -> None:
        progress, msgs = self.progress, batch.msgs
        idle = _Idle(self, lambda: self.timeout_message(
            [h for h in batch.handles if not h.req.done]),
            lambda now: self._look_at_peers(batch.handles))
        try:
            while True:
                progress()
                for m in msgs:
                    if not m.done:
                        break
                else:
                    return
                idle.turn()
        except (TransportAborted, TransportMismatch):
            # the group's store carries a mismatch to every rank, in the words of the
            # call that found it (ringcomm.front.lanes.Lanes.mark_broken); an abort is
            # every rank's own
            raise
        except BaseException as e:
            self._fail(f"rank {self.rank} on host {self._host}: {type(e).__name__}: {e}")
            raise

    def timeout_message(self, pending: Sequence[Handle]) -> str:
        return super().timeout_message(pending) + " over shared memory"

    def waiting_for(self) -> str | None:
        """The messages of the last wait (of the MPI transport inside: the small
        messages go that way)."""
        return self.inner.waiting_for()

    # -- faults ---------------------------------------------------------------------
    def _fail(self, text: str) -> None:
        """Tell the peers on this host, through this rank's segment, why it stopped."""
        self._broken = (f"ringcomm shared-memory transport: unusable after a failed "
                        f"collective ({text})")
        if not self._maps:
            return
        raw = text.encode(errors="replace")[:_TEXT_MAX]
        mm, words = self._maps[0]
        mm[_TEXT_AT:_TEXT_AT + len(raw)] = raw
        self._fence()
        words[2] = len(raw)

    def tell_peers(self, text: str) -> None:
        """This process is leaving with an error: the peers on this host read
        ``text`` in its segment at their next look (:mod:`ringcomm.front.departure`)."""
        self._fail(text)

    def _look_at_peers(self, handles: tuple) -> None:
        """Raise :class:`TransportPeerFailed` if a peer this wait needs wrote a failure
        into its segment or its process is gone; also what the group's store says."""
        waited = sorted({h.peer for h in handles if not h.req.done})
        reported = self.peer_failure(waited) if self.peer_failure is not None else None
        if reported is not None:
            raise TransportPeerFailed(reported)
        for peer in waited:
            text = self._failure_of(peer)
            if text is not None:
                raise TransportPeerFailed(f"rank {peer} on host {self._host} stopped: {text}")
            self._check_alive(peer, "over shared memory")
        first_tag = self.inner.first_tag_from
        for h in handles:
            if h.kind == "recv" and not h.req.done:
                self._same_number(h, first_tag(h.peer), "over MPI", h.req.pair.got)
        if self.direct is not None:
            self._in_window(sorted({h.peer for h in handles if not h.req.done}))

    def _in_window(self, peers: list[int]) -> None:
        """Raise if a peer this schedule waits on published a shm_direct round this rank
        has not joined, the same at every look for MISMATCH_S: it runs shm_direct where
        this rank runs a schedule."""
        now = _monotonic()
        for peer in peers:
            ahead = self.direct_round(peer)
            key = ("window", peer)
            if ahead <= self.rounds:
                self._signs.gone(key)
            elif self._signs.lasted(key, ahead, now):
                # its window holds its call's whole signature: the program names it
                line = self.direct.lines[ahead & 1]
                raise TransportMismatch(peer, None, None,
                                        signature=self.direct.words[peer][line + 1])

    def _came_here(self, h: Handle) -> None:
        """Called while MPI waits long for ``h``: raise if its peer, on this host, is
        gone or failed, runs shm_direct (:meth:`_in_window`), or if the message a
        receive awaits came over shared memory instead (the sender's size put it
        there)."""
        peer = h.peer
        pair = self.pairs.get(peer)
        if pair is None:
            return
        self._check_alive(peer, "over MPI")
        text = self._failure_of(peer)
        if text is not None:
            raise TransportPeerFailed(f"rank {peer} on host {self._host} stopped: {text}")
        if self.direct is not None:
            self._in_window([peer])
        if h.kind != "recv":
            return
        inp, k = pair.in_, pair.got
        if inp[pair.head_in] > k and not pair.recvq:
            self._fence()
            self._same_number(h, inp[pair.meta_in + 2 * (k % self._nslots)],
                              "over shared memory", k)
        else:
            self._signs.gone(h)

    def _same_number(self, h: Handle, found: int | None, how: str, got: int) -> None:
        """Raise if ``found``, the tag of the next message from ``h``'s peer on the path
        the receive ``h`` does not wait on, numbers the same message of another call,
        and goes on doing so, the same, at every look for
        :data:`ringcomm.transport.base.MISMATCH_S` of this wait (``got``: the chunks
        taken from the peer's shared memory so far, which stay the same).

        Either the peer sent the awaited message that way (its size differs, and a
        message's size decides its path), or the peer is in its next call, whose
        message with the same number came the faster way while the awaited one, sent
        first, was still on its way. Only the first stays: the second's awaited
        message completes at the wait's next test."""
        bits, peer, tag = self.number_bits, h.peer, h.tag
        if found is None or bits is None or found == tag or (found ^ tag) & ((1 << bits) - 1):
            self._signs.gone(h)  # no message of another call with this number
            return
        if self._signs.lasted(h, (found, how, got), _monotonic()):
            # the peer's call of another size (RINGCOMM_SHM_MIN_BYTES decides the way a
            # message takes): its tag names that call as well as the program can
            raise TransportMismatch(peer, tag, found)

    def _check_alive(self, peer: int, how: str) -> None:
        pid = self._pids.get(peer)
        if pid is not None and not _alive(pid):
            # how it left, if it said so (its last messages cannot come now)
            said = (self.peer_failure((peer,), gone=True) if self.peer_failure is not None
                    else None)
            raise TransportPeerFailed(said or f"rank {peer} (pid {pid}) on host {self._host} "
                                      f"exited while rank {self.rank} waited for it {how}")

    def _failure_of(self, peer: int) -> str | None:
        mm, words = self._maps[self._map_index[peer]]
        n = words[2]
        if not n:
            return None
        self._fence()
        return bytes(mm[_TEXT_AT:_TEXT_AT + min(n, _TEXT_MAX)]).decode(errors="replace")

    def abandon(self, handles: Sequence[Handle], keep: Any = None) -> None:
        """Nothing moves behind this rank's back (copies happen inside its own calls),
        so the caller's memory is free at once; a message left half done puts the pair's
        FIFOs out of step, so the transport refuses later collectives."""
        remote = [h for h in handles if not isinstance(h.req, _Msg)]
        if remote:
            self.inner.abandon(remote, keep)
        left = [h for h in handles if isinstance(h.req, _Msg) and not h.req.done]
        for h in handles:
            if isinstance(h.req, _Msg) and h.req in h.req.pair.held:
                h.req.pair.held.remove(h.req)  # its slots are never freed: broken below
                left.append(h)
        for h in left:
            pair = h.req.pair
            for q in (pair.sendq, pair.recvq):
                if h.req in q:
                    q.remove(h.req)
            h.req.done = True
        if left and self._broken is None:
            self._broken = ("ringcomm shared-memory transport: unusable after a collective "
                            "was abandoned half done")
        super().end()
        self._mpi_out = 0

    def free(self, handles: Sequence[Handle]) -> None:
        self.inner.free([h for h in handles if not isinstance(h.req, _Msg)])

    # -- shm_direct: the window's rounds (ringcomm.transport.shm_direct) ----------------
    def check_own(self, name, collective, dtype, op) -> None:
        if name == "shm_direct" and collective in shm_direct.COLLECTIVES:
            if self.direct is None:
                raise ValueError(
                    f"ringcomm {collective}: algorithm 'shm_direct' needs every rank of the "
                    f"group on one host; this group's ranks {sorted(self.pairs) + [self.rank]} "
                    f"share host {self._host} with rank {self.rank}, of {self.size}"
                    if len(self.pairs) + 1 < self.size else
                    f"ringcomm {collective}: algorithm 'shm_direct' has no window in this "
                    "group's segments (RINGCOMM_SHM_DIRECT_BYTES=0)")
            return
        super().check_own(name, collective, dtype, op)

    def own_init(self, name, collective, layout, dtype, op, signature, epoch, names, root=0):
        return shm_direct.direct_program(self, collective, layout, dtype, op, root, signature, epoch,
                              names)

    def direct_wait(self, k: int, sig: int, epoch: int, describe) -> None:
        """Wait until every peer published round ``k`` of the same call (signature
        ``sig``, ``epoch``), within the collective's deadline; then the fence that
        orders the reads of its data after it. ``describe(sig)`` names a call."""
        win = self.direct
        line, words, me = win.lines[k & 1], win.words, self.rank
        pending = [r for r in range(self.size) if r != me]
        idle = _Idle(self, lambda: (
            f"waiting for rank(s) {pending} on host {self._host} to join "
            f"{describe(sig)} (over shared memory)"),
            lambda now: self._look_from_window(pending, now, describe(sig)))
        self._signs.clear()
        while True:
            arrived = [r for r in pending if words[r][line] == k]
            if arrived:
                self._fence()  # the rounds before the signatures and data they publish
                for r in arrived:
                    w = words[r]
                    if w[line + 1] != sig or w[line + 2] != epoch:
                        theirs = describe(w[line + 1]) if w[line + 2] == epoch else (
                            "a call of another epoch (a call before it was refused on "
                            "some ranks only: bad input there)")
                        raise mismatch(me, describe(sig), r, theirs)
                pending[:] = [r for r in pending if r not in arrived]
                if not pending:
                    return
            idle.turn()

    def _look_from_window(self, pending: list[int], now: float, mine: str) -> None:
        """A long shm_direct wait looks at the peers it waits on: failed, gone, or in
        another collective (a message of a schedule from them waits here, the same at
        every look for MISMATCH_S)."""
        reported = self.peer_failure(pending) if self.peer_failure is not None else None
        if reported is not None:
            raise TransportPeerFailed(reported)
        first_tag = self.inner.first_tag_from
        for peer in pending:
            text = self._failure_of(peer)
            if text is not None:
                raise TransportPeerFailed(f"rank {peer} on host {self._host} stopped: {text}")
            self._check_alive(peer, "over shared memory")
            pair = self.pairs[peer]
            came = pair.in_[pair.head_in] > pair.got
            tag = first_tag(peer)
            if not came and tag is None:
                self._signs.gone(peer)
            elif self._signs.lasted(peer, (came, tag, pair.in_[pair.head_in]), now):
                raise mismatch(self.rank, mine, peer, None)  # its messages' tags: unread

    def direct_failed(self, e: BaseException) -> None:
        """A round failed part done: the windows are out of step from here on."""
        if isinstance(e, TransportAborted) or self._broken is not None:
            self._broken = self._broken or ("ringcomm shared-memory transport: unusable after "
                                            "an aborted collective")
            return
        self._fail(f"rank {self.rank} on host {self._host}: {type(e).__name__}: {e}")

    def direct_round(self, peer: int) -> int:
        """The last round of shm_direct ``peer`` published."""
        w, lines = self.direct.words[peer], self.direct.lines
        return max(w[lines[0]], w[lines[1]])

    # -- what the wrapped MPI transport serves ------------------------------------------
    def check_native(self, collective, dtype, op) -> None:
        self.inner.check_native(collective, dtype, op)

    def native_init(self, collective, layout, dtype, op, root):
        return self.inner.native_init(collective, layout, dtype, op, root)

    def p2p_isend(self, buf, peer, tag):
        return self.inner.p2p_isend(buf, peer, tag)

    def p2p_irecv(self, buf, peer, tag):
        return self.inner.p2p_irecv(buf, peer, tag)

    def p2p_wait(self, handle, deadline):
        return self.inner.p2p_wait(handle, deadline)

    def p2p_done(self, handle):
        return self.inner.p2p_done(handle)

    def p2p_cancel(self, handle) -> None:
        self.inner.p2p_cancel(handle)

    def p2p_source(self, handle) -> int:
        return self.inner.p2p_source(handle)

    def close(self) -> None:
        """Close the MPI transport and unmap the segments (already unlinked)."""
        self.inner.close()
        self._broken = self._broken or "ringcomm shared-memory transport: closed"
        # the mappings go once nothing views them (numpy views pin an mmap open)
        self.pairs, self._pair_list, self._maps = {}, [], []
        self.direct = None
        win, _ = self._window
        try:
            with mpi_serial.LOCK:
                win.Unlock_all()
                win.Free()
        except Exception:  # noqa: BLE001  (MPI finalized: nothing left to free)
            pass


class _Idle:
    """What a wait of ``tp`` does each time it finds nothing new: let MPI progress (at
    most every _POKE_S, while MPI has work), honour an abort and the collective's
    deadline (``timeout_text()`` says what was awaited), then pace itself (busy, then
    yielding, then naps: :class:`ringcomm.backoff.Backoff`), calling ``look_at(now)``
    every _PROBE_S once it has waited that long."""

    __slots__ = ("tp", "timeout_text", "look_at", "pace", "look")

    def __init__(self, tp: ShmTransport, timeout_text, look_at):
        self.tp, self.timeout_text, self.look_at = tp, timeout_text, look_at
        self.pace: Backoff | None = None
        self.look = 0.0

    def turn(self) -> None:
        tp, now = self.tp, _monotonic()
        if now >= tp._next_poke and (tp._mpi_out or tp._user_pending()):
            tp._poke()
            tp._next_poke = now + _POKE_S
        if tp._stop is not None:
            raise TransportAborted(tp._stop)
        if now >= tp._deadline:
            raise TransportTimeout(self.timeout_text())
        if self.pace is None:
            self.pace = Backoff(_BUSY_S, tp.spin_s, tp.max_sleep_s, start=now)
            self.look = now + _PROBE_S
        elif now >= self.look:
            self.look_at(now)
            self.look = now + _PROBE_S
        self.pace.pause(now)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except OSError:
        return True


def _make_segment(path: str, nbytes: int, directory: str, peers: int,
                  rank: int) -> tuple[Any, str | None]:
    """Create, allocate and map this rank's segment; (mmap, None) or (None, why not)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        return None, f"rank {rank} cannot create {path}: {e.strerror}"
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            _unlink(path)
            st = os.statvfs(directory)
            free = st.f_bavail * st.f_frsize
            return None, (f"{directory} has {free / 2**20:.1f} MiB free, and rank {rank}'s "
                          f"segment needs {nbytes / 2**20:.1f} MiB for its {peers} peer(s) on "
                          f"host {socket.gethostname()} ({e.strerror})")
        try:
            return mmap.mmap(fd, nbytes), None
        except OSError as e:
            _unlink(path)
            return None, f"rank {rank} cannot map {path}: {e.strerror}"
    finally:
        os.close(fd)


def _map_segment(path: str, nbytes: int) -> Any:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def connect(inner: Transport, comm, hosts: Sequence[int], channel: int = 0,
            enabled: bool | None = None, setup_s: float | None = None) -> Transport:
    """A :class:`ShmTransport` over ``inner`` for the ranks of the group that share a
    host with this one, or ``inner`` itself where none does, shared memory is turned
    off (``enabled`` False, ``RINGCOMM_SHM=0`` where it is None; off on every rank if
    off on any, with a warning) or could not be set up on some rank (then with a
    warning that says why). Collective over ``comm``, the group's MPI communicator,
    whose ranks are ``inner``'s (every rank makes the same collective calls, whatever
    happens to its own segment); ``hosts`` is the group's host layout (empty: one
    host). A rank on a host of its own maps nothing. Each of its collectives may take
    ``setup_s`` (None: ``RINGCOMM_CONNECT_TIMEOUT``), then it raises
    ``DistBackendError`` and leaves nothing in the segments' directory.
    """
    size, rank = inner.size, inner.rank
    if size < 2:
        return inner
    limit = mpi_serial.limit(setup_s)

    def allgather(obj: Any) -> list:
        return mpi_serial.allgather(comm, obj, "shared-memory set-up", limit)

    on = settings.get("RINGCOMM_SHM") if enabled is None else bool(enabled)
    # one exchange: each rank's machine, pid and whether it wants shared memory
    machines = allgather((machine.identity(), os.getpid(), on))
    if not all(m[2] for m in machines):
        if on and channel == 0:
            log.warning("ringcomm: shared memory is off on ranks %s of this group (on "
                        "elsewhere): every rank of the group uses MPI",
                        [r for r, m in enumerate(machines) if not m[2]])
        return inner
    mine = hosts[rank] if hosts else 0
    local = [r for r in range(size)
             if (hosts[r] if hosts else 0) == mine and machines[r][0] == machines[rank][0]]
    if max(allgather(len(local))) < 2:
        return inner
    directory = settings.get("RINGCOMM_SHM_DIR")
    geo = Geometry(len(local) - 1, settings.get("RINGCOMM_SHM_SLOTS"),
                   settings.get("RINGCOMM_SHM_SLOT_BYTES"),
                   settings.get("RINGCOMM_SHM_DIRECT_BYTES") if len(local) == size else 0)
    token = mpi_serial.bcast(comm, uuid.uuid4().hex[:16] if rank == 0 else None, 0,
                             "shared-memory set-up", limit)

    def path(r: int) -> str:
        return os.path.join(directory, f"ringcomm-{token}-c{channel}-r{r}")

    own, why = None, None
    if len(local) > 1:
        own, why = _make_segment(path(rank), geo.nbytes, directory, len(local) - 1, rank)
    maps: list = [] if own is None else [own]
    try:
        problems = [p for p in allgather(why) if p]
        if not problems:
            why = None
            try:
                maps += [_map_segment(path(r), geo.nbytes) for r in local if r != rank]
            except OSError as e:
                why = f"rank {rank} cannot map a peer's segment: {e}"
            problems = [p for p in allgather(why) if p]
    finally:
        # every rank has mapped, or given up on, every segment (or the set-up failed):
        # unlinked now, and on every rank before any returns, so a rank killed from
        # here on leaves nothing behind
        if own is not None:
            _unlink(path(rank))
    mpi_serial.barrier(comm, "shared-memory set-up", limit)
    if problems:
        maps.clear()  # unmapped as they are collected
        log.warning("ringcomm: shared memory is not used for this group, which runs over MPI "
                    "instead: %s. Give the directory more space (docker run --shm-size), "
                    "point RINGCOMM_SHM_DIR at a larger tmpfs, or set RINGCOMM_SHM=0",
                    "; ".join(sorted(set(problems))))
        return inner
    if len(local) < 2:
        return inner
    tp = _assemble(inner, rank, local, machines, geo, maps)
    tp.segments = [path(r) for r in local]
    return tp


def _assemble(inner: Transport, rank: int, local: list[int], machines: list, geo: Geometry,
              maps: list) -> ShmTransport:
    """The transport over mapped segments: ``maps[0]`` this rank's, then its local
    peers' in rank order."""
    others = [r for r in local if r != rank]
    # 8-byte integers through a memoryview: one aligned load or store each, read as a
    # Python int (numpy's element access costs twice as much)
    words = [(mm, memoryview(mm).cast("B").cast("q")) for mm in maps]
    own_mm, own = words[0]
    own[1] = os.getpid()
    own[0] = _MAGIC

    def peers_of(r: int) -> list[int]:
        return [q for q in local if q != r]

    def slots(mm, j: int) -> list:
        return [np.frombuffer(mm, dtype=np.uint8, count=geo.slot_bytes,
                              offset=geo.slot_at(j, s)) for s in range(geo.slots)]

    pairs: dict[int, _Pair] = {}
    index = {rank: 0}
    for i, q in enumerate(others, 1):
        index[q] = i
        pair = _Pair(q)
        j_out = others.index(q)  # q's outbox, and q's tail counter, in this rank's segment
        j_in = peers_of(q).index(rank)  # this rank's, in q's segment
        q_mm, pair.in_ = words[i]
        pair.out = own
        pair.head_out = geo.outbox_at(j_out) // 8
        pair.meta_out = pair.head_out + _LINE // 8
        pair.tail_in = geo.tail_at(j_out) // 8
        pair.head_in = geo.outbox_at(j_in) // 8
        pair.meta_in = pair.head_in + _LINE // 8
        pair.tail_peer = geo.tail_at(j_in) // 8
        pair.slots_out = slots(own_mm, j_out)
        pair.slots_in = slots(q_mm, j_in)
        pairs[q] = pair
    pids = {q: machines[q][1] for q in others if _alive(machines[q][1])}
    tp = ShmTransport(inner, pairs, geo, words, index, pids, socket.gethostname())
    if geo.direct_bytes and len(local) == inner.size:
        tp.direct = Window(geo, [words[index[r]] for r in range(inner.size)])
    return tp
