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
        self._done = threading.Event()
        self._value: Any = None
        self._exc: BaseException | None = None
        self._fut = torch.futures.Future()
        self._public: torch.futures.Future | None = None
        self._lock = threading.Lock()

    # -- completion (engine side) ---------------------------------------------
    def _finish(self, value: Any = None, exc: BaseException | None = None) -> None:
        self._value, self._exc = value, exc
        self._done.set()
        self._fut.set_result(exc if exc is not None else value)

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
        limit = timeout.total_seconds() if timeout else 0.0
        start = time.monotonic()
        while not self._done.wait(1.0 if limit <= 0 else min(1.0, limit)):
            if not self._engine.alive():
                raise dist.DistBackendError(
                    f"ringcomm {self._op}: the group's progress thread stopped before the "
                    "collective completed (was the process group shut down?)")
            if 0 < limit <= time.monotonic() - start:
                raise dist.DistBackendError(
                    f"ringcomm {self._op}: Work.wait timed out after {limit:.3f}s")
        if self._exc is not None:
            raise self._exc
        return True

    def get_future(self) -> torch.futures.Future:
        """A future holding the output tensors; it raises if the collective failed."""
        with self._lock:
            if self._public is None:
                self._public = self._fut.then(_unwrap)
            return self._public

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._exc is None

    def exception(self) -> BaseException | None:
        return self._exc

    def result(self) -> Any:
        self.wait()
        return self._value

    def synchronize(self) -> None:
        self.wait()

    def __repr__(self) -> str:
        state = "failed" if self._exc else "done" if self._done.is_set() else "pending"
        return f"<ringcomm.Work {self._op} {state}>"
