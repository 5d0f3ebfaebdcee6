"""TCP transport for CPU tensors: a group's messages over sockets, without MPI
(``RINGCOMM_TRANSPORT=tcp``; docs/architecture.md, "The TCP transport").

* **Set-up** (the factory, ``ringcomm.front.create``): each channel of each rank
  listens on one port and publishes ``address, port, token`` in the group's store.
* **Connections** open on a pair's first message, from the sender, which sends the
  receiver's token and its own rank first; another token is refused. Each
  direction of a pair has its own connection: a full-duplex network carries both
  directions of an exchange at full rate, and a ring holds two connections a rank.
* **Messages**: a 16-byte header (stream, tag, length) and the payload, written
  straight from the tensor's memory and read straight into the posted receive's
  buffer (else into one of its own, copied when the receive starts). TCP keeps a
  pair's order, so messages with one tag match in the order they were started.
  Users' messages (``dist.send``) are stream 1, never matched with a schedule's.
* **Progress**: every wait moves every pending message, sent or received, and
  blocks in ``epoll`` at most :data:`POLL_S` at a time (an interrupt ends it within
  milliseconds), never spinning a core another rank needs.
* **Failures**: a receive whose sender's connection closed fails at once, naming
  the rank (:class:`TransportPeerLost`); another size than its buffer's names
  both; a peer whose first unreceived message has another tag for
  :data:`ringcomm.transport.base.MISMATCH_S` runs another call.
* **Open files**: once every pair has talked (an all-to-all), a rank holds
  2 (p - 1) connections per channel, past the common default of 1024 open files
  from about 512 ranks. Set-up raises the process's soft limit toward its hard
  limit to fit (:func:`make_room`) and warns where the hard limit is lower; a
  connection that still does not fit, made or accepted, fails naming the limit
  (:func:`out_of_files`) instead of leaving its peer to wait out the deadline.

Ranks on one host talk over loopback (shared memory needs MPI's windows); no
collectives of its own: ``native`` and ``shm_direct`` are refused by name.
"""
from __future__ import annotations

import collections
import ctypes
import errno
import itertools
import logging
import os
import selectors
import socket
import struct
import threading
import time
from typing import Any, Sequence

try:
    import resource
except ImportError:  # not a POSIX system: no limit to raise or name
    resource = None  # type: ignore[assignment]

import torch

from ringcomm.transport.base import (Handle, Signs, Transport, TransportAborted,
                                     TransportMismatch, TransportPeerFailed, TransportPeerLost,
                                     TransportTimeout)

_monotonic = time.monotonic
log = logging.getLogger("ringcomm")

#: the longest one blocking poll lasts (an interrupt, a deadline or a peer's report
#: is seen within it)
POLL_S = 0.005
#: the most one poll reads from one connection while holding the lock
READ_BYTES = 4 << 20
#: how often a long wait looks for signs of a failed or mismatched peer
PROBE_S = 0.1
#: how long a receive from a peer that never connected waits after this rank's
#: connection to it ended (its own may still be on its way)
LOST_GRACE_S = 1.0
_CLOSED = "its connection closed (its process ended or its group was shut down)"
#: stream, tag, length
_HEADER = struct.Struct("<BxxxIQ")
#: the connecting rank's first bytes: the token the accepting rank published, and
#: the connecting rank
_HELLO = struct.Struct("<16sI")
#: streams: a schedule's messages, users' messages
COLLECTIVE, USER = 0, 1
_ANY = -1
#: open files kept free beside the connections a group may hold (the store's, torch's,
#: the job's own files)
SPARE_FILES = 64
#: what every tcp group made so far may hold at most (open files), and the count of
#: open files when the first was made
_wanted = [0, None]
_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)


def open_files() -> int | None:
    """This process's open files (None where ``/proc/self/fd`` cannot say, or no file
    is left to read it with)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def make_room(size: int, channels: int) -> None:
    """Raise this process's soft limit on open files (``RLIMIT_NOFILE``) so that a
    group of ``size`` ranks on ``channels`` channels fits beside the tcp groups made
    before it: each channel listens on one socket and, once every pair has talked,
    holds a connection each way to every peer. The limit is raised as far as the
    hard limit allows, never lowered; where the hard limit is too low a warning
    names both numbers (a ring needs two connections a rank, so the group is still
    made; an all-to-all would fail, naming the limit)."""
    if resource is None:
        return
    if _wanted[1] is None:
        _wanted[1] = open_files() or 0
    _wanted[0] += channels * (2 * (size - 1) + 1)
    want = _wanted[1] + _wanted[0] + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if new > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            log.info("ringcomm tcp transport: raised the limit on open files from %d to %d "
                     "(a group of %d ranks)", soft, new, size)
        if new < want:
            log.warning("ringcomm tcp transport: a group of %d ranks may hold %d connections "
                        "a rank (every pair, both ways, %d channel(s)), with %d files open "
                        "already, and this process may open only %d files (hard limit, "
                        "ulimit -Hn): a collective that talks to every rank (all-to-all) "
                        "will fail; raise the hard limit for the job", size,
                        2 * (size - 1) * channels, channels, _wanted[1], hard)


def out_of_files(e: OSError, size: int) -> str | None:
    """What to say when a connection failed for want of a file (None: it failed for
    another reason)."""
    if e.errno not in _OUT_OF_FILES:
        return None
    if e.errno == errno.ENFILE:
        whose = "the system's limit on open files (fs.file-max) is reached"
    else:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if resource else "?"
        n = open_files()
        whose = (f"this process may open {soft} files (ulimit -n)"
                 + ("" if n is None else f" and has {n} open"))
    return (f"out of open files ({e.strerror}): {whose}; a group of {size} ranks holds up "
            f"to {2 * (size - 1)} connections a rank and channel once every pair has talked "
            "(all-to-all): raise the limit before starting the job")


def _memory(buf: torch.Tensor) -> memoryview:
    """``buf``'s bytes, writable, without a copy (the caller keeps ``buf`` alive)."""
    if not buf.is_cpu:
        raise ValueError(f"ringcomm tcp transport: tensor on {buf.device}; only CPU tensors")
    if not buf.is_contiguous():
        raise ValueError("ringcomm tcp transport: buffers must be contiguous")
    n = buf.nbytes
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(buf.data_ptr())).cast("B")


class _Early:
    """A message that arrived before its receive was started: its bytes, and the
    receive that takes it if one is started before the last byte arrives."""

    __slots__ = ("data", "got", "taker", "seq")

    def __init__(self, nbytes: int, seq: int):
        self.data = bytearray(nbytes)
        self.got = 0
        self.taker: Handle | None = None
        self.seq = seq


class _Out:
    """The connection this rank opened to one peer, and the sends queued on it."""

    __slots__ = ("sock", "queue", "pos", "header", "writing")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.writing = False  # polled for room to write
        self.queue: collections.deque = collections.deque()
        self.pos = 0  # bytes of the first queued message (header included) written
        self.header = b""


class _In:
    """A peer's connection to this rank, and the message being read from it."""

    __slots__ = ("sock", "peer", "header", "hgot", "target", "got", "length", "into")

    def __init__(self, sock: socket.socket, peer: int):
        self.sock, self.peer = sock, peer
        self.header = bytearray(_HEADER.size)
        self.hgot = 0
        self.target: memoryview | None = None  # None: reading a header
        self.got = 0
        self.length = 0
        self.into: Any = None  # the Handle or _Early the payload completes


class TcpTransport(Transport):
    """Rank ``rank`` of ``size`` over TCP; ``peers(rank) -> (address, port, token)``
    finds where a peer listens (read from the group's store when first needed).

    A handle's ``req`` is ``(stream, memory)``; its ``status`` is ``None`` while it
    is active, and the number of bytes moved once complete.
    """

    def __init__(self, rank: int, size: int, listener: socket.socket, token: bytes,
                 peers, connect_s: float):
        super().__init__(rank, size, torch.device("cpu"))
        self._listener, self._token, self._peers = listener, token, peers
        self._connect_s = connect_s
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, None)
        self._lock = threading.RLock()
        self._shut = False  # closed
        self._connecting = threading.Lock()
        self._out: dict[int, _Out] = {}
        self._hello: dict[socket.socket, bytearray] = {}  # accepted, rank not yet read
        self._in: dict[int, _In] = {}
        self._posted: dict[tuple, collections.deque] = {}
        self._early: dict[tuple, collections.deque] = {}
        self._seq = itertools.count()  # arrival order of early messages
        # peer -> (how, when) its connection to this rank, or this rank's to it, ended
        self._closed_in: dict[int, tuple[str, float]] = {}
        self._closed: dict[int, tuple[str, float]] = {}
        self._user: set[Handle] = set()
        self._signs = Signs()
        self._waiting: Sequence[Handle] = ()

    # -- a schedule's messages -------------------------------------------------------
    def send_init(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        return Handle((COLLECTIVE, _memory(buf)), buf, peer, "send", 0, tag)

    def recv_init(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        return Handle((COLLECTIVE, _memory(buf)), buf, peer, "recv", buf.nbytes, tag)

    def start(self, batch: Sequence[Handle]) -> None:
        for h in batch:  # connecting blocks: before the lock, so waits elsewhere go on
            if h.kind == "send" and h.peer not in self._out and h.peer != self.rank:
                self._connect(h.peer)
        with self._lock:
            for h in batch:
                self._start(h)
            self._flush_all()

    def _start(self, h: Handle) -> None:
        h.status = None
        stream = h.req[0]
        if h.kind == "recv":
            self._post(h, stream)
        elif h.peer == self.rank:
            self._arrived(stream, self.rank, h.tag, h.req[1])
            h.status = h.nbytes
        else:
            out = self._out.get(h.peer)
            if out is None:
                why = self._closed.get(h.peer)
                raise TransportPeerLost(f"rank {h.peer}: {why[0] if why else _CLOSED}")
            out.queue.append(h)

    def wait(self, batch: Sequence[Handle]) -> None:
        self._waiting = batch
        self._signs.clear()
        if not self._until(lambda: all(h.status is not None for h in batch), self._deadline,
                           batch):
            raise TransportTimeout(self.timeout_message(
                [h for h in batch if h.status is None]))
        for h in batch:
            if h.kind == "recv" and h.status != h.nbytes:
                raise RuntimeError(f"received {h.status} bytes from rank {h.peer} where "
                                   f"{h.nbytes} were expected: ranks passed different sizes "
                                   "to this collective")

    def waiting_for(self) -> str | None:
        pending = [h for h in self._waiting if h.status is None]
        return self.timeout_message(pending) if pending else None

    def abandon(self, handles: Sequence[Handle], keep=None) -> None:
        super().end()
        with self._lock:
            for h in handles:
                if h.status is not None:
                    continue
                if keep is not None:  # a message being read may still land in either
                    h.buf = (h.buf, keep)
                self._unpost(h)

    # -- users' messages (dist.send / dist.recv) ----------------------------------------
    def p2p_isend(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        self._check_tag(tag)
        h = Handle((USER, _memory(buf)), buf, peer, "send", 0, tag)
        if peer not in self._out and peer != self.rank:
            self._connect(peer)
        with self._lock:
            self._user.add(h)
            self._start(h)
            self._flush_all()
        return h

    def p2p_irecv(self, buf: torch.Tensor, peer: int | None, tag: int) -> Handle:
        self._check_tag(tag)
        h = Handle((USER, _memory(buf)), buf, _ANY if peer is None else peer, "recv",
                   buf.nbytes, tag)
        with self._lock:
            self._user.add(h)
            self._start(h)
        return h

    def p2p_wait(self, handle: Handle, deadline: float) -> bool:
        if not self._until(lambda: handle.status is not None, deadline, (handle,)):
            return False
        return self._user_done(handle)

    def p2p_done(self, handle: Handle) -> bool:
        self.poke()
        return handle.status is not None and self._user_done(handle)

    def _user_done(self, h: Handle) -> bool:
        self._user.discard(h)
        if h.kind == "recv" and h.status != h.nbytes:
            raise RuntimeError(f"ringcomm: dist.recv of {h.nbytes} bytes got a message of "
                               f"{h.status} bytes from rank {h.peer} (tag {h.tag})")
        return True

    def p2p_cancel(self, handle: Handle) -> None:
        with self._lock:
            self._user.discard(handle)
            if handle.status is None:
                self._unpost(handle)

    def user_pending(self) -> bool:
        return bool(self._user)

    def poke(self) -> None:
        self._progress(0.0)

    def _check_tag(self, tag: int) -> None:
        if not 0 <= tag < self.tag_limit:
            raise ValueError(f"ringcomm: tag {tag} is out of range [0, {self.tag_limit - 1}]")

    # -- matching ------------------------------------------------------------------------
    def _post(self, h: Handle, stream: int) -> None:
        """Start receive ``h``: it takes the first early message that matches, else
        waits in line for one."""
        early = self._first_early(stream, h.peer, h.tag)
        if early is None:
            self._posted.setdefault((stream, h.peer, h.tag), collections.deque()).append(
                (next(self._seq), h))
            return
        key, msg = early
        self._early[key].popleft()
        if not self._early[key]:
            del self._early[key]
        if h.peer == _ANY:
            h.peer = key[1]
        if msg.got == len(msg.data):
            self._deliver(h, msg.data)
        else:
            msg.taker = h

    def _first_early(self, stream: int, peer: int, tag: int):
        if peer != _ANY:
            q = self._early.get((stream, peer, tag))
            return ((stream, peer, tag), q[0]) if q else None
        heads = [(q[0].seq, key) for key, q in self._early.items()
                 if q and key[0] == stream and key[2] == tag]
        return (min(heads)[1], self._early[min(heads)[1]][0]) if heads else None

    def _unpost(self, h: Handle) -> None:
        if h.kind == "recv":
            key = (h.req[0], h.peer, h.tag)
            q = self._posted.get(key)
            for i, (_, posted) in enumerate(q or ()):
                if posted is h:
                    del q[i]
                    break
            if key in self._posted and not q:
                del self._posted[key]
        else:
            out = self._out.get(h.peer)
            # a message partly written stays: the stream must stay whole
            if out is not None and h in out.queue and not (out.queue[0] is h and out.pos):
                out.queue.remove(h)
                if not out.queue:
                    self._poll_writes(h.peer, out, False)

    def _taker(self, stream: int, peer: int, tag: int) -> Handle | None:
        """The receive a message takes: the first started of those it matches."""
        heads = [(q[0][0], key) for key in ((stream, peer, tag), (stream, _ANY, tag))
                 if (q := self._posted.get(key))]
        if not heads:
            return None
        key = min(heads)[1]
        q = self._posted[key]
        h = q.popleft()[1]
        if not q:
            del self._posted[key]
        h.peer = peer
        return h

    def _arrived(self, stream: int, peer: int, tag: int, data) -> None:
        """A whole message that needs no reading (a send to this rank itself)."""
        h = self._taker(stream, peer, tag)
        if h is not None:
            self._deliver(h, data)
            return
        msg = _Early(len(data), next(self._seq))
        msg.data[:] = data
        msg.got = len(data)
        self._early.setdefault((stream, peer, tag), collections.deque()).append(msg)

    @staticmethod
    def _deliver(h: Handle, data) -> None:
        if len(data) == h.nbytes:
            h.req[1][:] = data
        h.status = len(data)

    # -- connections ---------------------------------------------------------------------
    def _connect(self, peer: int) -> None:
        """Open this rank's connection to ``peer``: outside the progress lock (it
        blocks), one thread at a time (the peer takes one connection from a rank)."""
        with self._connecting:
            if peer not in self._out:
                self._connect_now(peer)

    def _connect_now(self, peer: int) -> None:
        if peer in self._closed:
            raise TransportPeerLost(f"rank {peer}: {self._closed[peer][0]}")
        if not 0 <= peer < self.size:
            raise ValueError(f"ringcomm tcp transport: no rank {peer} in a group of {self.size}")
        address, port, token = self._peers(peer)
        limit = min(self._connect_s, max(self._deadline - _monotonic(), 0.001))
        sock = None
        try:
            sock = socket.create_connection((address, port), timeout=limit)
            sock.sendall(_HELLO.pack(token, self.rank))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
        except OSError as e:
            if sock is not None:
                sock.close()
            files = out_of_files(e, self.size)
            why = (f"({files})" if files else
                   f"({e}); RINGCOMM_IFACE names the interface every rank listens on")
            raise RuntimeError(f"ringcomm tcp transport: rank {self.rank} cannot connect to "
                               f"rank {peer} at {address}:{port} {why}") from None
        with self._lock:
            if self._shut:
                sock.close()
                raise TransportAborted(self._stop or "the tcp transport was closed")
            self._out[peer] = _Out(sock)
            # the peer never writes here: readable means it closed
            self._sel.register(sock, selectors.EVENT_READ, ("out", peer))

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as e:  # none waiting, or the connection was aborted
                files = out_of_files(e, self.size)
                if files:
                    # the peer's connection stays queued, its messages unread, and the
                    # listener readable: failing here names why, where waiting would
                    # spin until the deadline
                    raise RuntimeError(f"ringcomm tcp transport: rank {self.rank} cannot "
                                       f"accept a connection: {files}") from None
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._hello[sock] = (bytearray(), _monotonic())
            self._sel.register(sock, selectors.EVENT_READ, ("hello", sock))

    def _read_hello(self, sock: socket.socket) -> None:
        got = self._hello[sock][0]
        try:
            chunk = sock.recv(_HELLO.size - len(got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        got += chunk
        if chunk and len(got) < _HELLO.size:
            return
        del self._hello[sock]
        self._sel.unregister(sock)
        token, peer = _HELLO.unpack(bytes(got)) if len(got) == _HELLO.size else (b"", -1)
        if token != self._token or not 0 <= peer < self.size or peer in self._in:
            sock.close()  # not this group's (another job, a stale rank): refused
            return
        self._in[peer] = _In(sock, peer)
        self._sel.register(sock, selectors.EVENT_READ, ("in", peer))

    def _lost(self, peer: int, how: str, incoming: bool) -> None:
        """The connection from (``incoming``) or to ``peer`` ended, ``how``. Its other
        connection stays: the bytes the peer sent before it ended are still read."""
        closed, conns = (self._closed_in, self._in) if incoming else (self._closed, self._out)
        closed.setdefault(peer, (how, _monotonic()))
        conn = conns.pop(peer, None)
        if conn is not None:
            self._sel.unregister(conn.sock)
            conn.sock.close()

    # -- moving bytes ----------------------------------------------------------------------
    def _flush_all(self) -> None:
        for peer, out in list(self._out.items()):
            if out.queue:
                self._flush(peer, out)

    def _flush(self, peer: int, out: _Out) -> None:
        sock, queue = out.sock, out.queue
        while queue:
            h = queue[0]
            mem = h.req[1]
            if out.pos == 0:
                out.header = _HEADER.pack(h.req[0], h.tag, h.nbytes)
            hn = len(out.header)
            parts = [out.header[out.pos:], mem] if out.pos < hn else [mem[out.pos - hn:]]
            try:
                n = sock.sendmsg(parts)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:  # the waits that need this peer report it (_gone)
                self._lost(peer, f"its connection failed ({e})", False)
                return
            out.pos += n
            if out.pos < hn + h.nbytes:
                self._poll_writes(peer, out, True)
                return
            queue.popleft()
            out.pos = 0
            h.status = h.nbytes
        self._poll_writes(peer, out, False)

    def _poll_writes(self, peer: int, out: _Out, on: bool) -> None:
        if out.writing != on:
            out.writing = on
            self._sel.modify(out.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0),
                             ("out", peer))

    def _read(self, conn: _In) -> None:
        sock, budget = conn.sock, READ_BYTES
        while budget > 0:  # what is left is read at the next poll (epoll still says so)
            try:
                if conn.target is None:
                    n = sock.recv_into(memoryview(conn.header)[conn.hgot:])
                else:
                    n = sock.recv_into(conn.target[conn.got:])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._lost(conn.peer, f"its connection failed ({e})", True)
                return
            if n == 0:
                self._lost(conn.peer, _CLOSED, True)
                return
            budget -= n
            if conn.target is None:
                conn.hgot += n
                if conn.hgot < _HEADER.size:
                    continue
                conn.hgot = 0
                stream, tag, length = _HEADER.unpack(conn.header)
                self._begin(conn, stream, tag, length)
            else:
                conn.got += n
            if conn.got == conn.length:
                self._complete(conn)

    def _begin(self, conn: _In, stream: int, tag: int, length: int) -> None:
        conn.got, conn.length = 0, length
        h = self._taker(stream, conn.peer, tag)
        if h is not None and length == h.nbytes:
            conn.into, conn.target = h, h.req[1]
        elif h is not None:  # the wrong size: read it aside, then fail the receive
            conn.into, conn.target = h, memoryview(bytearray(length))
        else:
            msg = _Early(length, next(self._seq))
            self._early.setdefault((stream, conn.peer, tag), collections.deque()).append(msg)
            conn.into, conn.target = msg, memoryview(msg.data)

    def _complete(self, conn: _In) -> None:
        into = conn.into
        if isinstance(into, _Early):
            into.got = conn.length
            if into.taker is not None:
                self._deliver(into.taker, into.data)
        else:
            into.status = conn.length
        conn.target, conn.into = None, None

    def _progress(self, timeout: float) -> None:
        """Move what can move now, having waited up to ``timeout`` for anything to."""
        if self._shut:
            raise TransportAborted(self._stop or "the tcp transport was closed")
        try:
            events = self._sel.select(timeout)
        except (ValueError, OSError):  # closed by another thread meanwhile
            raise TransportAborted(self._stop or "the tcp transport was closed") from None
        with self._lock:
            for key, mask in events:
                what = key.data
                if what is None:
                    self._accept()
                elif what[0] == "hello":
                    if what[1] in self._hello:
                        self._read_hello(what[1])
                elif what[0] == "in":
                    conn = self._in.get(what[1])
                    if conn is not None:
                        self._read(conn)
                else:
                    out = self._out.get(what[1])
                    if out is None:
                        continue
                    if mask & selectors.EVENT_READ:
                        self._out_readable(what[1], out)
                    elif out.queue:
                        self._flush(what[1], out)
            self._flush_all()

    def _out_readable(self, peer: int, out: _Out) -> None:
        try:
            data = out.sock.recv(1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            data, why = b"", f"its connection failed ({e})"
        else:
            why = _CLOSED
        if not data:
            self._lost(peer, why, False)

    def _until(self, done, deadline: float, handles: Sequence[Handle]) -> bool:
        """Progress until ``done()`` (True) or ``deadline`` (False); raises once
        interrupted, or once a peer ``handles`` need is gone or in another call."""
        if self._stop is not None:
            raise TransportAborted(self._stop)
        self._progress(0.0)
        if done():
            return True
        next_probe = _monotonic() + PROBE_S
        while True:
            if self._stop is not None:
                raise TransportAborted(self._stop)
            now = _monotonic()
            if now >= deadline:
                return False
            self._check_peers(handles, now >= next_probe)
            if now >= next_probe:
                next_probe = now + PROBE_S
            self._progress(min(POLL_S, deadline - now))
            if done():
                return True

    def _check_peers(self, handles: Sequence[Handle], probe: bool) -> None:
        pending = [h for h in handles if h.status is None]
        with self._lock:  # another thread's progress changes what is looked at
            gone = [(h, how) for h in pending if (how := self._gone(h)) is not None]
            firsts = {h.peer: self._first_tag_from(h.peer) for h in pending if probe
                      and h.kind == "recv" and h.req[0] == COLLECTIVE and h.peer != _ANY}
        for h, how in gone[:1]:
            # how it left, if it or a rank it failed said so
            said = (self.peer_failure((h.peer,), gone=True)
                    if self.peer_failure is not None else None)
            if said is not None:
                raise TransportPeerFailed(said)
            raise TransportPeerLost(f"rank {h.peer}: {how}, while rank {self.rank} waited "
                                    "for it")
        if not probe:
            return
        for h in pending:
            if h.peer in firsts and h.kind == "recv":
                found = firsts[h.peer]
                if found is None or found == h.tag:
                    self._signs.gone(h)
                elif self._signs.lasted(h, found, _monotonic()):
                    raise TransportMismatch(h.peer, h.tag, found)
            reported = (self.peer_failure((h.peer,)) if self.peer_failure is not None
                        and h.peer != _ANY else None)
            if reported is not None:
                raise TransportPeerFailed(reported)

    def _gone(self, h: Handle) -> str | None:
        """How ``h``'s peer went, if it cannot complete ``h`` any more: a send's
        connection ended; a receive's connection from the peer ended (every byte
        before its end was read), or the peer never connected and this rank's
        connection to it ended :data:`LOST_GRACE_S` ago with no connection waiting."""
        if h.kind == "send":
            closed = self._closed.get(h.peer)
            return None if closed is None else closed[0]
        closed = self._closed_in.get(h.peer)
        if closed is not None:
            return closed[0]
        closed, now = self._closed.get(h.peer), _monotonic()
        if (closed is None or h.peer in self._in or now - closed[1] < LOST_GRACE_S
                or any(now - t < LOST_GRACE_S for _, t in self._hello.values())):
            return None
        return closed[0]

    def _first_tag_from(self, peer: int) -> int | None:
        """The tag of the first early collective message from ``peer`` (messages
        from one peer arrive in the order it sent them)."""
        heads = [(q[0].seq, key[2]) for key, q in self._early.items()
                 if q and key[0] == COLLECTIVE and key[1] == peer]
        return min(heads)[1] if heads else None

    def close(self) -> None:
        with self._lock:
            self._shut = True
            for conn in [*self._in.values(), *self._out.values()]:
                conn.sock.close()
            for sock in self._hello:
                sock.close()
            self._in, self._out, self._hello = {}, {}, {}
            self._sel.close()
            self._listener.close()


def listener(address: str, backlog: int) -> socket.socket:
    """A non-blocking socket listening on a free port of ``address``.

    Raises:
        RuntimeError: ``address`` is not this host's (names it).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((address, 0))
        sock.listen(min(socket.SOMAXCONN, max(backlog, 16)))
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise RuntimeError(f"ringcomm tcp transport: cannot listen on {address} ({e}); "
                           "RINGCOMM_IFACE names the interface to use") from None
    return sock
