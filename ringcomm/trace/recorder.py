"""The recorder: one rank's events in memory, the hooks every layer calls
(:func:`instant`, :func:`span`, :func:`annotate`, :func:`complete`, :func:`now`,
each one test of the module's ``_rec`` when off) and starting and stopping a
recording. :mod:`ringcomm.trace` hands these names on."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from ringcomm import settings

#: the recorder in use, or None (the one flag every hook tests)
_rec: "Recorder | None" = None


class Recorder:
    """The events of one rank, in memory until :meth:`write`.

    Timestamps are microseconds since the epoch, taken from a monotonic clock
    anchored to the wall clock once: ranks on one host agree; across hosts
    :func:`merge` aligns them.
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._anchor_ns = time.time_ns() - time.perf_counter_ns()
        self._tids: dict[int, int] = {}
        self._local = threading.local()

    def now(self) -> float:
        return (time.perf_counter_ns() + self._anchor_ns) / 1000.0

    def _tid(self) -> int:
        ident = threading.get_ident()
        tid = self._tids.get(ident)
        if tid is None:
            with self._lock:
                tid = self._tids.setdefault(ident, len(self._tids))
                self.events.append({"ph": "M", "name": "thread_name", "pid": self.rank,
                                    "tid": tid,
                                    "args": {"name": threading.current_thread().name}})
        return tid

    def add(self, event: dict) -> None:
        event["pid"] = self.rank
        event.setdefault("tid", self._tid())
        with self._lock:
            self.events.append(event)

    def open_spans(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def document(self) -> dict:
        meta = [{"ph": "M", "name": "process_name", "pid": self.rank,
                 "args": {"name": f"rank {self.rank}"}},
                {"ph": "M", "name": "process_sort_index", "pid": self.rank,
                 "args": {"sort_index": self.rank}}]
        with self._lock:
            events = meta + list(self.events)
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"schema": "ringcomm.trace/1", "rank": self.rank,
                              "host": socket.gethostname()}}

    def write(self, path: str | os.PathLike) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.document()))
        return out


def active() -> bool:
    """Whether a recording is on."""
    return _rec is not None


def instant(name: str, cat: str, **args: Any) -> None:
    """A point in time on this thread."""
    rec = _rec
    if rec is not None:
        rec.add({"ph": "i", "s": "t", "name": name, "cat": cat, "ts": rec.now(), "args": args})


@contextlib.contextmanager
def span(name: str, cat: str, **args: Any) -> Iterator[dict]:
    """A span from entry to exit on this thread; yields its args, which
    :func:`annotate` (or the caller) may extend before it ends."""
    rec = _rec
    if rec is None:
        yield args
        return
    ranges = _profiler_range(name)
    stack = rec.open_spans()
    stack.append(args)
    start = rec.now()
    try:
        yield args
    finally:
        stack.pop()
        rec.add({"ph": "X", "name": name, "cat": cat, "ts": start, "dur": rec.now() - start,
                 "args": args})
        if ranges is not None:
            ranges.__exit__(None, None, None)


def annotate(**args: Any) -> None:
    """Add ``args`` to the innermost open span of this thread (no-op when off)."""
    rec = _rec
    if rec is not None:
        stack = rec.open_spans()
        if stack:
            stack[-1].update(args)


def complete(name: str, cat: str, start_us: float, end_us: float, **args: Any) -> None:
    """A span measured by the caller (:func:`now` at both ends) on this thread."""
    rec = _rec
    if rec is not None:
        rec.add({"ph": "X", "name": name, "cat": cat, "ts": start_us,
                 "dur": max(0.0, end_us - start_us), "args": args})


def now() -> float:
    """The recording's clock, in microseconds (0.0 when off)."""
    rec = _rec
    return rec.now() if rec is not None else 0.0


def _profiler_range(name: str) -> Any:
    import torch

    if not torch.autograd.profiler._is_profiler_enabled:
        return None
    r = torch.autograd.profiler.record_function(f"ringcomm: {name}")
    r.__enter__()
    return r


def rank_path(path: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` writes a recording asked for as ``path``:
    ``{rank}`` in it is replaced, else ``.rank<r>`` goes before the suffix."""
    text = str(path)
    if "{rank}" in text:
        return Path(text.replace("{rank}", str(rank)))
    p = Path(text)
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}")


def _current_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


#: removers of the optimizer-step hooks while recording
_hooks: list = []


def _optimizer_pre(opt: Any, args: Any, kwargs: Any) -> None:
    rec = _rec
    if rec is not None:
        rec.open_spans().append({"optimizer": type(opt).__name__, "_start": rec.now()})


def _optimizer_post(opt: Any, args: Any, kwargs: Any) -> None:
    rec = _rec
    if rec is not None:
        stack = rec.open_spans()
        if stack and "_start" in stack[-1]:
            args_ = stack.pop()
            start_us = args_.pop("_start")
            rec.add({"ph": "X", "name": "optimizer step", "cat": "train", "ts": start_us,
                     "dur": rec.now() - start_us, "args": args_})


def start(rank: int | None = None) -> Recorder:
    """Start recording (replacing any recording in progress) and return the recorder.
    Every ``torch.optim`` optimizer's step is recorded too."""
    global _rec
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    _rec = Recorder(_current_rank() if rank is None else rank)
    if not _hooks:
        _hooks.extend([register_optimizer_step_pre_hook(_optimizer_pre),
                       register_optimizer_step_post_hook(_optimizer_post)])
    return _rec


def stop(path: str | os.PathLike | None = None) -> Recorder | None:
    """Stop recording; with ``path``, write this rank's file (see :func:`rank_path`)."""
    global _rec
    rec, _rec = _rec, None
    while _hooks:
        _hooks.pop().remove()
    if rec is not None and path is not None:
        rec.write(rank_path(path, rec.rank))
    return rec


@contextlib.contextmanager
def recording(path: str | os.PathLike | None = None, *,
              rank: int | None = None) -> Iterator[Recorder]:
    """Record while the block runs; at its end write this rank's file of ``path``
    (if given). Yields the :class:`Recorder`, whose ``events`` a test may read."""
    rec = start(rank)
    try:
        yield rec
    finally:
        if _rec is rec:
            stop(path)


def start_from_environment() -> None:
    """``RINGCOMM_TRACE=path``: record the whole run, written at exit."""
    path = settings.get("RINGCOMM_TRACE")
    if path and _rec is None:
        import atexit

        start()
        atexit.register(lambda: stop(path))
