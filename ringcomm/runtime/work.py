"""Work handles returned by every ringcomm collective."""
from __future__ import annotations

import collections
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def collective_error(op: str, where: str, cause: BaseException, timeout_s: float,
                     timed_out: bool, detail: str = "",
                     cause_text: str = "") -> dist.DistBackendError:
    """The error a collective fails with, for both engines: past its deadline (the
    words "timed out ... timeout" are those torch's own tests, and gloo's, look for;
    ``detail`` says what was pending or what was done about it), or failed
    (``cause_text``: the cause as the transport explains it)."""
    if timed_out:
        msg = (f"ringcomm {op} timed out after {timeout_s:g}s, the timeout of this "
               f"collective ({where}){detail}. Every rank must call the same collectives "
               "in the same order with matching sizes; the group is unusable now.")
    else:
        msg = (f"ringcomm {op} failed ({where}): "
               f"{cause_text or f'{type(cause).__name__}: {cause}'}")
    err = dist.DistBackendError(msg)
    err.__cause__ = cause
    err.timed_out = timed_out  # for the group's get_error()
    return err


#: Finished asynchronous Works with small results, kept alive a while. torch's C++
#: side may hold a Work after Python dropped it (torch's DDP keeps join()'s
#: forward allreduce to read the number of training ranks in backward); once the
#: Python object is gone, its wait() falls back to c10d's base Work::wait, which
#: never returns for a Work made in Python. Small results are what such holders
#: read (counts, flags, ranks); large ones are not kept, so no tensor outlives its
#: use by much.
RETAINED = 32
RETAIN_BYTES = 1 << 12
_retained: collections.deque = collections.deque(maxlen=RETAINED)


def keep_if_small(work: "BaseWork", value: Any) -> None:
    """Keep ``work`` among the :data:`RETAINED` last ones if its result ``value`` (tensors,
    or a list of them) fits in :data:`RETAIN_BYTES` of storage (a view keeps all of
    its storage alive). The caller has dropped what would keep its group alive."""
    if type(value) is list and len(value) == 1 and type(value[0]) is torch.Tensor:
        t = value[0]  # the common case (one tensor, as allreduce returns it), in short
        if t.nbytes <= RETAIN_BYTES and t.untyped_storage().nbytes() <= RETAIN_BYTES:
            _retained.append(work)
        return
    ts = value if isinstance(value, (list, tuple)) else [value]
    total = 0
    for t in ts:
        if isinstance(t, torch.Tensor):
            total += t.untyped_storage().nbytes()
        elif t is not None:
            return
    if total <= RETAIN_BYTES:
        _retained.append(work)


def _unwrap(fut: torch.futures.Future) -> Any:
    value = fut.value()
    if isinstance(value, BaseException):
        raise value
    return value


class BaseWork(dist.Work):
    """What every ringcomm Work answers from its state (``_op``, ``_exc``, ``_value``)
    and its :meth:`is_completed`."""

    __slots__ = ()

    _op: str
    _exc: BaseException | None
    _value: Any

    def is_success(self) -> bool:
        return self.is_completed() and self._exc is None

    def exception(self) -> BaseException | None:
        return self._exc

    def result(self) -> Any:
        self.wait()
        return self._value

    def __repr__(self) -> str:
        state = "failed" if self._exc else "done" if self.is_completed() else "pending"
        return f"<ringcomm.{type(self).__name__} {self._op} {state}>"


class Work(BaseWork):
    """Completion handle of one collective.

    torch's C++ side forwards only :meth:`wait` and :meth:`get_future` to Python
    subclasses; the other methods serve Python callers.

    The internal future is completed with the result *or the exception object*;
    :meth:`get_future` returns a ``then``-chained future that raises it, because an
    exception set with ``Future.set_exception`` does not survive the trip through C++.
    Events and futures are made only when someone waits or asks for a future: a
    synchronous call that ran on the caller's thread returns a Work made complete
    (:class:`Done`, :meth:`failed`).
    """

    def __init__(self, op: str, engine: "Any"):
        super().__init__()
        self._op = op
        self._engine = engine
        self._lock = threading.Lock()
        self._done = False
        self._event: threading.Event | None = None
        self._fut: torch.futures.Future | None = None
        self._public: torch.futures.Future | None = None
        self._value: Any = None
        self._exc: BaseException | None = None

    @staticmethod
    def failed(op: str, exc: BaseException) -> "Done":
        """A Work that failed with ``exc``."""
        return Done(op, None, exc)

    # -- completion (engine side) ---------------------------------------------
    def _finish(self, value: Any = None, exc: BaseException | None = None) -> None:
        with self._lock:
            self._value, self._exc = value, exc
            self._done = True
            event, fut = self._event, self._fut
        if exc is None:  # (an error's traceback holds the group's frames)
            self._engine = None  # finished: a kept Work keeps no group alive
            keep_if_small(self, value)
        if event is not None:
            event.set()
        if fut is not None:
            fut.set_result(exc if exc is not None else value)

    # -- torch API ------------------------------------------------------------
    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until the collective finished; re-raise its error if it failed.

        Args:
            timeout: give up after this long (0: no limit beyond the group's own
                timeout, which every running collective honours).
        Raises:
            torch.distributed.DistBackendError: the collective failed or timed out, or
                ``timeout`` passed first.
        """
        if not self._done:
            with self._lock:
                if not self._done and self._event is None:
                    self._event = threading.Event()
                event = None if self._done else self._event
            if event is not None:
                self._block(event, timeout.total_seconds() if timeout else 0.0)
        if self._exc is not None:
            raise self._exc
        return True

    def _block(self, event: threading.Event, limit: float) -> None:
        engine = self._engine
        if engine is None:  # finished meanwhile (see _finish)
            return
        if engine.on_progress_thread():
            # a future callback waits for a collective queued behind it on its own
            # lane: a new thread takes the lane, this one waits as a plain thread
            engine.hand_off()
        start = time.monotonic()
        while not event.wait(1.0 if limit <= 0 else min(1.0, limit)):
            if not engine.alive():
                raise dist.DistBackendError(
                    f"ringcomm {self._op}: the group's progress thread stopped before the "
                    "collective completed (was the process group shut down?)")
            if 0 < limit <= time.monotonic() - start:
                raise dist.DistBackendError(
                    f"ringcomm {self._op}: Work.wait timed out after {limit:.3f}s")

    def get_future(self) -> torch.futures.Future:
        """A future holding the output tensors; it raises if the collective failed."""
        with self._lock:
            if self._public is None:
                self._fut = torch.futures.Future()
                if self._done:
                    self._fut.set_result(self._exc if self._exc is not None else self._value)
                elif self._engine is not None and hasattr(self._engine, "watch_callbacks"):
                    self._engine.watch_callbacks()
                self._public = self._fut.then(_unwrap)
            return self._public

    def is_completed(self) -> bool:
        return self._done

    def synchronize(self) -> None:
        self.wait()


_work_init = dist.Work.__init__


class Done(BaseWork):
    """A Work complete when made: a synchronous call that ran on the caller's thread.
    Its future is made only if asked for. The lane hands one out again for a later
    call once its caller let it go (``Engine.submit_sync``)."""

    __slots__ = ("_op", "_value", "_exc", "_public")

    def __init__(self, op: str, value: Any, exc: BaseException | None):
        _work_init(self)  # cheaper than super(): this is on every synchronous call
        self._op, self._value, self._exc = op, value, exc
        self._public: torch.futures.Future | None = None

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._exc is not None:
            raise self._exc
        return True

    def get_future(self) -> torch.futures.Future:
        if self._public is None:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(self._exc if self._exc is not None else self._value)
            self._public = fut.then(_unwrap)
        return self._public

    def is_completed(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.wait()


class Batch(BaseWork):
    """The Works of a batch of calls as one (torch's ``_coalescing_manager`` with a
    device: ``_end_coalescing``'s Work): waiting waits for every one, in order, and
    raises the first failure."""

    __slots__ = ("_op", "_works", "_value", "_exc")

    def __init__(self, op: str, works: list):
        _work_init(self)
        self._op, self._works, self._exc = op, works, None
        self._value = None

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        for w in self._works:
            try:
                w.wait(timeout) if timeout else w.wait()
            except BaseException as e:
                self._exc = e
                raise
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def get_future(self) -> torch.futures.Future:
        futs = [w.get_future() for w in self._works]
        return torch.futures.collect_all(futs).then(
            lambda f: [t for x in f.value() for t in (x.value() or [])])

    def synchronize(self) -> None:
        for w in self._works:
            w.synchronize()


class P2PWork(Work):
    """Handle of a user send/receive (``dist.isend`` / ``dist.irecv``).

    The message is already posted to the transport; it is driven to completion by
    whoever waits for it, with a deadline counted from when it was posted. MPI
    forbids two threads testing one request at once, so one thread at a time
    drives it (``_drive_lock``); others wait for the outcome.
    """

    def __init__(self, op: str, engine: Any, tp: Any, handle: Any, timeout_s: float,
                 on_done: Any = None):
        super().__init__(op, engine)
        self._tp = tp
        self._handle = handle
        self._deadline = time.monotonic() + timeout_s if timeout_s > 0 else float("inf")
        self._timeout_s = timeout_s
        self._on_done = on_done
        self._waiter: threading.Thread | None = None
        self._drive_lock = threading.Lock()

    def _complete(self) -> None:
        if self._on_done is not None:
            self._on_done()
        self._finish([self._handle.buf])

    def _drive(self, deadline: float) -> bool:
        """Poll the message until done or ``deadline``; False if the caller's own
        deadline passed first (the message stays posted). Holds ``_drive_lock``."""
        h = self._handle
        if self._done:
            return True
        try:
            finished = self._tp.p2p_wait(h, deadline)
        except Exception as e:  # noqa: BLE001 - an MPI error ends the message
            err = dist.DistBackendError(f"ringcomm {self._op} failed on rank {self._tp.rank}: "
                                        f"{type(e).__name__}: {e}")
            err.__cause__ = e
            self._finish(exc=err)
            return True
        if finished:
            self._complete()
            return True
        if deadline < self._deadline:
            return False
        self._tp.p2p_cancel(h)
        peer = "any rank" if h.peer < 0 else f"rank {h.peer}"
        self._finish(exc=dist.DistBackendError(
            f"ringcomm {self._op} {'to' if h.kind == 'send' else 'from'} {peer} timed out "
            f"after {self._timeout_s:g}s on rank {self._tp.rank}"))
        return True

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until the message completed.

        Raises:
            torch.distributed.DistBackendError: the group timeout (counted from when the
                message was posted) or ``timeout`` passed first, or MPI failed.
        """
        limit = timeout.total_seconds() if timeout else 0.0
        deadline = min(self._deadline, time.monotonic() + limit) if limit > 0 else self._deadline
        if not self._done:
            if self._waiter is not None:  # the helper thread drives it: wait for the outcome
                return super().wait(timeout)
            with self._drive_lock:
                if not self._drive(deadline):
                    raise dist.DistBackendError(
                        f"ringcomm {self._op}: Work.wait timed out after {limit:.3f}s")
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        if not self._done and self._drive_lock.acquire(blocking=False):
            try:  # one non-blocking look, unless another thread is driving it
                if not self._done and self._tp.p2p_done(self._handle):
                    self._complete()
            finally:
                self._drive_lock.release()
        return self._done

    def _source_rank(self) -> int:
        self.wait()
        return self._tp.p2p_source(self._handle)

    source_rank = _source_rank

    def get_future(self) -> torch.futures.Future:
        with self._drive_lock:
            if self._waiter is None and not self._done:
                # Nothing else drives a posted message: a helper thread does.
                self._waiter = threading.Thread(target=self._drive_in_background, daemon=True,
                                                name=f"ringcomm-{self._op}")
                self._waiter.start()
        return super().get_future()

    def _drive_in_background(self) -> None:
        with self._drive_lock:
            self._drive(self._deadline)
