"""A timeline of what ringcomm and ``ddp/`` do, per rank, in Chrome's trace
format (opens in https://ui.perfetto.dev and chrome://tracing).

Turn it on for a whole run with ``RINGCOMM_TRACE=run.json`` (each rank writes
``run.rank<r>.json`` at exit), or for part of a run::

    with ringcomm.trace.recording("step.json"):      # every rank alike
        train_one_step()

then merge the ranks' files into one, one process per rank, clocks aligned::

    python -m ringcomm.trace merge run.json run.rank*.json

What is recorded: each collective's enqueue (an instant on the caller's thread)
and its run from start to end (on the thread that ran it: the caller's or the
group's progress thread), with its algorithm, the bytes of its tensors, its
peers, its group and its number; each step of a schedule as it retires; from
``ddp/``: backward, each bucket's ready, launch, wait and copy-back, and the
optimizer step. While a ``torch.profiler`` session runs, the same spans are also
``record_function`` ranges, so they appear next to torch's own ops.

Off, every hook is one test of a module flag.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
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


# -- merging ------------------------------------------------------------------------
def merge(docs: list[dict], align: bool | None = None) -> dict:
    """One trace from the ranks' traces.

    Ranks on one host share its clock, so their events are kept as recorded.
    Across hosts (or with ``align=True``), each rank's clock is shifted so that
    the end of its first barrier (or, without one, of its first collective) meets
    rank 0's: a barrier ends at nearly the same moment on every rank, closer than
    the clocks of two hosts usually agree. ``align=False`` keeps every clock.

    Raises:
        ValueError: a document is not a ringcomm trace, or two are of one rank.
    """
    seen: dict[int, dict] = {}
    for d in docs:
        other = d.get("otherData", {}) if isinstance(d, dict) else {}
        if other.get("schema") != "ringcomm.trace/1" or "rank" not in other:
            raise ValueError("ringcomm.trace.merge: not a ringcomm trace (no otherData.schema "
                             "ringcomm.trace/1)")
        if other["rank"] in seen:
            raise ValueError(f"ringcomm.trace.merge: two traces of rank {other['rank']}")
        seen[other["rank"]] = d
    shifts = {r: 0.0 for r in seen}
    if align is None:
        align = len({d["otherData"].get("host") for d in seen.values()}) > 1
    if align and len(seen) > 1:
        marks = {r: _sync_mark(d["traceEvents"]) for r, d in seen.items()}
        if all(m is not None for m in marks.values()):
            ref = marks[min(marks)]
            shifts = {r: ref - m for r, m in marks.items()}  # type: ignore[operator]
    events = []
    for r in sorted(seen):
        for e in seen[r]["traceEvents"]:
            if "ts" in e and shifts[r]:
                e = {**e, "ts": e["ts"] + shifts[r]}
            events.append(e)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schema": "ringcomm.trace/1", "ranks": sorted(seen),
                          "clock_shift_us": {str(r): s for r, s in shifts.items()}}}


def _sync_mark(events: list[dict]) -> float | None:
    colls = [e for e in events if e.get("cat") == "collective" and e.get("ph") == "X"]
    barriers = [e for e in colls if e["name"].startswith("barrier")]
    first = min(barriers or colls, key=lambda e: e["ts"], default=None)
    return None if first is None else first["ts"] + first["dur"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringcomm.trace",
                                 description="Merge the ranks' trace files into one.")
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge per-rank traces into one Chrome trace")
    m.add_argument("output")
    m.add_argument("inputs", nargs="+")
    how = m.add_mutually_exclusive_group()
    how.add_argument("--align", action="store_true", default=None,
                     help="align the ranks' clocks on their first barrier even on one host "
                     "(the default only across hosts)")
    how.add_argument("--no-align", dest="align", action="store_false",
                     help="keep each rank's clock as recorded")
    a = ap.parse_args(argv)
    docs = []
    for path in a.inputs:
        try:
            docs.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            print(f"ringcomm.trace merge: cannot read {path}: {e}", file=sys.stderr)
            return 2
    try:
        out = merge(docs, align=a.align)
    except ValueError as e:
        print(f"{e} (in {', '.join(a.inputs)})", file=sys.stderr)
        return 2
    Path(a.output).write_text(json.dumps(out))
    print(f"{a.output}: {len(out['traceEvents'])} events of ranks {out['otherData']['ranks']}")
    return 0
