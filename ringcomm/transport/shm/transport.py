"""The shared-memory transport: a schedule's messages to the ranks on this host go
through the FIFOs of :mod:`ringcomm.transport.shm.fifo`, the others through the
transport it wraps (MPI's); its own collective ``shm_direct`` runs on the windows
of :mod:`ringcomm.transport.shm.direct`. The package's docstring tells the whole."""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import torch

from ringcomm import mpi_serial, ops, settings
from ringcomm.transport.base import (Handle, Signs, Transport, TransportAborted,
                                     TransportMismatch, TransportPeerFailed, TransportPeerLost)
from ringcomm.transport.shm.direct import COLLECTIVES, direct_program, peers_ahead
from ringcomm.transport.shm.fifo import Batch, Msg, Pair, consume, pull, push
from ringcomm.transport.shm.liveness import Idle, alive
from ringcomm.transport.shm.segment import (Geometry, Window, memory_fence, read_failure,
                                            write_failure)

_monotonic = time.monotonic


class ShmTransport(Transport):
    """Shared memory to the ranks on this host, ``inner`` (MPI) to the others.

    Made by :func:`connect`, collectively; ``pairs`` maps each local peer to its
    FIFOs. ``inner`` is owned (closed by :meth:`close`).
    """

    Mismatch = TransportMismatch

    holds_receives = True

    def __init__(self, inner: Transport, pairs: dict[int, Pair], geometry: Geometry,
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
        self.host = host
        self._nslots = geometry.slots
        self._fence, self._fence_win = memory_fence()
        #: the memory barrier (a full one: MPI_Win_sync)
        self.fence = self._fence
        self.broken: str | None = None
        #: messages numbered like awaited ones but of other calls, seen on the other path
        #: in the running wait (:meth:`_same_number`)
        self.signs = Signs()
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
        #: (:mod:`ringcomm.transport.shm.direct`); None elsewhere
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

    def same_host_peers(self) -> list[int]:
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

    def _route(self, buf: torch.Tensor, peer: int) -> Pair | None:
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
        msg = Msg(pair, self._memory(buf), tag, pair.slots_out)
        return Handle(msg, None, peer, "send", None, tag, buf.nbytes)

    def recv_init(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        pair = self._route(buf, peer)
        if pair is None:
            return self.inner.recv_init(buf, peer, tag)
        msg = Msg(pair, self._memory(buf), tag, pair.slots_in)
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
        msg = Msg(pair, self._memory(buf), tag, pair.slots_in, held=True)
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

    def _consume(self, work: tuple, m: Msg) -> None:
        consume(work, m, self._nslots, self._fence)

    def batch(self, handles: Sequence[Handle]) -> Batch:
        local = [h for h in handles if isinstance(h.req, Msg)]
        remote = [h for h in handles if not isinstance(h.req, Msg)]
        return Batch(local, self.inner.batch(remote) if remote else None, len(remote))

    def start(self, batch: Batch) -> None:
        if self.broken is not None:
            raise RuntimeError(self.broken)
        for m in batch.recvs:
            m.i, m.done = 0, False
            m.pair.recvq.append(m)
        for m in batch.sends:
            m.i, m.done = 0, False
            q = m.pair.sendq
            q.append(m)
            if len(q) == 1:  # first in line: out now, as far as slots allow
                push(m.pair, self._nslots, self._fence)
        if batch.mpi is not None:
            self.inner.start(batch.mpi)
            self._mpi_out += batch.remote

    def progress(self) -> None:
        """Move what can move on every pair (sends into free slots, chunks out to
        receives)."""
        for pair in self._pair_list:
            if pair.recvq:
                pull(pair, self._nslots, self._fence)
            if pair.sendq:
                push(pair, self._nslots, self._fence)

    def wait(self, batch: Batch) -> None:
        self.signs.clear()
        for m in batch.msgs:
            if not m.done:
                self._wait_shm(batch)
                break
        if batch.mpi is not None:
            self.inner.wait(batch.mpi)
            self._mpi_out -= batch.remote

    def _wait_shm(self, batch: Batch) -> None:
        progress, msgs = self.progress, batch.msgs
        idle = Idle(self, lambda: self.timeout_message(
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
            self.fail(f"rank {self.rank} on host {self.host}: {type(e).__name__}: {e}")
            raise

    def timeout_message(self, pending: Sequence[Handle]) -> str:
        return super().timeout_message(pending) + " over shared memory"

    def waiting_for(self) -> str | None:
        """The messages of the last wait (of the MPI transport inside: the small
        messages go that way)."""
        return self.inner.waiting_for()

    # -- faults ---------------------------------------------------------------------
    def fail(self, text: str) -> None:
        """Tell the peers on this host, through this rank's segment, why it stopped."""
        self.broken = (f"ringcomm shared-memory transport: unusable after a failed "
                       f"collective ({text})")
        if self._maps:
            write_failure(self._maps, text, self._fence)

    def tell_peers(self, text: str) -> None:
        """This process is leaving with an error: the peers on this host read
        ``text`` in its segment at their next look (:mod:`ringcomm.front.departure`)."""
        self.fail(text)

    def _look_at_peers(self, handles: tuple) -> None:
        """Raise :class:`TransportPeerFailed` if a peer this wait needs wrote a failure
        into its segment or its process is gone; also what the group's store says."""
        waited = sorted({h.peer for h in handles if not h.req.done})
        reported = self.peer_failure(waited) if self.peer_failure is not None else None
        if reported is not None:
            raise TransportPeerFailed(reported)
        for peer in waited:
            text = self.failure_of(peer)
            if text is not None:
                raise TransportPeerFailed(f"rank {peer} on host {self.host} stopped: {text}")
            self.check_alive(peer, "over shared memory")
        first_tag = self.inner.first_tag_from
        for h in handles:
            if h.kind == "recv" and not h.req.done:
                self._same_number(h, first_tag(h.peer), "over MPI", h.req.pair.got)
        if self.direct is not None:
            peers_ahead(self, sorted({h.peer for h in handles if not h.req.done}))

    def _came_here(self, h: Handle) -> None:
        """Called while MPI waits long for ``h``: raise if its peer, on this host, is
        gone or failed, runs shm_direct
        (:func:`~ringcomm.transport.shm.direct.peers_ahead`), or if the message a
        receive awaits came over shared memory instead (the sender's size put it
        there)."""
        peer = h.peer
        pair = self.pairs.get(peer)
        if pair is None:
            return
        self.check_alive(peer, "over MPI")
        text = self.failure_of(peer)
        if text is not None:
            raise TransportPeerFailed(f"rank {peer} on host {self.host} stopped: {text}")
        if self.direct is not None:
            peers_ahead(self, [peer])
        if h.kind != "recv":
            return
        inp, k = pair.in_, pair.got
        if inp[pair.head_in] > k and not pair.recvq:
            self._fence()
            self._same_number(h, inp[pair.meta_in + 2 * (k % self._nslots)],
                              "over shared memory", k)
        else:
            self.signs.gone(h)

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
            self.signs.gone(h)  # no message of another call with this number
            return
        if self.signs.lasted(h, (found, how, got), _monotonic()):
            # the peer's call of another size (RINGCOMM_SHM_MIN_BYTES decides the way a
            # message takes): its tag names that call as well as the program can
            raise TransportMismatch(peer, tag, found)

    def check_alive(self, peer: int, how: str) -> None:
        pid = self._pids.get(peer)
        if pid is not None and not alive(pid):
            # how it left, if it said so (its last messages cannot come now)
            said = (self.peer_failure((peer,), gone=True) if self.peer_failure is not None
                    else None)
            if said is not None:
                raise TransportPeerFailed(said)
            raise TransportPeerLost(f"rank {peer} (pid {pid}) on host {self.host} exited "
                                    f"while rank {self.rank} waited for it {how}")

    def failure_of(self, peer: int) -> str | None:
        """What ``peer`` wrote into its segment when it stopped, if it did."""
        mm, words = self._maps[self._map_index[peer]]
        return read_failure(mm, words, self._fence)

    def abandon(self, handles: Sequence[Handle], keep: Any = None) -> None:
        """Nothing moves behind this rank's back (copies happen inside its own calls),
        so the caller's memory is free at once; a message left half done puts the pair's
        FIFOs out of step, so the transport refuses later collectives."""
        remote = [h for h in handles if not isinstance(h.req, Msg)]
        if remote:
            self.inner.abandon(remote, keep)
        left = [h for h in handles if isinstance(h.req, Msg) and not h.req.done]
        for h in handles:
            if isinstance(h.req, Msg) and h.req in h.req.pair.held:
                h.req.pair.held.remove(h.req)  # its slots are never freed: broken below
                left.append(h)
        for h in left:
            pair = h.req.pair
            for q in (pair.sendq, pair.recvq):
                if h.req in q:
                    q.remove(h.req)
            h.req.done = True
        if left and self.broken is None:
            self.broken = ("ringcomm shared-memory transport: unusable after a collective "
                            "was abandoned half done")
        super().end()
        self._mpi_out = 0

    def free(self, handles: Sequence[Handle]) -> None:
        self.inner.free([h for h in handles if not isinstance(h.req, Msg)])

    # -- shm_direct: the window's rounds (ringcomm.transport.shm.direct) ----------------
    def check_own(self, name, collective, dtype, op) -> None:
        if name == "shm_direct" and collective in COLLECTIVES:
            if self.direct is None:
                raise ValueError(
                    f"ringcomm {collective}: algorithm 'shm_direct' needs every rank of the "
                    f"group on one host; this group's ranks {sorted(self.pairs) + [self.rank]} "
                    f"share host {self.host} with rank {self.rank}, of {self.size}"
                    if len(self.pairs) + 1 < self.size else
                    f"ringcomm {collective}: algorithm 'shm_direct' has no window in this "
                    "group's segments (RINGCOMM_SHM_DIRECT_BYTES=0)")
            return
        super().check_own(name, collective, dtype, op)

    def own_init(self, name, collective, layout, dtype, op, signature, epoch, names, root=0):
        return direct_program(self, collective, layout, dtype, op, root, signature, epoch,
                              names)

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
        self.broken = self.broken or "ringcomm shared-memory transport: closed"
        # the mappings go once nothing views them (numpy views pin an mmap open)
        self.pairs, self._pair_list, self._maps = {}, [], []
        self.direct = None
        win, _ = self._fence_win
        try:
            with mpi_serial.LOCK:
                win.Unlock_all()
                win.Free()
        except Exception:  # noqa: BLE001  (MPI finalized: nothing left to free)
            pass
