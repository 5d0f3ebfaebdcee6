"""Per-lane execution on the CPU: one collective at a time, in issue order, each
with a deadline.

Every rank issues collectives in the same order, so executing them in issue
order on one thread keeps the ranks matched. A synchronous call that finds
nothing queued or running runs on the caller's thread (no hand-off, no future)
and returns a completed Work; asynchronous calls queue for the lane's progress
thread.

Future callbacks. The progress thread completes a Work's future, so torch runs
its ``then`` callbacks there, while the thread still owns the lane. A
collective issued from such a callback runs at once, inline, on that thread:
at the same point of every rank's sequence, so ranks stay matched (torch's
PowerSGD hook issues an allreduce in a callback and waits for it). A callback
that blocks otherwise, on a Work of this lane (detected) or for longer than
:data:`HANDOFF_S` while collectives queue behind it (a watcher notices), hands
the lane to a new progress thread and goes on as a plain thread: a wait inside
a callback never deadlocks the lane.

A collective that fails (timeout, transport error) leaves its peers in an
unknown state, so the group is marked broken: queued and later collectives
fail at once with the original error instead of mismatching or hanging.
"""
from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from typing import Any, Callable, Sequence

import torch.distributed as dist

from ringcomm.runtime.work import Done, Work, collective_error
from ringcomm.transport import Transport, TransportAborted, TransportTimeout

log = logging.getLogger("ringcomm")

#: a future callback that runs this long while collectives wait behind it loses the lane
HANDOFF_S = 0.05
_current = threading.current_thread
_refcount = sys.getrefcount


class Engine:
    """Runs the collectives of one lane on its transport.

    Args:
        tp: the lane's transport.
        describe: returns a short description of the group for error messages.
    """

    def __init__(self, tp: Transport, describe: Callable[[], str]):
        self.tp = tp
        self._describe = describe
        self._cv = threading.Condition(threading.Lock())  # the default RLock is slower
        self._queue: collections.deque = collections.deque()
        #: held by whoever runs a collective on the lane (and its future callbacks)
        self._own = threading.Lock()
        self._owner: threading.Thread | None = None
        self._stopped = False
        self._error: BaseException | None = None
        #: the thread that progresses the lane now (a callback that blocks hands it on)
        self._thread: threading.Thread | None = None
        self._threads = 0
        self._last: Work | None = None
        #: the completed Work submit_sync hands out again once its caller dropped it,
        #: and its reference count when nothing but the engine held it
        self._spare: Done | None = None
        self._spare_refs = 0
        #: when the progress thread entered the callbacks of a finished collective
        self._callbacks_since: float | None = None
        #: collectives running inline inside those callbacks (the lane is busy, not stuck)
        self._nested = 0
        self._watcher: threading.Thread | None = None
        #: called with the error when a collective fails here (the group's other
        #: channels are then broken too, see ``Lanes``)
        self.on_failure: Callable[[BaseException], None] | None = None

    def fence(self) -> Callable[[], None]:
        """A function that waits (raising its error) until every collective submitted
        here so far has finished; another channel's barrier calls it."""
        last = self._last
        return (lambda: None) if last is None else (lambda: last.wait() and None)

    @property
    def error(self) -> BaseException | None:
        """The failure that made this lane refuse collectives, if any."""
        return self._error

    def mark_broken(self, err: BaseException) -> None:
        """Fail every later collective with ``err`` (a failure outside a running
        collective, e.g. a user's algorithm that raised while being built)."""
        if self._error is None:
            self._error = err

    def on_progress_thread(self) -> bool:
        """True when called from the thread that progresses this lane now."""
        return _current() is self._thread

    def alive(self) -> bool:
        """False once shut down with work left undone."""
        return not self._stopped or (self._thread is not None and self._thread.is_alive())

    def submit(self, call: Any, args: Sequence, async_op: bool, timeout_s: float) -> Work:
        """Run or queue ``call.execute(*args)`` (the whole collective) and return its Work.

        Args:
            call: a prepared call: ``name`` and ``execute``.
            args: what ``execute`` takes for this call.
            async_op: False lets the call run on the caller's thread when the lane is idle.
            timeout_s: deadline for the collective, counted from when it starts.
        """
        thread = self._thread  # None until the first asynchronous call
        if thread is not None and _current() is thread:
            # a future callback of this lane issues a collective: it runs now (see the
            # module docstring), so a wait for it inside the callback returns
            with self._cv:  # the watcher must not hand the lane on meanwhile
                nested = _current() is self._thread
                if nested:
                    self._nested += 1
            if nested:
                try:
                    return self._run_inline(call, args, timeout_s)
                finally:
                    with self._cv:
                        self._nested -= 1
                        if self._callbacks_since is not None:
                            self._callbacks_since = time.monotonic()
        if not async_op and not self._queue and self._own.acquire(False):
            # idle: run here, on the caller's thread (the short path). _run_inline's
            # body written out here saved 0.01-0.07 us of dist.all_reduce's 10.7, less
            # than the layer table's spread between runs (scripts/bench_copies.py,
            # docs/data/hot_path_copies.json)
            try:
                return self._run_inline(call, args, timeout_s)
            finally:
                self._own.release()
                if self._queue:  # another thread queued work meanwhile
                    with self._cv:
                        self._cv.notify_all()
        with self._cv:
            if self._stopped:
                return Work.failed(call.name, dist.DistBackendError(
                    f"ringcomm {call.name}: {self._describe()} has been shut down"))
            work = self._last = Work(call.name, self)
            self._queue.append((work, call, args, timeout_s))
            if self._thread is None:
                self._spawn()
            self._cv.notify_all()
            return work

    def submit_sync(self, call: Any, args: Sequence, timeout_s: float) -> Work:
        """``submit`` of a synchronous call (the short paths' form): run on the
        caller's thread when the lane is idle, else as ``submit`` does.

        A training loop's synchronous calls each make a Work that ``dist.all_reduce``
        waits on and drops; here a call that succeeds returns the lane's spare Work
        instead, made complete again, once nothing outside the lane still holds it
        (its reference count says so): no Work is made per call. After a pause
        every step of a call costs several times its back-to-back time, so each
        step saved counts (docs/benchmarks.md, "After a pause")."""
        thread = self._thread
        if ((thread is not None and _current() is thread) or self._queue
                or self._stopped or self._error is not None or not self._own.acquire(False)):
            return self.submit(call, args, False, timeout_s)
        try:
            tp = self.tp
            tp.begin(timeout_s)
            try:
                value = call.execute(*args)
            except BaseException as e:  # noqa: BLE001 - the error is the Work's
                tp.end()
                work = self._last = Done(call.name, None, self._failed(call, e, timeout_s))
                return work
            tp.end()
            work = self._spare
            # counted as when it was made (this frame, _spare), plus _last: nothing
            # else holds it, so its last caller let it go. The count is measured, not
            # assumed: interpreters differ in the references a call's argument takes
            if work is not None and _refcount(work) == self._spare_refs + (self._last is work):
                work._op, work._value, work._public = call.name, value, None
            else:
                work = self._spare = Done(call.name, value, None)
                self._spare_refs = _refcount(work)
            self._last = work
            return work
        finally:
            self._own.release()
            if self._queue:  # another thread queued work meanwhile
                with self._cv:
                    self._cv.notify_all()

    def _run_inline(self, call: Any, args: Sequence, timeout_s: float) -> Any:
        """Run one collective on this thread; a Work made complete."""
        if self._stopped:
            return Work.failed(call.name, dist.DistBackendError(
                f"ringcomm {call.name}: {self._describe()} has been shut down"))
        try:
            work = Done(call.name, self._execute(call, args, timeout_s), None)
        except BaseException as e:  # noqa: BLE001 - the error is the Work's
            work = Done(call.name, None, e)
        self._last = work
        return work

    def _execute(self, call: Any, args: Sequence, timeout_s: float) -> Any:
        """Run one collective; raise its error, wrapped, after breaking the group."""
        if self._error is not None:
            raise dist.DistBackendError(
                f"ringcomm {call.name}: {self._describe()} is unusable after an earlier "
                f"failure: {self._error}")
        tp = self.tp
        tp.begin(timeout_s)
        try:
            value = call.execute(*args)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the Work
            tp.end()
            raise self._failed(call, e, timeout_s)
        tp.end()
        return value

    def _failed(self, call: Any, e: BaseException, timeout_s: float) -> BaseException:
        """A collective failed with ``e``: break the lane (and the group, through
        ``on_failure``) and return the error its Work raises."""
        err = self._wrap(call.name, e, timeout_s)
        if err is not e:
            err.__cause__ = e
        self._error = err
        # the Work raises it where the caller waits: printed once, by the caller's
        # traceback (here only in RINGCOMM_DEBUG's log)
        log.info("%s", err)
        if self.on_failure is not None:
            self.on_failure(err)
        return err

    # -- the progress thread ---------------------------------------------------------
    def _spawn(self) -> None:
        """Start a progress thread and make it the lane's (called holding ``_cv``)."""
        self._threads += 1
        t = threading.Thread(target=self._loop, daemon=True,
                             name=f"ringcomm-{self._describe()}-{self._threads}")
        self._thread = t
        t.start()

    def _loop(self) -> None:
        me = _current()
        while True:
            with self._cv:
                while not self._stopped and self._thread is me and not self._queue:
                    self._cv.wait()
                if self._thread is not me:
                    return  # a blocked callback handed the lane on
                if self._stopped:
                    pending, self._queue = list(self._queue), collections.deque()
                    break
            # own the lane before taking the head of the queue: a synchronous call on
            # another thread runs inline only when it owns the lane and nothing is queued
            self._own.acquire()
            with self._cv:
                if not self._queue or self._thread is not me:
                    self._own.release()
                    continue
                work, call, args, timeout_s = self._queue.popleft()
            self._owner = me
            try:
                value = self._execute(call, args, timeout_s)
            except BaseException as e:  # noqa: BLE001
                value, exc = None, e
            else:
                exc = None
            # callbacks run here, while this thread owns the lane (module docstring)
            self._callbacks_since = time.monotonic()
            try:
                work._finish(value, exc)
            finally:
                self._callbacks_since = None
                with self._cv:
                    if self._owner is me:  # not handed on meanwhile
                        self._owner = None
                        self._own.release()
        for work, call, *_ in pending:
            work._finish(exc=dist.DistBackendError(
                f"ringcomm {call.name}: {self._describe()} was shut down before this collective "
                "ran"))

    def hand_off(self) -> None:
        """Called on the progress thread by a callback about to block: a new progress
        thread takes the lane, and this one finishes its callback as a plain thread."""
        with self._cv:
            if _current() is not self._thread:
                return
            self._release_owner()
            if self._stopped:
                self._thread = None
                return
            self._spawn()
            self._cv.notify_all()

    def _release_owner(self) -> None:
        """The blocked callback's thread gives up the lane (called holding ``_cv``)."""
        if self._owner is not None:
            self._owner = None
            self._own.release()

    def watch_callbacks(self) -> None:
        """Start (once) the watcher that hands the lane on when a future callback blocks
        in a way the engine cannot see (a ``torch.futures.Future.wait`` on a collective
        still queued behind it)."""
        if self._watcher is not None:
            return
        with self._cv:
            if self._watcher is not None:
                return
            self._watcher = threading.Thread(target=self._watch, daemon=True,
                                             name=f"ringcomm-watcher-{self._describe()}")
            self._watcher.start()

    def _watch(self) -> None:
        while not self._stopped:
            time.sleep(HANDOFF_S / 2)
            since, thread = self._callbacks_since, self._thread
            if since is None or not self._queue or time.monotonic() - since < HANDOFF_S:
                continue
            with self._cv:
                if (self._thread is thread and self._callbacks_since is since and self._queue
                        and not self._nested):
                    log.info("ringcomm: a future callback on %s has run %.0f ms with "
                             "collectives queued; a new progress thread takes the lane",
                             self._describe(), (time.monotonic() - since) * 1e3)
                    self._release_owner()
                    self._spawn()
                    self._cv.notify_all()

    def _wrap(self, op: str, e: BaseException, timeout_s: float) -> BaseException:
        where = f"{self._describe()}, rank {self.tp.rank} of {self.tp.size}"
        if isinstance(e, TransportAborted):
            err = dist.DistBackendError(f"ringcomm {op} was interrupted ({where}): {e}")
            err.__cause__ = e
            return err
        if isinstance(e, dist.DistBackendError) and str(e).startswith("ringcomm"):
            return e
        return collective_error(op, where, e, timeout_s, isinstance(e, TransportTimeout),
                                f" {e}")

    def shutdown(self, wait_s: float = 5.0, interrupt: str | None = None) -> bool:
        """Stop the progress thread; queued collectives fail. With ``interrupt``, the
        running collective's waits end at once with that reason. Idempotent.

        Returns:
            True when nothing runs on the lane any more (the thread ended and no
            caller's thread holds the lane), within ``wait_s``."""
        if interrupt is not None:
            self.tp.interrupt(interrupt)
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            if thread is threading.current_thread():
                return False  # called from this lane's own work: it is still running
            thread.join(wait_s)
            if thread.is_alive():
                return False
        if not self._own.acquire(timeout=wait_s):  # a synchronous call on a caller's thread
            return False
        self._own.release()
        return True
