"""MPI point-to-point transport for CPU tensors (mpi4py).

Tensors are handed to MPI by address (``MPI.buffer.fromaddress``), as bytes:
no copy, and every dtype (bfloat16 included) travels the same way. A
schedule's messages are persistent requests (``MPI_Send_init``/``MPI_Recv_init``)
made once per prepared call and buffer addresses, then only started
(``MPI_Startall``) and tested at every call.

Waiting tests the requests one by one, in order, so every wait can honour the
collective's deadline (``MPI_Wait`` cannot time out). MPI moves large shared-memory
messages only inside MPI calls on both sides, so a rank that sleeps stalls
its peers' transfers: polling spins (yielding the core to co-located ranks
between polls) for up to ``RINGCOMM_SPIN_US`` (50 ms), which covers every
healthy transfer, and only then naps with exponential backoff up to
``RINGCOMM_MAX_SLEEP_US``, for peers that are late to a collective
(:mod:`ringcomm.transport.mpi_requests`). MPI's own collectives, the ``native``
algorithm, are :mod:`ringcomm.transport.mpi_native`'s.
"""
from __future__ import annotations

import collections
import time
from typing import Sequence

import torch
from mpi4py import MPI

from ringcomm import mpi_serial, settings
from ringcomm.transport import mpi_native
from ringcomm.transport.base import (Handle, Signs, Transport, TransportAborted,
                                     TransportMismatch, TransportPeerFailed, TransportTimeout)
from ringcomm.transport.mpi_requests import complete, limbo, poll, prune_limbo, tested

_monotonic = time.monotonic
_INF = float("inf")
_fromaddress = MPI.buffer.fromaddress
_BYTE = MPI.BYTE
# one thread in MPI at a time, process-wide (why: ringcomm.mpi_serial)
_mpi_lock = mpi_serial.LOCK
_startall = MPI.Prequest.Startall


class _Batch:
    """Requests started and waited for together, with what their completion needs."""

    __slots__ = ("handles", "reqs", "statuses", "received")

    def __init__(self, handles: Sequence[Handle]):
        self.handles = list(handles)
        self.reqs = [h.req for h in self.handles]
        self.statuses = [h.status for h in self.handles]
        self.received = [(h, h.status) for h in self.handles if h.status is not None]


class _AnySource:
    """A user receive from any rank, not yet matched to a message."""
    __slots__ = ("tag", "mem")

    def __init__(self, tag: int, mem):
        self.tag, self.mem = tag, mem


class MPITransport(Transport):
    """Transport over an MPI intracommunicator whose ranks are the group's ranks.

    Args:
        comm: communicator owned by this transport (freed by :meth:`close`); a
            duplicate of it carries the user's point-to-point messages.
        setup_s: how long making that duplicate, collective over ``comm``, may take
            (None: ``RINGCOMM_CONNECT_TIMEOUT``).
    """

    def __init__(self, comm: MPI.Intracomm, setup_s: float | None = None):
        super().__init__(comm.Get_rank(), comm.Get_size(), torch.device("cpu"))
        self.comm = comm
        self.p2p_comm = mpi_serial.dup(comm, "the duplicate for users' messages",
                                       mpi_serial.limit(setup_s))
        self.tag_ub = comm.Get_attr(MPI.TAG_UB) or 32767
        self.tag_limit = self.tag_ub + 1
        self.spin_s = settings.get("RINGCOMM_SPIN_US") * 1e-6
        self.max_sleep_s = settings.get("RINGCOMM_MAX_SLEEP_US") * 1e-6
        self._abandoned: list[Handle] = []
        self._any_source: dict[int, collections.deque] = {}
        #: foreign tags first in line for the receives of the running wait
        self._signs = Signs()
        #: the batch :meth:`wait` waits for
        self._waiting: _Batch | None = None
        #: run between polls of every wait: a transport that wraps this one moves its
        #: own messages there (:class:`ringcomm.transport.shm.ShmTransport`)
        self.idle_hook = None
        #: ``probe_hook(handle)``, if set, runs in a long wait for ``handle`` (it may
        #: raise): a wrapping transport looks at the peer and at its own path
        self.probe_hook = None
        #: users' sends and receives not yet seen complete (see :meth:`user_pending`)
        self._user: set[Handle] = set()

    @staticmethod
    def _mem(buf: torch.Tensor):
        if not buf.is_cpu:
            raise ValueError(f"ringcomm MPI transport: tensor on {buf.device}; only CPU tensors")
        if not buf.is_contiguous():
            raise ValueError("ringcomm MPI transport: buffers must be contiguous")
        return [_fromaddress(buf.data_ptr(), buf.nbytes), _BYTE]

    # -- a schedule's messages: persistent requests ---------------------------------
    def send_init(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        mem = self._mem(buf)
        with _mpi_lock:
            req = self.comm.Send_init(mem, peer, tag)
        return Handle(req, None, peer, "send", None, tag, buf.nbytes)

    def recv_init(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        mem = self._mem(buf)
        with _mpi_lock:
            req = self.comm.Recv_init(mem, peer, tag)
        return Handle(req, None, peer, "recv", MPI.Status(), tag, buf.nbytes)

    def batch(self, handles: Sequence[Handle]) -> "_Batch":
        return _Batch(handles)

    def start(self, batch: "_Batch") -> None:
        with _mpi_lock:
            _startall(batch.reqs)

    def waiting_for(self) -> str | None:
        """The messages of the last wait: the peers a call still running waits for
        (no MPI call: a dump asked for by signal may interrupt a wait)."""
        batch = self._waiting
        return None if batch is None else self.timeout_message(batch.handles)

    def wait(self, batch: "_Batch") -> None:
        """Also checks that every receive got exactly its buffer's size: MPI reports
        only messages that are too long, and a short one would leave stale data."""
        reqs, statuses = batch.reqs, batch.statuses
        with _mpi_lock:  # a first look: a short exchange is often done by now
            first = tested(reqs, statuses)
        if first == len(reqs):
            for h, st in batch.received:
                if st.Get_count(_BYTE) != h.nbytes:
                    break
            else:
                return
        self._waiting = batch
        self._signs.clear()
        try:
            # a completed request is never tested again: an inactive persistent request
            # tests done with an empty status, which would overwrite the real one
            done = complete(reqs, statuses, self._deadline, self.spin_s, self.max_sleep_s,
                            self._idle(), self.stopped, first, self._probe)
        except MPI.Exception as e:
            if e.Get_error_class() in (MPI.ERR_TRUNCATE, MPI.ERR_IN_STATUS):
                raise RuntimeError(
                    "a message was larger than its receive buffer: ranks passed different "
                    "sizes to this collective") from e
            raise
        if not done:
            if self._stop is not None:
                raise TransportAborted(self._stop)
            with _mpi_lock:
                pending = [h for h in batch.handles if not h.req.Get_status()]
            raise TransportTimeout(self.timeout_message(pending))
        for h, st in batch.received:
            got = st.Get_count(_BYTE)
            if got != h.nbytes:
                raise RuntimeError(f"received {got} bytes from rank {h.peer} where {h.nbytes} "
                                   "were expected: ranks passed different sizes to this "
                                   "collective")

    def _idle(self):
        """What a wait runs between polls: any-source matching, the wrapper's hook."""
        hook = self.idle_hook
        if not self._any_source:
            return hook
        if hook is None:
            return self._match_all_any_source
        match = self._match_all_any_source
        return lambda: (match(), hook())

    def user_pending(self) -> bool:
        """Whether a user's send or receive may still need MPI's progress."""
        return bool(self._user)

    def poke(self) -> None:
        """Let MPI progress once (a probe), and match any-source receives: a rank
        waiting on something else keeps its pending MPI transfers moving, as MPI's
        own waits do (a large message moves only inside MPI calls on both sides).
        Called only while MPI has work pending: MPICH ends a process whose MPI call
        finds a peer dead, so a group on one host makes no MPI call it needs not."""
        with _mpi_lock:
            self.p2p_comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
        if self._any_source:
            self._match_all_any_source()

    def _probe(self, i: int) -> None:
        """Raise :class:`TransportMismatch` if the peer that ``h``, the receive waited
        on (request ``i`` of the batch in :meth:`wait`), awaits has sent a message ``h``
        does not take, and it stays the first unreceived message from that peer while
        ``h`` stays incomplete for :data:`ringcomm.transport.base.MISMATCH_S`: a
        schedule's messages between two ranks are sent in the order they are received, and MPI never lets a later message overtake an
        earlier one, so that peer is in another call. (A message that arrives just
        after ``h``'s was matched, while ``h``'s data is still moving, is no sign of
        one: it is gone from the probe, or ``h`` complete, well within that time.
        Messages of users' sends and receives travel on another communicator.)

        Also raises :class:`TransportPeerFailed` once a peer reported such a mismatch:
        the peer that found it sends nothing more, so its partners would wait on.

        Only a probe looks at the request: testing a persistent request outside the
        wait's own order would spend its status."""
        h = self._waiting.handles[i]
        if self.probe_hook is not None:  # first: it makes no MPI call
            self.probe_hook(h)
        if h.kind == "recv":
            st = MPI.Status()
            with _mpi_lock:
                found = self.comm.Iprobe(h.peer, MPI.ANY_TAG, st)
            tag = st.Get_tag() if found else h.tag
            if tag == h.tag:
                self._signs.gone(h)
            elif self._signs.lasted(h, tag, _monotonic()):
                raise TransportMismatch(h.peer, h.tag, tag)
        reported = self.peer_failure((h.peer,)) if self.peer_failure is not None else None
        if reported is not None:
            raise TransportPeerFailed(reported)

    def first_tag_from(self, peer: int) -> int | None:
        """The tag of the first message from ``peer`` not yet received on the
        collectives' communicator, if any (a wrapping transport asks: the message it
        awaits on its own path may have come this way)."""
        st = MPI.Status()
        with _mpi_lock:
            found = self.comm.Iprobe(peer, MPI.ANY_TAG, st)
        return st.Get_tag() if found else None

    def free(self, handles: Sequence[Handle]) -> None:
        with _mpi_lock:
            for h in handles:
                try:
                    if h.req != MPI.REQUEST_NULL:
                        h.req.Free()
                except MPI.Exception:
                    pass

    def abandon(self, handles: Sequence[Handle], keep=None) -> None:
        super().end()
        for h in handles:
            try:
                with _mpi_lock:
                    if h.req.Get_status():
                        continue
                    if h.kind == "recv":
                        h.req.Cancel()
            except MPI.Exception:
                pass
            if keep is not None:
                h.buf = keep  # MPI may still touch the caller's memory
            self._abandoned.append(h)

    def _check_tag(self, tag: int) -> None:
        if not 0 <= tag <= self.tag_ub:
            raise ValueError(f"ringcomm: tag {tag} is out of range [0, {self.tag_ub}]")

    def p2p_isend(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        self._check_tag(tag)
        mem = self._mem(buf)
        with _mpi_lock:
            req = self.p2p_comm.Isend(mem, peer, tag)
        h = Handle(req, buf, peer, "send")
        self._user.add(h)
        return h

    def p2p_irecv(self, buf: torch.Tensor, peer: int | None, tag: int) -> Handle:
        self._check_tag(tag)
        mem = self._mem(buf)
        if peer is None:
            # An MPI_ANY_SOURCE receive posted ahead never matched on worlds joined
            # through ports (torchrun) with MPICH 4.3.2, while the message sat in the
            # unexpected queue. A matched probe finds it there; pending any-source
            # receives of one tag take messages in the order they were posted.
            h = Handle(None, buf, -1, "recv", MPI.Status())
            h.req = _AnySource(tag, mem)
            self._any_source.setdefault(tag, collections.deque()).append(h)
            self._user.add(h)
            return h
        with _mpi_lock:
            req = self.p2p_comm.Irecv(mem, peer, tag)
        h = Handle(req, buf, peer, "recv", MPI.Status())
        self._user.add(h)
        return h

    def p2p_wait(self, handle: Handle, deadline: float) -> bool:
        if not poll(lambda: self.p2p_done(handle), deadline, self.spin_s, self.max_sleep_s,
                    self.stopped):
            if self._stop is not None:
                raise TransportAborted(self._stop)
            return False
        return True

    def p2p_done(self, handle: Handle) -> bool:
        if isinstance(handle.req, _AnySource):
            self._match_any_source(handle.req.tag)
            if isinstance(handle.req, _AnySource):
                return False
        # Test with a status: a receive learns its sender here.
        with _mpi_lock:
            done = handle.req == MPI.REQUEST_NULL or handle.req.Test(handle.status)
        if done:
            self._user.discard(handle)
        return done

    def _match_any_source(self, tag: int) -> None:
        # Head, probe, receive and pop under one lock hold: another thread (a future's
        # helper) may be matching the same queue.
        with _mpi_lock:
            waiting = self._any_source.get(tag)
            while waiting:
                h = waiting[0]
                if isinstance(h.req, _AnySource):
                    msg = self.p2p_comm.Improbe(MPI.ANY_SOURCE, tag, h.status)
                    if msg is None:
                        return
                    h.req = msg.Irecv(h.req.mem)
                    h.peer = h.status.Get_source()
                waiting.popleft()

    def _match_all_any_source(self) -> None:
        """Match pending any-source receives while waiting for anything else: a large
        message to one must be matched for its sender to make progress, even while
        this rank is busy in another call."""
        for tag in [t for t, q in self._any_source.items() if q]:
            self._match_any_source(tag)

    def p2p_cancel(self, handle: Handle) -> None:
        self._user.discard(handle)
        with _mpi_lock:
            if isinstance(handle.req, _AnySource):  # not matched yet: nothing was posted
                waiting = self._any_source.get(handle.req.tag)
                if waiting and handle in waiting:
                    waiting.remove(handle)
                return
        try:
            with _mpi_lock:
                if handle.kind == "recv" and not handle.req.Get_status():
                    handle.req.Cancel()
        except MPI.Exception:
            pass
        self._abandoned.append(handle)

    def p2p_source(self, handle: Handle) -> int:
        return handle.peer

    def check_native(self, collective: str, dtype: torch.dtype, op) -> None:
        mpi_native.check(collective, dtype)

    def native_init(self, collective: str, layout: tuple, dtype: torch.dtype, op,
                    root: int) -> "mpi_native.NativeCall":
        """MPI's own collective for one call shape (:func:`ringcomm.transport.mpi_native.call`)."""
        return mpi_native.call(self, collective, dtype, op, root)

    def close(self) -> None:
        """Free the communicators. MPI defers freeing one with pending requests until
        they complete, so a broken group leaks no communicator; its pending requests
        and their buffers move to ``limbo``."""
        limbo.extend(self._abandoned)
        self._abandoned = []
        prune_limbo()
        for comm in (self.comm, self.p2p_comm):
            if comm != MPI.COMM_NULL:
                try:
                    with _mpi_lock:
                        comm.Free()
                except MPI.Exception:
                    pass
        self.comm = self.p2p_comm = MPI.COMM_NULL
