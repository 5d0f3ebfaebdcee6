"""Collectives on a CUDA stream, with the semantics of torch's NCCL backend.

A collective is *enqueued* on the caller's thread, in issue order, on the
group's internal stream of that device:

1. the internal stream waits for the caller's current stream (inputs are ready);
2. the collective's NCCL groups and torch ops are issued on the internal stream;
3. every tensor it touches is marked as used there (``record_stream``), so the
   caching allocator cannot hand its memory out before the work has finished;
4. an end event is recorded, and a CUDA-aware future is completed with the
   outputs (waiting on it synchronises streams, not the CPU).

``Work.wait()`` makes the caller's current stream wait for the end event and
returns at once; ``RINGCOMM_BLOCKING_WAIT=1`` (or ``wait(timeout)``) blocks the
CPU instead, as ``TORCH_NCCL_BLOCKING_WAIT`` does. A watchdog thread follows the
pending collectives: one that passes the group timeout, or an asynchronous NCCL
error, aborts the communicator. The error then reaches whoever waits on the
failed work, and every later call on that device fails at once.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from ringcomm import settings
from ringcomm.backoff import Backoff
from ringcomm.runtime.work import BaseWork, collective_error, keep_if_small

_work_init = dist.Work.__init__
_monotonic = time.monotonic
_INF = float("inf")

log = logging.getLogger("ringcomm")

#: how often the watchdog looks at pending collectives
WATCHDOG_INTERVAL_S = 0.05
#: how long closing a group waits, beyond its own wait, for a thread that is
#: enqueuing (on a GPU an enqueue takes microseconds unless it is stuck in NCCL)
CLOSE_GRACE_S = 2.0


class CudaStreams:
    """The stream, events and futures of one CUDA device."""

    def __init__(self, device: torch.device):
        self.device = device
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
        self.handle = self.stream.cuda_stream
        self._side: torch.cuda.Stream | None = None
        self.inline = False
        self._context = torch.cuda.StreamContext(self.stream)
        #: tensors must be marked as used on the internal stream
        self.keeps = True

    def device_context(self) -> Any:
        return torch.cuda.device(self.device)

    def bind_thread(self) -> None:
        """Make this device current on the calling (watchdog) thread, so it creates no
        context on another GPU."""
        torch.cuda.set_device(self.device)

    def wait_for_caller(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def on_stream(self) -> Any:
        # one context, made once: the engine enqueues one collective at a time
        return self._context

    def keep_alive(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            if t.device == self.device:
                t.record_stream(self.stream)

    def record(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def future_after(self, event: Any, value: Any) -> torch.futures.Future:
        """A CUDA-aware future holding ``value``, complete once ``event`` is: made when
        asked for, on a side stream that waits for the event, so it waits for nothing
        enqueued on the internal stream after the collective."""
        with torch.cuda.device(self.device):
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            self._side.wait_event(event)
            fut = torch.futures.Future(devices=[self.device])
            with torch.cuda.stream(self._side):
                fut.set_result(value)  # records its events on the side stream
        return fut

    def wait_on_current(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)


class _Done:
    """The end event of work that completed when it was enqueued."""

    @staticmethod
    def query() -> bool:
        return True


class HostStreams:
    """Streams for a transport whose work completes while it is enqueued (the
    NCCL stand-in in :mod:`ringcomm.testing` runs each group to the end): the
    same engine then runs on CPU tensors in CI."""

    handle = 0
    keeps = False
    #: the caller's work and the collective's run when issued: no stream to order
    inline = True

    def __init__(self, device: torch.device):
        self.device = device

    def device_context(self) -> Any:
        return contextlib.nullcontext()

    def bind_thread(self) -> None:
        pass

    def wait_for_caller(self) -> None:
        pass

    def on_stream(self) -> Any:
        return contextlib.nullcontext()

    def keep_alive(self, tensors: Iterable[torch.Tensor]) -> None:
        pass

    def record(self) -> Any:
        return _Done

    def future_after(self, event: Any, value: Any) -> torch.futures.Future:
        fut = torch.futures.Future()
        fut.set_result(value)
        return fut

    def wait_on_current(self, event: Any) -> None:
        pass


def streams_for(device: torch.device) -> CudaStreams | HostStreams:
    return CudaStreams(device) if device.type == "cuda" else HostStreams(device)


class StreamWork(BaseWork):
    """Handle of a collective enqueued on a stream (see the module docstring)."""

    __slots__ = ("_op", "_streams", "_end", "_fut", "_timeout_s", "_deadline", "_value",
                 "_blocking", "_exc", "_finished")

    def __init__(self, op: str, engine: "StreamEngine", done: Any, timeout_s: float,
                 deadline: float, value: Any, blocking: bool):
        _work_init(self)  # cheaper than super(): this is on every call
        self._op = op
        self._streams = engine.streams  # not the engine: a kept Work keeps no group alive
        self._end = done
        self._fut: torch.futures.Future | None = None
        self._timeout_s = timeout_s
        self._deadline = deadline
        self._value = value
        self._blocking = blocking
        self._exc: BaseException | None = None  # set by the watchdog
        self._finished = False
        keep_if_small(self, value)  # see ringcomm.runtime.work.RETAINED

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Order the caller's current stream after this collective (no CPU block); with
        ``timeout``, ``RINGCOMM_BLOCKING_WAIT=1`` or for a barrier, block the CPU
        until it completed.

        Raises:
            torch.distributed.DistBackendError: the collective failed (timed out and
                was aborted, or NCCL reported an error), or ``timeout`` passed first.
        """
        limit = timeout.total_seconds() if timeout else 0.0
        if self._exc is None and (limit > 0 or self._blocking):
            self._block(limit)
        if self._exc is not None:
            raise self._exc
        self._streams.wait_on_current(self._end)
        if self._exc is not None:  # failed while the wait blocked (a host-side stream)
            raise self._exc
        return True

    def _block(self, limit: float) -> None:
        deadline = time.monotonic() + limit if limit > 0 else float("inf")
        pace = Backoff()
        while not self.is_completed():
            if time.monotonic() > deadline:
                raise dist.DistBackendError(
                    f"ringcomm {self._op}: Work.wait timed out after {limit:.3f}s")
            pace.pause()

    def get_future(self) -> torch.futures.Future:
        """A CUDA-aware future holding the outputs: waiting on it, or a ``then``
        callback, is ordered after the collective on the stream. Made on first ask."""
        if self._fut is None:
            self._fut = self._streams.future_after(self._end, self._value)
        return self._fut

    def is_completed(self) -> bool:
        if not self._finished:
            self._finished = self._exc is not None or self._end.query()
        return self._finished

    def synchronize(self) -> None:
        """As torch's NCCL Work: make the caller's current stream wait for the
        collective (the CPU goes on); with ``RINGCOMM_BLOCKING_WAIT=1`` (or for a
        barrier) block the CPU until it completed.

        Raises:
            torch.distributed.DistBackendError: the collective failed.
        """
        if self._exc is None and self._blocking:
            self._block(0.0)
        if self._exc is not None:
            raise self._exc
        self._streams.wait_on_current(self._end)


class StreamEngine:
    """Enqueues the collectives of one group on one device, and watches them.

    Args:
        tp: the device's :class:`ringcomm.transport.nccl.NcclLink`.
        streams: its :class:`CudaStreams` (or :class:`HostStreams`).
        describe: a short description of the group, for messages.
    """

    def __init__(self, tp: Any, streams: CudaStreams | HostStreams, describe: Callable[[], str]):
        self.tp = tp
        self.streams = streams
        self._describe = describe
        self._lock = threading.Lock()  # one enqueue at a time: NCCL's order is issue order
        # pending, error, watchdog; the enqueue takes the Condition's lock itself (a
        # Condition's own enter and exit are Python calls, on every collective)
        self._state_lock = threading.Lock()
        self._state = threading.Condition(self._state_lock)
        self._pending: collections.deque[StreamWork] = collections.deque()
        self._enqueuing: tuple[str, float, float] | None = None
        self._error: BaseException | None = None
        self._stopped = False
        self._watchdog: threading.Thread | None = None
        self._blocking_wait = settings.get("RINGCOMM_BLOCKING_WAIT")
        #: called with the error when a collective fails here (see ``Lanes``)
        self.on_failure: Callable[[BaseException], None] | None = None

    def fence(self) -> Callable[[], None]:
        """A function that makes the current stream (another channel's, while it
        enqueues) wait for everything enqueued here so far."""
        s = self.streams
        with self._lock:
            event = s.record()
        return lambda: s.wait_on_current(event)

    def submit_sync(self, call: Any, args: Sequence, timeout_s: float) -> StreamWork:
        """A synchronous call, as the short paths hand it to every lane's engine
        (:meth:`ringcomm.runtime.engine.Engine.submit_sync`): on a stream it is
        enqueued as any other, and the caller's wait is the stream's."""
        return self.submit(call, args, False, timeout_s)

    def submit(self, call: Any, args: Sequence, async_op: bool = True,
               timeout_s: float = 0.0) -> StreamWork:
        """Enqueue ``call.execute(*args)`` (it issues the whole collective) and return
        its Work: the same interface as :meth:`ringcomm.runtime.engine.Engine.submit`.

        Args:
            call: a prepared call: ``name``, ``execute``, ``touched(args)`` (the tensors
                it reads or writes, kept alive until it finished) and ``blocking``
                (``wait()`` blocks the CPU, as for a barrier).
            args: what ``execute`` takes for this call.
            async_op: unused: every collective is asynchronous on the stream.
            timeout_s: the watchdog aborts the communicator this long after enqueueing
                if the collective has not completed.
        Raises:
            torch.distributed.DistBackendError: the group is unusable after an earlier
                failure, or enqueueing failed (the communicator is aborted then).
        """
        s, op = self.streams, call.name
        with self._lock:
            if self._error is not None or self._stopped:
                self._raise_if_broken(op)
            deadline = _monotonic() + timeout_s if timeout_s > 0 else _INF
            self._enqueuing = (op, deadline, timeout_s)
            try:
                if s.inline:
                    value = call.execute(*args)
                else:
                    s.wait_for_caller()
                    with s.on_stream():
                        value = call.execute(*args)
                        if s.keeps:
                            s.keep_alive(call.touched(args))
                done = s.record()
            except BaseException as e:  # noqa: BLE001 - the group cannot go on after this
                raise self._fail(op, e, timeout_s) from e
            finally:
                self._enqueuing = None
            work = StreamWork(op, self, done, timeout_s, deadline, value,
                              call.blocking or self._blocking_wait)
            with self._state_lock:
                self._pending.append(work)
                if self._watchdog is None:
                    self._watchdog = threading.Thread(
                        target=self._watch, name=f"ringcomm-watchdog-{self._describe()}",
                        daemon=True)
                    self._watchdog.start()
        return work

    @property
    def error(self) -> BaseException | None:
        """The failure that made this lane refuse collectives, if any."""
        return self._error

    def mark_broken(self, err: BaseException) -> None:
        """Refuse every later collective with ``err`` (a failure outside enqueueing,
        e.g. a user's algorithm that raised while being built)."""
        with self._state:
            if self._error is None:
                self._error = err

    def fail_from_elsewhere(self, err: BaseException) -> None:
        """Another rank's collective failed (its report was read): calls still in
        flight here wait for messages that will never come, so, if there are any,
        abort the communicator and fail them (the watchdog would stop watching a
        broken lane); either way refuse later calls with ``err``."""
        with self._state:
            busy = bool(self._pending) or self._enqueuing is not None
        if busy:
            self._abort_between_enqueues("collective", err, 0.0)
        self.mark_broken(err)

    def _raise_if_broken(self, op: str) -> None:
        if self._error is not None:
            raise dist.DistBackendError(f"ringcomm {op}: {self._describe()} on {self.tp.device} "
                                        f"is unusable after an earlier failure: {self._error}")
        if self._stopped:
            raise dist.DistBackendError(f"ringcomm {op}: {self._describe()} has been shut down")

    def _fail(self, op: str, cause: BaseException, timeout_s: float) -> BaseException:
        """Mark the group failed (once), abort the communicator, fail pending works."""
        with self._state:
            if self._error is None:
                where = (f"{self._describe()}, rank {self.tp.rank} of {self.tp.size}, "
                         f"{self.tp.device}")
                explain = getattr(self.tp, "explain", None)
                err = collective_error(op, where, cause, timeout_s,
                                       isinstance(cause, TimeoutError),
                                       "; the NCCL communicator was aborted",
                                       explain(cause) if explain is not None else "")
                self._error = err
                for w in self._pending:
                    if not w.is_completed():
                        w._exc = err
                self._pending.clear()
                log.error("%s", err)
                self._state.notify_all()
            err = self._error
        try:
            self.tp.abort()
        except Exception as e:  # noqa: BLE001 - already failing; keep the first error
            log.warning("ringcomm: aborting the NCCL communicator failed: %s", e)
        if self.on_failure is not None:
            self.on_failure(err)
        return err

    def _watch(self) -> None:
        try:
            self.streams.bind_thread()
            while self._watch_once():
                pass
        except Exception as e:  # noqa: BLE001 - a watchdog that died silently would end timeouts
            self._abort_between_enqueues("collective", e, 0.0)

    def _watch_once(self) -> bool:
        """One look at the pending collectives; False once the group stopped or failed."""
        with self._state:
            self._state.wait(WATCHDOG_INTERVAL_S)
            if self._stopped or self._error is not None:
                return False
            while self._pending and self._pending[0].is_completed():
                self._pending.popleft()
            head = self._pending[0] if self._pending else None
        now = time.monotonic()
        enqueuing = self._enqueuing
        try:
            self.tp.check_async_error()
        except Exception as e:  # noqa: BLE001
            op = head._op if head is not None else enqueuing[0] if enqueuing else "collective"
            self._abort_between_enqueues(op, e, 0.0)
            return False
        if enqueuing is not None and now > enqueuing[1]:
            # stuck inside NCCL (e.g. waiting for a peer to connect)
            self._abort_between_enqueues(enqueuing[0], TimeoutError("enqueueing did not finish"),
                                         enqueuing[2])
            return False
        if head is not None and now > head._deadline:
            self._abort_between_enqueues(head._op, TimeoutError("it did not complete"),
                                         head._timeout_s)
            return False
        return True

    def _abort_between_enqueues(self, op: str, cause: BaseException, timeout_s: float,
                                give_up_s: float = _INF) -> None:
        """:meth:`_fail` from any thread but the enqueuing one (the watchdog, or
        :meth:`close`). NCCL forbids using a communicator from two threads at once,
        and CuPy's ``abort()`` frees it under a thread still inside NCCL on it, so
        the abort waits until no enqueue is running. Only an enqueue stuck inside
        NCCL past its deadline (or, for :meth:`close`, past ``give_up_s``) is
        aborted under it: a call blocked in NCCL has no other way out."""
        give_up = time.monotonic() + give_up_s
        while True:
            if self._lock.acquire(timeout=WATCHDOG_INTERVAL_S):
                try:
                    self._fail(op, cause, timeout_s)
                finally:
                    self._lock.release()
                return
            enqueuing = self._enqueuing
            now = time.monotonic()
            if enqueuing is not None and (now > enqueuing[1] or now > give_up):
                log.warning("ringcomm %s: %s is stuck inside NCCL; aborting its "
                            "communicator under it", enqueuing[0], self._describe())
                self._fail(op, cause, timeout_s)
                return

    def shutdown(self, wait_s: float = 5.0) -> None:
        """Stop the watchdog; later calls fail. Idempotent."""
        with self._state:
            self._stopped = True
            self._state.notify_all()
            thread = self._watchdog
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait_s)

    def close(self, wait_s: float = 10.0) -> None:
        """Shut down and release the communicator: destroyed once its work finished;
        aborted, failing the pending Works, if that takes longer than ``wait_s`` (0:
        abort at once) or the group had failed. Neither runs while another thread
        is enqueuing on it (that enqueue finishes first, unless it is stuck inside
        NCCL for ``wait_s`` plus :data:`CLOSE_GRACE_S`)."""
        self.shutdown()
        deadline = time.monotonic() + wait_s
        gone = RuntimeError("the process group was shut down or aborted before it completed")
        if not self._lock.acquire(timeout=wait_s + CLOSE_GRACE_S):
            self._abort_between_enqueues("collective", gone, 0.0, give_up_s=0.0)
            return
        try:  # no enqueue can start now: the pending list is complete
            with self._state:
                pending = list(self._pending)
            while self._error is None and not all(w.is_completed() for w in pending):
                if time.monotonic() >= deadline:
                    self._fail("collective", gone, 0.0)
                    return
                time.sleep(0.01)
            if self._error is None:
                self.tp.close()
            else:
                self.tp.abort()
        finally:
            self._lock.release()

