"""Work handles returned by every ringcomm collective."""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _unwrap(fut: torch.futures.Future) -> Any:
    value = fut.value()
    if isinstance(value, BaseException):
        raise value
    return value


class Work(dist.Work):
    """Completion handle of one collective.

    torch's C++ side forwards only :meth:`wait` and :meth:`get_future` to Python
    subclasses; the other methods serve Python callers.

    The internal future is completed with the result *or the exception object*;
    :meth:`get_future` returns a ``then``-chained future that raises it, because an
    exception set with ``Future.set_exception`` does not survive the trip through C++.
    """

    def __init__(self, op: str, engine: "Any"):
        super().__init__()
        self._op = op
        self._engine = engine
        self._lock = threading.Lock()
        self._done = False
        # Created only when someone has to wait or asks for a future: a synchronous
        # call that ran inline completes before anybody looks.
        self._event: threading.Event | None = None
        self._fut: torch.futures.Future | None = None
        self._public: torch.futures.Future | None = None
        self._value: Any = None
        self._exc: BaseException | None = None

    # -- completion (engine side) ---------------------------------------------
    def _finish(self, value: Any = None, exc: BaseException | None = None) -> None:
        with self._lock:
            self._value, self._exc = value, exc
            self._done = True
            event, fut = self._event, self._fut
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
        if self._engine.on_progress_thread():
            # A future callback runs on the progress thread; waiting there for a
            # collective that thread has yet to run would never end.
            raise dist.DistBackendError(
                f"ringcomm {self._op}: Work.wait() called on the group's progress thread "
                "(inside a future callback) would deadlock; chain with Future.then instead")
        start = time.monotonic()
        while not event.wait(1.0 if limit <= 0 else min(1.0, limit)):
            if not self._engine.alive():
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
                self._public = self._fut.then(_unwrap)
            return self._public

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._exc is None

    def exception(self) -> BaseException | None:
        return self._exc

    def result(self) -> Any:
        self.wait()
        return self._value

    def synchronize(self) -> None:
        self.wait()

    def __repr__(self) -> str:
        state = "failed" if self._exc else "done" if self._done else "pending"
        return f"<ringcomm.Work {self._op} {state}>"


class P2PWork(Work):
    """Handle of a user send/receive (``dist.isend`` / ``dist.irecv``).

    The message is already posted to the transport; :meth:`wait` drives it to
    completion with a deadline counted from when it was posted.
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
        self._complete_lock = threading.Lock()

    def _complete(self) -> None:
        with self._complete_lock:
            if self._done:
                return
            if self._on_done is not None:
                self._on_done()
            self._finish([self._handle.buf])

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until the message completed.

        Raises:
            torch.distributed.DistBackendError: the group timeout (counted from when the
                message was posted) or ``timeout`` passed first.
        """
        if self._done:
            if self._exc is not None:
                raise self._exc
            return True
        limit = timeout.total_seconds() if timeout else 0.0
        deadline = min(self._deadline, time.monotonic() + limit) if limit > 0 else self._deadline
        if not self._tp.p2p_wait(self._handle, deadline):
            h = self._handle
            peer = "any rank" if h.peer < 0 else f"rank {h.peer}"
            if deadline < self._deadline:  # the caller's own limit: the message stays posted
                raise dist.DistBackendError(f"ringcomm {self._op}: Work.wait timed out after "
                                            f"{limit:.3f}s")
            self._tp.p2p_cancel(h)
            err = dist.DistBackendError(
                f"ringcomm {self._op} {'to' if h.kind == 'send' else 'from'} {peer} timed out "
                f"after {self._timeout_s:g}s on rank {self._tp.rank}")
            with self._complete_lock:
                if not self._done:
                    self._finish(exc=err)
            raise err
        self._complete()
        return True

    def is_completed(self) -> bool:
        if not self._done and self._tp.p2p_done(self._handle):
            self._complete()
        return self._done

    def _source_rank(self) -> int:
        self.wait()
        return self._tp.p2p_source(self._handle)

    source_rank = _source_rank

    def get_future(self) -> torch.futures.Future:
        with self._complete_lock:
            if self._waiter is None and not self._done:
                # Nothing else drives a posted message: a helper thread waits for it.
                self._waiter = threading.Thread(target=self._wait_quietly, daemon=True,
                                                name=f"ringcomm-{self._op}")
                self._waiter.start()
        return super().get_future()

    def _wait_quietly(self) -> None:
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - the error is in the future already
            pass
