"""FakeNccl: a stand-in for ``cupy.cuda.nccl`` over CPU memory, so the process
group's CUDA path (communicators through the store, pointers, byte counts, type
codes, groups, NCCL's own collectives, aborts) runs where there is no GPU.
:func:`ringcomm.testing.nccl_groups` runs process groups over it on threads.

It is meant to fail where NCCL and CUDA fail, not to be kinder:

* group depth is per thread, and an error inside a group is raised at once and
  again at the outermost ``groupEnd``; a thread that never closes its group
  queues every later call it makes, which then never runs;
* a communicator after ``abort()`` or ``destroy()`` refuses every call (CuPy
  zeroes its handle: NCCL's "invalid argument");
* ``abort()`` or ``destroy()`` while another thread is inside NCCL on the same
  communicator (a use after free in NCCL) is recorded in ``unsafe``;
* work runs on streams, later: ``groupEnd`` only enqueues its group on the stream
  its calls name (:mod:`ringcomm.testing.sim_stream`, one thread per stream), which
  runs it in stream order once the peers' matching groups are there; torch ops
  issued on that stream wait their turn too, so a Work is pending until its stream
  got there, and output read without waiting for it is stale. A stream handle the
  stand-in never made is refused, as CUDA refuses it;
* a schedule that would hang on a GPU hangs here too (until ringcomm's watchdog
  aborts the communicator), and the cycle is recorded in ``hung``;
* creating a communicator blocks until all its ranks call it, and ``destroy()``
  blocks until the communicator's work has run, as NCCL's do;
* :class:`FakeStreams` issues collectives "on a stream" as CUDA's engine does,
  and refuses memory that NCCL used but that was not recorded on that stream
  (CUDA's caching allocator could hand it to another stream meanwhile);
* ``ncclAvg`` multiplies each input by 1/nRanks before summing, as NCCL does.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import logging
import os
import threading
import time
from typing import Any

import torch

from ringcomm.runtime.streams import HostStreams
from ringcomm.execution.simulator import SimFabric, SimulatorError
from ringcomm.testing.sim_stream import Deferred, SimEvent, SimStream
from ringcomm.transport.nccl import CUPY_UNNAMED, DTYPE_CODES, ERROR_NAMES

log = logging.getLogger("ringcomm")

#: the stream handle of CUDA's legacy default stream: work on it runs on the host,
#: as it is issued
NULL_STREAM = 0

#: ncclGetErrorString's text per status (nccl.h ncclResult_t)
_ERROR_TEXT = {1: "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
               2: "unhandled system error (run with NCCL_DEBUG=INFO for details)",
               3: "internal error - please report this issue to the NCCL developers",
               4: "invalid argument (run with NCCL_DEBUG=WARN for details)",
               5: "invalid usage (run with NCCL_DEBUG=WARN for details)",
               6: "remote process exited or there was a network error"}


class FakeNcclError(RuntimeError):
    """CuPy's ``NcclError``: the status code in ``status``, ``"NAME: text"`` as message.
    As CuPy's, it cannot be made for a status its name table lacks (7
    ``ncclInProgress``, 8 ``ncclTimeout``): the constructor raises ``KeyError(status)``,
    which is then what the failing call raises."""

    def __init__(self, status: int):
        if status in CUPY_UNNAMED:
            raise KeyError(status)
        self.status = status
        super().__init__(f"{ERROR_NAMES.get(status, status)}: {_ERROR_TEXT.get(status, '')}")


class FakeNccl:
    """A stand-in for ``cupy.cuda.nccl`` over CPU memory, for running ringcomm's
    NCCL path (communicator set-up through the store, pointers, byte counts, type
    codes, groups, NCCL's own collectives, aborts) where there is no GPU.

    Messages follow NCCL's rules through :class:`ringcomm.execution.simulator.SimFabric`.
    ``groupEnd()`` enqueues the group on the stream its calls name (a
    :class:`ringcomm.testing.sim_stream.SimStream` made by :meth:`new_stream`); the
    stream's thread runs it once every peer's matching group is there. A schedule
    that would hang on a GPU hangs there too, until the communicator is aborted,
    and the cycle NCCL's rules find is kept in ``hung``. On the null stream
    (handle 0) a group runs on the host as it ends. NCCL's own collectives are
    lowered to messages to every peer plus a local reduction.

    Pass it as ``nccl=`` to :class:`ringcomm.ProcessGroupRingcomm` with
    ``nccl_device_type="cpu"``; :func:`nccl_groups` does that for a whole world.

    With ``record=True`` nothing moves: every call is counted (``calls``) and
    returns at once, and a communicator needs no peers. That measures the Python
    time of ringcomm's CUDA path alone (``scripts/bench_cuda_path.py``).

    Args:
        id_form: what ``get_unique_id`` returns: ``"bytes"`` (CuPy 14) or
            ``"tuple"`` of signed chars (CuPy 13); the communicator takes only that.
        timeout_s: how long a host call may block (creating a communicator, a
            ``destroy``, a host wait on a stream) before it is reported instead of
            hanging the test; a group on a stream waits until it is aborted.
        record: count the calls and do nothing else.
        delay_s: how long each group takes once it can run (a kernel's time), so a
            test can count on a collective finishing after the host moved on.
    """

    available = True
    NcclError = FakeNcclError

    def __init__(self, id_form: str = "bytes", timeout_s: float = 60.0, record: bool = False,
                 delay_s: float = 0.0):
        if id_form not in ("bytes", "tuple"):
            raise ValueError(f"FakeNccl: id_form must be 'bytes' or 'tuple', got {id_form!r}")
        self.id_form = id_form
        self.timeout_s = timeout_s
        self.record = record
        self._fabrics: dict[bytes, SimFabric] = {}
        self._lock = threading.Lock()
        self._tls = threading.local()
        self.calls: dict[str, int] = collections.defaultdict(int)  # per method, for tests
        #: what NCCL would have done wrong (a use after free): abort or destroy while
        #: another thread was inside NCCL on that communicator
        self.unsafe: list[str] = []
        #: faults to inject: (method, rank) -> NCCL status the next such call returns
        self.faults: dict[tuple[str, int], int] = {}
        #: what ncclGetLastError would say after the last error
        self.last_error_text = ""
        self._detail = ""
        self.delay_s = delay_s
        #: the simulated streams, by handle
        self._streams: dict[int, SimStream] = {}
        self._handles = itertools.count(0x5700)
        #: what NCCL's rules found stuck: groups that would hang a GPU
        self.hung: list[str] = []
        #: ranks that joined each communicator being made, by unique id
        self._joined: dict[bytes, int] = collections.defaultdict(int)
        self._joining = threading.Condition(self._lock)

    def new_stream(self, name: str) -> tuple[int, SimStream]:
        """A simulated stream and its handle (``cudaStreamCreate``)."""
        with self._lock:
            handle = next(self._handles)
            stream = self._streams[handle] = SimStream(f"{name}#{handle:#x}", self.timeout_s)
        return handle, stream

    def _stream(self, handle: int, method: str) -> SimStream | None:
        """The stream of ``handle`` (None: the null stream, on the host).

        Raises:
            FakeNcclError: a handle no stream has (CUDA's invalid resource handle,
                which NCCL reports as an unhandled CUDA error).
        """
        if handle == NULL_STREAM:
            return None
        stream = self._streams.get(handle)
        if stream is None:
            raise self._error(1, f"{method}: stream {handle:#x} is not a stream of this "
                                 "process (cudaErrorInvalidResourceHandle)")
        return stream

    def fail_next(self, method: str, rank: int, status: int = 2,
                  detail: str = "injected by FakeNccl.fail_next") -> None:
        """Make ``rank``'s next call of ``method`` (a communicator method, or
        ``"NcclCommunicator"``: its creation) fail with ``status`` (2: a system
        error, as a lost socket gives) and ``detail`` as ncclGetLastError's text."""
        self.faults[(method, rank)] = status
        self._detail = detail

    def last_error(self) -> str:
        """What ``ncclGetLastError`` returns: the detail of the last error."""
        return self.last_error_text

    def ringcomm_streams(self, device: torch.device) -> "FakeStreams":
        """The streams ringcomm's engine drives over this stand-in (its CUDA
        semantics; see :class:`FakeStreams`; unchecked when recording, so that only
        ringcomm's own path is timed)."""
        return FakeStreams(device, self, check=not self.record)

    @staticmethod
    def get_version() -> int:
        return 22703

    def get_unique_id(self) -> Any:
        raw = os.urandom(128)
        if self.id_form == "bytes":
            return raw
        return tuple(x - 256 if x > 127 else x for x in raw)

    def NcclCommunicator(self, ndev: int, uid: Any, rank: int) -> "_FakeComm":  # noqa: N802
        self.calls["NcclCommunicator"] += 1
        want = bytes if self.id_form == "bytes" else tuple
        if not isinstance(uid, want):
            raise TypeError(f"FakeNccl({self.id_form!r}): the unique id must be "
                            f"{want.__name__}, got {type(uid).__name__}")
        if self.record:
            if not 0 <= rank < ndev:
                raise ValueError(f"FakeNccl: rank {rank} does not fit a communicator of {ndev}")
            return _RecordingComm(self, rank, ndev)
        status = self.faults.pop(("NcclCommunicator", rank), None)
        if status is not None:
            raise self._error(status, self._detail)
        key = bytes(x & 0xFF for x in uid)
        with self._lock:
            fabric = self._fabrics.setdefault(key, SimFabric(ndev))
        if fabric.size != ndev or not 0 <= rank < ndev:
            raise ValueError(f"FakeNccl: rank {rank} of {ndev} does not fit a communicator "
                             f"of {fabric.size}")
        # ncclCommInitRank returns once every rank of the communicator called it
        deadline = time.monotonic() + self.timeout_s
        with self._joining:
            self._joined[key] += 1
            self._joining.notify_all()
            while self._joined[key] < ndev:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"FakeNccl: ncclCommInitRank (rank {rank} of {ndev}) "
                                       f"would wait forever: only {self._joined[key]} of "
                                       f"{ndev} ranks joined within {self.timeout_s:g}s")
                self._joining.wait(left)
        return _FakeComm(self, fabric.comm(rank))

    # -- groups (per thread, as in NCCL) --------------------------------------------
    def groupStart(self) -> None:  # noqa: N802
        self.calls["groupStart"] += 1
        if self.record:
            return
        depth = getattr(self._tls, "depth", 0)
        if depth == 0:
            self._tls.ops = []
            self._tls.error = None
        self._tls.depth = depth + 1

    def groupEnd(self) -> None:  # noqa: N802
        self.calls["groupEnd"] += 1
        if self.record:
            return
        depth = getattr(self._tls, "depth", 0)
        if depth == 0:
            raise self._error(5, "ncclGroupEnd: not in a group call")
        # as ncclGroupEndInternal: the depth drops first, whatever follows
        self._tls.depth = depth - 1
        if depth == 1:
            ops, self._tls.ops = self._tls.ops, []
            err, self._tls.error = self._tls.error, None
            if err is not None:  # the group's first error, and nothing of it runs
                raise err
            self._launch(ops)

    def group_depth(self) -> int:
        """This thread's group depth (NCCL's ``ncclGroupDepth``), for tests."""
        return getattr(self._tls, "depth", 0)

    def _error(self, status: int, detail: str) -> FakeNcclError:
        self.last_error_text = detail
        return FakeNcclError(status)

    def _enter(self, comm: "_FakeComm", method: str) -> None:
        """The checks NCCL makes on entry of a communicator call: a failure is
        raised now and, inside a group, again at its outermost ``groupEnd``."""
        self.calls[method] += 1
        status = self.faults.pop((method, comm.rank), None)
        err = None
        if comm.handle == 0:
            err = self._error(4, f"{method}: comm argument is NULL (the communicator was "
                                 f"{comm.ended})")
        elif status is not None:
            err = self._error(status, self._detail)
        if err is not None:
            if getattr(self._tls, "depth", 0) and self._tls.error is None:
                self._tls.error = err
            raise err

    def _touch(self, comm: "_FakeComm", ptr: int, count: int, code: int,
               what: str) -> torch.Tensor:
        """The memory a call reads or writes, noted for :class:`FakeStreams`."""
        t = memory_at(ptr, count, code)
        touched = getattr(self._tls, "touched", None)
        if touched is not None and t.numel():
            touched.append((ptr, t.numel() * t.element_size(), what))
        return t

    def _enqueue(self, comm: "_FakeComm", stream: int, sends: list, recvs: list,
                 post=None) -> None:
        """``sends``: ``(peer, tensor)``; ``recvs``: ``(peer, tensor)``; ``post``: runs
        once the group completed; ``stream``: the handle the call named."""
        item = (comm, self._stream(stream, "enqueue"), sends, recvs, post)
        if getattr(self._tls, "depth", 0):
            self._tls.ops.append(item)
        else:  # a lone call is a group of its own
            self._launch([item])

    def _launch(self, items: list) -> None:
        """A group ends: on the null stream it runs now, on the host; otherwise it is
        enqueued on the stream of its first call (a group's calls name one stream)."""
        if not items:
            return
        stream = items[0][1]
        comms = list(dict.fromkeys(item[0] for item in items))
        if stream is None:
            me = threading.get_ident()
            for c in comms:
                c.inside.add(me)
            try:
                self._run(items, comms, host=True)
            finally:
                for c in comms:
                    c.inside.discard(me)
            return
        for c in comms:
            c._started()
        stream.enqueue(lambda: self._run(items, comms, host=False),
                       f"an NCCL group of rank {comms[0].rank}")

    def _run(self, items: list, comms: list, host: bool) -> None:
        """Run one group to its end under NCCL's rules (on its stream's thread, or on
        the host for the null stream)."""
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            for c in comms:
                c.sim.group_start()
            for comm, _, sends, recvs, _ in items:
                for peer, t in sends:
                    comm.sim.send(t, peer)
                for peer, t in recvs:
                    comm.sim.recv(t, peer)
            for c in comms:
                c.sim.group_end("group")
            for c in comms:
                if host:
                    c.sim.synchronize(self.timeout_s)
                elif not self._wait_on_stream(c):
                    return  # aborted: the kernel ends, its data are garbage
            for *_, post in items:
                if post is not None:
                    post()
        finally:
            if not host:
                for c in comms:
                    c._finished()

    def _wait_on_stream(self, c: "_FakeComm") -> bool:
        """Wait, as a kernel does, until the group of ``c`` completed: True; False once
        ``c`` is aborted or destroyed. A group NCCL's rules find stuck waits (as on a
        GPU) until then, its cycle recorded in ``hung``."""
        while True:
            try:
                c.sim.synchronize(1.0)
                return True
            except SimulatorError as e:
                if not c.handle:
                    return False
                if c.sim.fabric._error is None:
                    continue  # a peer has not issued its group yet
                self.hung.append(str(e))
                log.warning("FakeNccl: rank %d's stream is stuck (a GPU would hang here "
                            "until the communicator is aborted): %s", c.rank, e)
                while c.handle:
                    time.sleep(0.02)
                return False


#: NCCL type code -> torch dtype
_FAKE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def memory_at(ptr: int, count: int, code: int) -> torch.Tensor:
    """The ``count`` elements of type ``code`` at address ``ptr``, as a tensor."""
    dtype = _FAKE_DTYPES[code]
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    raw = (ctypes.c_char * nbytes).from_address(ptr)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype)


def _fold(parts: list, op: int) -> torch.Tensor:
    if op == 4 and parts[0].is_floating_point():
        # ncclAvg on floating types is ncclDevPreMulSum: each input times 1/nRanks
        # (rounded to the element type), then a sum
        scale = float(torch.tensor(1.0 / len(parts), dtype=parts[0].dtype))
        parts = [x * scale for x in parts]
        op = 0
    acc = parts[0].clone()
    for x in parts[1:]:
        if op in (0, 4):
            acc.add_(x)
        elif op == 1:
            acc.mul_(x)
        elif op == 2:
            torch.maximum(acc, x, out=acc)
        elif op == 3:
            torch.minimum(acc, x, out=acc)
        else:
            raise ValueError(f"FakeNccl: unknown op code {op}")
    if op == 4:  # integers: a sum, then a division truncating toward zero
        acc = torch.div(acc, len(parts), rounding_mode="trunc")
    return acc


class _FakeComm:
    """One rank's communicator of a :class:`FakeNccl`."""

    def __init__(self, lib: FakeNccl, sim: Any):
        self.lib = lib
        self.sim = sim
        self.rank, self.size = sim.rank, sim.size
        #: CuPy's ``_comm``: 0 once aborted or destroyed
        self.handle = id(self)
        self.ended = ""
        #: threads inside a call of this communicator now
        self.inside: set[int] = set()
        #: groups enqueued on a stream and not run to their end yet
        self._pending = 0
        self._idle = threading.Condition()

    def _started(self) -> None:
        with self._idle:
            self._pending += 1

    def _finished(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    @property
    def aborted(self) -> bool:
        return self.ended == "aborted"

    def _others(self) -> list[int]:
        return [r for r in range(self.size) if r != self.rank]

    def _mem(self, ptr: int, count: int, code: int, what: str) -> torch.Tensor:
        return self.lib._touch(self, ptr, count, code, what)

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self.lib._enter(self, "send")
        self.lib._enqueue(self, stream,
                          [(peer, self._mem(sendbuf, count, datatype, f"send to {peer}"))], [])

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self.lib._enter(self, "recv")
        self.lib._enqueue(self, stream, [], [(peer, self._mem(recvbuf, count, datatype,
                                                              f"recv from {peer}"))])

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,  # noqa: N802
                  stream: int) -> None:
        self.lib._enter(self, "allReduce")
        mine = self._mem(sendbuf, count, datatype, "sendbuf")
        theirs = {r: torch.empty_like(mine) for r in self._others()}
        dst = self._mem(recvbuf, count, datatype, "recvbuf")

        def post():
            parts = [mine if r == self.rank else theirs[r] for r in range(self.size)]
            dst.copy_(_fold(parts, op))

        self.lib._enqueue(self, stream, [(r, mine) for r in theirs], list(theirs.items()), post)

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int,
               stream: int) -> None:
        self.lib._enter(self, "reduce")
        mine = self._mem(sendbuf, count, datatype, "sendbuf")
        if self.rank != root:
            self.lib._enqueue(self, stream, [(root, mine)], [])
            return
        theirs = {r: torch.empty_like(mine) for r in self._others()}
        dst = self._mem(recvbuf, count, datatype, "recvbuf")

        def post():
            parts = [mine if r == self.rank else theirs[r] for r in range(self.size)]
            dst.copy_(_fold(parts, op))

        self.lib._enqueue(self, stream, [], list(theirs.items()), post)

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int,
                  stream: int) -> None:
        self.lib._enter(self, "broadcast")
        if self.rank == root:
            src = self._mem(sendbuff, count, datatype, "sendbuff")
            dst = self._mem(recvbuff, count, datatype, "recvbuff")

            def post():
                if sendbuff != recvbuff:
                    dst.copy_(src)

            self.lib._enqueue(self, stream, [(r, src) for r in self._others()], [], post)
        else:
            self.lib._enqueue(self, stream, [],
                              [(root, self._mem(recvbuff, count, datatype, "recvbuff"))])

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int,  # noqa: N802
                  stream: int) -> None:
        self.lib._enter(self, "allGather")
        mine = self._mem(sendbuf, count, datatype, "sendbuf")
        out = (self._mem(recvbuf, count * self.size, datatype, "recvbuf").view(self.size, -1)
               if count else None)

        def post():
            if out is not None:
                out[self.rank].copy_(mine)

        self.lib._enqueue(self, stream, [(r, mine) for r in self._others()],
                          [(r, out[r]) for r in self._others()] if out is not None else [], post)

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int,  # noqa: N802
                      op: int, stream: int) -> None:
        self.lib._enter(self, "reduceScatter")
        if not recvcount:
            return
        blocks = self._mem(sendbuf, recvcount * self.size, datatype, "sendbuf").view(self.size, -1)
        theirs = {r: torch.empty_like(blocks[0]) for r in self._others()}
        dst = self._mem(recvbuf, recvcount, datatype, "recvbuf")

        def post():
            parts = [blocks[r] if r == self.rank else theirs[r] for r in range(self.size)]
            dst.copy_(_fold(parts, op))

        self.lib._enqueue(self, stream, [(r, blocks[r]) for r in theirs], list(theirs.items()),
                          post)

    def check_async_error(self) -> None:
        # ncclCommGetAsyncError: an injected status (fail_next("check_async_error"))
        status = self.lib.faults.pop(("check_async_error", self.rank), None)
        if status is not None:
            raise self.lib._error(status, self.lib._detail)

    def abort(self) -> None:
        self.lib.calls["abort"] += 1
        # the kernels end first (no peer's message lands in this rank's buffers after
        # this), then the handle: a stream that sees it zeroed frees the buffers
        self.sim.abort()
        self._end("aborted")

    def destroy(self) -> None:
        """ncclCommDestroy: finalizes first, which waits until every operation of the
        communicator has run (so it blocks while a peer never comes)."""
        self.lib.calls["destroy"] += 1
        if self.handle:
            me = threading.get_ident()
            self.inside.add(me)
            try:
                with self._idle:
                    if not self._idle.wait_for(lambda: self._pending == 0, self.lib.timeout_s):
                        raise RuntimeError(
                            f"FakeNccl: ncclCommDestroy (rank {self.rank}) would wait forever: "
                            f"{self._pending} group(s) of the communicator never completed "
                            f"within {self.lib.timeout_s:g}s (abort it instead)")
            finally:
                self.inside.discard(me)
        self._end("destroyed")
        self.sim.close()

    def _end(self, how: str) -> None:
        """As CuPy: a no-op once ended; otherwise the communicator is freed and its
        handle zeroed. Freeing it under a thread still inside NCCL on it is a use
        after free in NCCL: recorded."""
        if not self.handle:
            return
        others = self.inside - {threading.get_ident()}
        if others:
            self.lib.unsafe.append(f"rank {self.rank}: the communicator was {how} while "
                                   f"{len(others)} other thread(s) were inside NCCL on it")
        self.handle, self.ended = 0, how


class FakeStreams(HostStreams):
    """The streams of a CUDA device as ringcomm's stream engine drives them, over
    :class:`FakeNccl`: the internal stream is a simulated one
    (:class:`ringcomm.testing.sim_stream.SimStream`); a collective's NCCL groups and
    the torch ops issued with them (:class:`ringcomm.testing.sim_stream.Deferred`)
    run on it later, in order; its end is an event that completes when the stream
    gets there. The caller's current stream is the host, where torch ops run as they
    are issued: waiting on it for an event (``Work.wait()``) blocks until the event
    completed; on a simulated stream (another channel's, while it enqueues) that
    stream waits instead, as ``cudaStreamWaitEvent`` makes it.

    What CUDA's caching allocator would punish is refused here: every byte that an
    NCCL call of the collective read or wrote must lie in a tensor recorded on the
    stream (:meth:`keep_alive`). Memory allocated on the caller's stream and used
    on the internal one without that can be handed out again, on the caller's
    stream, while NCCL still uses it.

    With ``check=False`` (a recording :class:`FakeNccl`) nothing is simulated: work
    completes as it is issued.
    """

    inline = False
    keeps = True

    def __init__(self, device: torch.device, lib: FakeNccl, check: bool = True):
        super().__init__(device)
        self.lib = lib
        self._kept: list[tuple[int, int]] = []
        self.check = check
        if check:
            self.handle, self.stream = lib.new_stream(str(device))
        else:
            self.handle, self.stream = 0x57, None  # a stream handle as an int, as CUDA's

    def on_stream(self) -> Any:
        return self._checked() if self.check else contextlib.nullcontext()

    @contextlib.contextmanager
    def _checked(self) -> Any:
        tls = self.lib._tls
        tls.touched, self._kept, held = [], [], []
        self._held = held
        outer = getattr(tls, "current", None)
        tls.current = self.stream
        try:
            with Deferred(self.stream):
                yield
            touched = tls.touched
        finally:
            tls.touched, tls.current = None, outer
            # what record_stream does for the caching allocator: the tensors stay
            # allocated until the stream has run everything issued with them
            self.stream.enqueue(held.clear, "release recorded tensors")
        for ptr, n, what in touched:
            if not any(a <= ptr and ptr + n <= e for a, e in self._kept):
                raise RuntimeError(
                    f"FakeNccl: NCCL's {what} used {n} bytes at {ptr:#x} that were not "
                    "recorded on the collective's stream (record_stream): CUDA's caching "
                    "allocator could hand them to another stream while NCCL still uses them")

    def keep_alive(self, tensors: Any) -> None:
        if not self.check:
            return
        for t in tensors:
            st = t.untyped_storage()
            self._kept.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
            self._held.append(t)

    def record(self) -> Any:
        return self.stream.record() if self.stream is not None else super().record()

    def wait_on_current(self, event: Any) -> None:
        if not isinstance(event, SimEvent):
            return
        current = getattr(self.lib._tls, "current", None)
        if current is not None:
            current.wait_event(event)
        elif not event.wait(self.lib.timeout_s):
            raise RuntimeError(f"FakeNccl: the host waited {self.lib.timeout_s:g}s for a "
                               f"collective on stream {self.stream.name} that never "
                               "completed (on a GPU it would wait forever)")

    def future_after(self, event: Any, value: Any) -> torch.futures.Future:
        if not isinstance(event, SimEvent):
            return super().future_after(event, value)
        fut: torch.futures.Future = torch.futures.Future()

        def complete() -> None:
            # off the stream's thread, as torch completes a CUDA future's callbacks: a
            # callback that waits on the stream must not hold the stream up
            if event.wait(self.lib.timeout_s):
                fut.set_result(value)
            else:
                fut.set_exception(RuntimeError("FakeNccl: the collective never completed"))

        threading.Thread(target=complete, daemon=True, name="fake-cuda-future").start()
        return fut


class _RecordingComm:
    """A communicator of a recording :class:`FakeNccl`: every call is counted and
    returns at once (argument lists as ``cupy.cuda.nccl.NcclCommunicator``'s)."""

    def __init__(self, lib: FakeNccl, rank: int, size: int):
        self.lib, self.rank, self.size = lib, rank, size
        self._calls = lib.calls

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._calls["send"] += 1

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._calls["recv"] += 1

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,  # noqa: N802
                  stream: int) -> None:
        self._calls["allReduce"] += 1

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int,
               stream: int) -> None:
        self._calls["reduce"] += 1

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int,
                  stream: int) -> None:
        self._calls["broadcast"] += 1

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int,  # noqa: N802
                  stream: int) -> None:
        self._calls["allGather"] += 1

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int,  # noqa: N802
                      op: int, stream: int) -> None:
        self._calls["reduceScatter"] += 1

    def check_async_error(self) -> None:
        pass

    def abort(self) -> None:
        self._calls["abort"] += 1

    def destroy(self) -> None:
        self._calls["destroy"] += 1
