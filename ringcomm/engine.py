"""Per-group execution: one collective at a time, in issue order, each with a deadline.

Every rank issues collectives in the same order, so executing them in issue
order on one thread keeps the ranks matched. A synchronous call that finds
nothing queued or running runs inline on the caller's thread (no thread
hand-off, lower latency) — still one at a time and still in order.

A collective that fails (timeout, transport error) leaves its peers in an
unknown state, so the group is marked broken: queued and later collectives
fail at once with the original error instead of mismatching or hanging.
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable

import torch.distributed as dist

from .transport import Transport, TransportAborted, TransportTimeout
from .work import Work

log = logging.getLogger("ringcomm")


class Engine:
    """Runs the collectives of one group on its transport.

    Args:
        tp: the group's collective transport.
        describe: returns a short description of the group for error messages.
    """

    def __init__(self, tp: Transport, describe: Callable[[], str]):
        self.tp = tp
        self._describe = describe
        self._cv = threading.Condition(threading.Lock())  # the default RLock is slower
        self._queue: collections.deque = collections.deque()
        self._busy = False
        self._stopped = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._last: Work | None = None
        #: called with the error when a collective fails here (the group's other
        #: channels are then broken too, see ``Lanes``)
        self.on_failure: Callable[[BaseException], None] | None = None

    def fence(self) -> Callable[[], None]:
        """A function that waits (raising its error) until every collective submitted
        here so far has finished; another channel's barrier calls it."""
        last = self._last
        return (lambda: None) if last is None else (lambda: last.wait() and None)

    def mark_broken(self, err: BaseException) -> None:
        """Fail every later collective with ``err`` (a failure outside a running
        collective, e.g. a user's algorithm that raised while being built)."""
        if self._error is None:
            self._error = err

    def on_progress_thread(self) -> bool:
        """True when called from this group's progress thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def alive(self) -> bool:
        """False once shut down with work left undone."""
        return not self._stopped or (self._thread is not None and self._thread.is_alive())

    def submit(self, op: str, fn: Callable[[], Any], *, async_op: bool, timeout_s: float,
               tag: int = 0) -> Work:
        """Queue ``fn`` (the whole collective) and return its Work.

        Args:
            op: collective name for messages.
            fn: runs the collective on ``self.tp`` and returns the Work's value.
            async_op: False lets the call run inline when the group is idle.
            timeout_s: deadline for the collective, counted from when it starts.
            tag: message tag of the collective (the same on every rank).
        """
        if not async_op and self.on_progress_thread():
            # A future callback runs on this thread: a synchronous collective queued
            # here would wait for the thread that is waiting for it.
            raise dist.DistBackendError(
                f"ringcomm {op}: a synchronous collective inside a future callback (on the "
                "group's progress thread) would deadlock; use async_op=True and chain with "
                "Future.then")
        work = self._last = Work(op, self)
        with self._cv:
            if self._stopped:
                work._finish(exc=dist.DistBackendError(
                    f"ringcomm {op}: {self._describe()} has been shut down"))
                return work
            inline = not async_op and not self._busy and not self._queue
            if inline:
                self._busy = True
            else:
                self._queue.append((work, op, fn, timeout_s, tag))
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._loop, name=f"ringcomm-{self._describe()}", daemon=True)
                    self._thread.start()
                self._cv.notify_all()
        if inline:
            try:
                self._run(work, op, fn, timeout_s, tag)
            finally:
                with self._cv:
                    self._busy = False
                    if self._queue:  # another thread queued work meanwhile
                        self._cv.notify_all()
        return work

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (self._busy or not self._queue):
                    self._cv.wait()
                if self._stopped:
                    pending, self._queue = list(self._queue), collections.deque()
                    break
                work, op, fn, timeout_s, tag = self._queue.popleft()
                self._busy = True
            try:
                self._run(work, op, fn, timeout_s, tag)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
        for work, op, *_ in pending:
            work._finish(exc=dist.DistBackendError(
                f"ringcomm {op}: {self._describe()} was shut down before this collective ran"))

    def _run(self, work: Work, op: str, fn: Callable[[], Any], timeout_s: float,
             tag: int) -> None:
        if self._error is not None:
            work._finish(exc=dist.DistBackendError(
                f"ringcomm {op}: {self._describe()} is unusable after an earlier failure: "
                f"{self._error}"))
            return
        tp = self.tp
        tp.begin(op, timeout_s, tag)
        try:
            value = fn()
        except BaseException as e:  # noqa: BLE001 - every failure must reach the Work
            tp.abandon()
            err = self._wrap(op, e, timeout_s)
            self._error = err
            log.error("%s", err)
            if self.on_failure is not None:
                self.on_failure(err)
            work._finish(exc=err)
        else:
            tp.end()
            work._finish(value)

    def _wrap(self, op: str, e: BaseException, timeout_s: float) -> BaseException:
        where = f"{self._describe()}, rank {self.tp.rank} of {self.tp.size}"
        if isinstance(e, TransportTimeout):
            # "timed out ... timeout" : the words torch's own tests look for (gloo's too)
            msg = (f"ringcomm {op} timed out after {timeout_s:g}s, the timeout of this "
                   f"collective ({where}) {e}. Every rank "
                   "must call the same collectives in the same order with matching sizes; "
                   "the group is unusable now.")
        elif isinstance(e, TransportAborted):
            msg = f"ringcomm {op} was interrupted ({where}): {e}"
        else:
            msg = f"ringcomm {op} failed ({where}): {type(e).__name__}: {e}"
        err = dist.DistBackendError(msg)
        err.__cause__ = e
        return err

    def shutdown(self, wait_s: float = 5.0, interrupt: str | None = None) -> None:
        """Stop the progress thread; queued collectives fail. With ``interrupt``, the
        running collective's waits end at once with that reason. Idempotent."""
        if interrupt is not None:
            self.tp.interrupt(interrupt)
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait_s)
