"""The benchmark and :mod:`ringcomm.trace`: the run's recording (``--trace``), the
recordings behind the trace-overhead comparison, and one traced iteration per
model: its breakdown read from the spans and its timeline.

Only one recording can be on at a time (``ringcomm.trace.start`` replaces the one
in progress), so the run's recording is kept in segments: :meth:`Tracer.off`
pauses it where the benchmark needs tracing off (the untraced runs of the
overhead comparison), :meth:`Tracer.own` pauses it for a recording of the
benchmark's own (the traced runs, the timeline iteration), whose events join the
run's trace. At the end each rank writes its segments as one file and rank 0
merges the files.
"""
from __future__ import annotations

import contextlib
import json
import socket
from typing import Iterator

import numpy as np
import torch.distributed as dist

from ringcomm import trace

#: how the trace-based breakdown is read from the spans of one traced iteration
TRACE_METHOD = ("one synchronized iteration after warm-up recorded with ringcomm.trace: "
                "forward = the 'forward' span, backward = the 'backward' span (first gradient "
                "hook to the end-of-backward callback), exposed communication = end of "
                "'backward' to end of 'copy-back' (waiting for the buckets, copying back), "
                "optimizer = the 'optimizer step' span, total = start of 'forward' to end "
                "of 'optimizer step'; each the max over ranks. Next to it (wall_clock_ms) the "
                "no_sync() method's numbers of the same configuration, backward = backward "
                "under no_sync()")
OVERHEAD_METHOD = ("total time per iteration of ours/ringcomm with a ringcomm.trace recording "
                   "on, against the same configuration with it off, timed in the same "
                   "interleaved rounds")
CONCURRENCY_METHOD = ("a few synchronized iterations of ours/ringcomm after warm-up per K, "
                      "recorded with ringcomm.trace; per iteration and rank, over the "
                      "iteration's allreduce "
                      "spans (each on the thread that ran it: a channel's progress thread): "
                      "their number, the most in flight at once, the channel threads used, "
                      "the sum of their durations, the time at least one ran (union), the "
                      "time each waited between its enqueue and its start (queued behind "
                      "the channel's earlier work), the backward span and the exposed tail "
                      "(end of backward to end of copy-back); each the max over ranks, then "
                      "the median over the iterations")
#: the traced configuration, and overlap off for the second timeline
TRACED = "ours/ringcomm"
TRACED_OFF = "off/ringcomm"


class Tracer:
    """The run's recording (``path`` None: no run recording; :meth:`own` still records)."""

    def __init__(self, path: str | None):
        self.path = path
        self.segments: list[trace.Recorder] = []

    def start(self) -> None:
        if self.path:
            trace.start()

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """No recording while the block runs (the run's resumes after it)."""
        outer = trace.stop() if trace.active() else None
        if outer is not None:
            self.segments.append(outer)
        try:
            yield
        finally:
            if outer is not None:
                trace.start(outer.rank)

    @contextlib.contextmanager
    def own(self) -> Iterator[trace.Recorder]:
        """A recording of the block alone; its events also join the run's trace."""
        with self.off():
            rec = trace.start()
            try:
                yield rec
            finally:
                trace.stop()
                if self.path:
                    self.segments.append(rec)

    def finish(self, ctrl: object) -> str | None:
        """Every rank writes its file, then (after a barrier on ``ctrl``) rank 0 merges
        them into ``path``; returns rank 0's line about it."""
        if not self.path:
            return None
        last = trace.stop()
        if last is not None:
            self.segments.append(last)
        rank, size = dist.get_rank(), dist.get_world_size()
        mine = trace.rank_path(self.path, rank)
        failed = None
        try:
            mine.parent.mkdir(parents=True, exist_ok=True)
            mine.write_text(json.dumps(combine(self.segments, rank)))
        except OSError as e:  # raised after the barrier, so no rank is left waiting
            failed = e
        self.segments = []
        dist.barrier(group=ctrl)
        if failed is not None:
            raise failed
        if rank != 0:
            return None
        docs = [json.loads(trace.rank_path(self.path, r).read_text()) for r in range(size)]
        merged = trace.merge(docs)
        with open(self.path, "w") as f:
            json.dump(merged, f)
        return (f"# trace: {self.path} ({len(merged['traceEvents'])} events of ranks "
                f"{merged['otherData']['ranks']}; per rank {trace.rank_path(self.path, 0)} ...)")


def combine(recs: list[trace.Recorder], rank: int) -> dict:
    """One rank's trace document from its recordings, threads matched by name."""
    tids: dict[str, int] = {}
    events = []
    for rec in recs:
        doc = rec.document()
        names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
                 if e.get("ph") == "M" and e.get("name") == "thread_name"}
        for e in doc["traceEvents"]:
            if e.get("ph") != "M":
                name = names.get(e["tid"], f"thread {e['tid']}")
                events.append({**e, "tid": tids.setdefault(name, len(tids))})
    head = trace.Recorder(rank).document()
    head["traceEvents"] += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": t,
                             "args": {"name": n}} for n, t in tids.items()]
    head["traceEvents"] += events
    head["otherData"]["host"] = socket.gethostname()
    return head


# -- one traced iteration -----------------------------------------------------------
def _spans(doc: dict, rank: int, name: str) -> list[dict]:
    return sorted((e for e in doc["traceEvents"] if e.get("pid") == rank
                   and e.get("ph") == "X" and e.get("name") == name), key=lambda e: e["ts"])


def _end(e: dict) -> float:
    return e["ts"] + e["dur"]


def window(doc: dict) -> tuple[float, float]:
    """(start, end) in microseconds: the earliest forward to the latest optimizer step
    end over the ranks, with a margin of 2%."""
    fwd = [e["ts"] for e in doc["traceEvents"] if e.get("name") == "forward"]
    opt = [_end(e) for e in doc["traceEvents"] if e.get("name") == "optimizer step"]
    if not fwd or not opt:
        raise ValueError("bench_ddp: the traced iteration has no forward or optimizer step")
    t0, t1 = min(fwd), max(opt)
    pad = 0.02 * (t1 - t0)
    return t0 - pad, t1 + pad


def breakdown(doc: dict, ranks: list[int]) -> dict:
    """The spans of the one synchronized iteration in ``doc`` per rank (see TRACE_METHOD),
    in ms, and their maximum over ranks.

    Raises:
        ValueError: a rank lacks a span (the iteration was not a synchronized one of
            ``ddp/``).
    """
    per: dict[str, list[float]] = {k: [] for k in ("forward", "backward", "exposed_comm",
                                                    "optimizer", "total")}
    for r in ranks:
        got = {n: _spans(doc, r, n) for n in ("forward", "backward", "copy-back",
                                               "optimizer step")}
        missing = [n for n, v in got.items() if not v]
        if missing:
            raise ValueError(f"bench_ddp: rank {r}'s traced iteration has no {missing} span")
        fwd, back, copy, opt = (got[n][-1] for n in ("forward", "backward", "copy-back",
                                                      "optimizer step"))
        per["forward"].append(fwd["dur"])
        per["backward"].append(back["dur"])
        per["exposed_comm"].append(_end(copy) - _end(back))
        per["optimizer"].append(opt["dur"])
        per["total"].append(_end(opt) - fwd["ts"])
    return {"ms": {k: round(max(v) / 1e3, 3) for k, v in per.items()},
            "rank_ms": {k: [round(x / 1e3, 3) for x in v] for k, v in per.items()}}


def off_breakdown(doc: dict, ranks: list[int]) -> dict:
    """Overlap off's traced iteration: forward, the flat allreduce (the collective's
    span), optimizer, total; max over ranks (ms)."""
    per: dict[str, list[float]] = {k: [] for k in ("forward", "allreduce", "optimizer",
                                                    "total")}
    for r in ranks:
        fwd, opt = _spans(doc, r, "forward"), _spans(doc, r, "optimizer step")
        colls = [e for e in doc["traceEvents"] if e.get("pid") == r and e.get("ph") == "X"
                 and e.get("cat") == "collective" and e["name"].startswith("allreduce")]
        if not fwd or not opt or not colls:
            raise ValueError(f"bench_ddp: rank {r}'s traced overlap-off iteration lacks a span")
        per["forward"].append(fwd[-1]["dur"])
        per["allreduce"].append(max(c["dur"] for c in colls))
        per["optimizer"].append(opt[-1]["dur"])
        per["total"].append(_end(opt[-1]) - fwd[-1]["ts"])
    return {"ms": {k: round(max(v) / 1e3, 3) for k, v in per.items()},
            "rank_ms": {k: [round(x / 1e3, 3) for x in v] for k, v in per.items()}}


def _union(intervals: list[tuple[float, float]]) -> tuple[float, int]:
    """Total length covered by ``intervals`` and the most that overlap at one time."""
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals],
                   key=lambda e: (e[0], e[1]))  # an end before a start at the same time
    covered, depth, most, since = 0.0, 0, 0, 0.0
    for t, d in edges:
        if depth > 0:
            covered += t - since
        depth += d
        most = max(most, depth)
        since = t
    return covered, most


def concurrency(doc: dict, ranks: list[int], iteration: int = -1) -> dict:
    """How the allreduces of synchronized iteration ``iteration`` (an index into the
    iterations recorded in ``doc``) ran, per rank and the max over ranks (see
    CONCURRENCY_METHOD); times in ms.

    Raises:
        ValueError: a rank lacks the iteration's spans or its allreduces.
    """
    keys = ("allreduces", "max_in_flight", "threads", "allreduce_sum_ms", "allreduce_union_ms",
            "queued_sum_ms", "backward_ms", "exposed_ms", "total_ms")
    per: dict[str, list] = {k: [] for k in keys}
    for r in ranks:
        got = {n: _spans(doc, r, n) for n in ("forward", "backward", "copy-back",
                                               "optimizer step")}
        missing = [n for n, v in got.items() if len(v) < (iteration + 1 if iteration >= 0
                                                           else -iteration)]
        if missing:
            raise ValueError(f"bench_ddp: rank {r}'s traced iteration {iteration} has no "
                             f"{missing} span")
        fwd, back, copy, opt = (got[n][iteration] for n in ("forward", "backward", "copy-back",
                                                             "optimizer step"))
        colls = [e for e in doc["traceEvents"] if e.get("pid") == r and e.get("ph") == "X"
                 and e.get("cat") == "collective" and e["name"].startswith("allreduce")
                 and fwd["ts"] <= e["ts"] <= _end(opt)]
        if not colls:
            raise ValueError(f"bench_ddp: rank {r}'s traced iteration has no allreduce")
        union, most = _union([(e["ts"], _end(e)) for e in colls])
        per["allreduces"].append(len(colls))
        per["max_in_flight"].append(most)
        per["threads"].append(len({e["tid"] for e in colls}))
        per["allreduce_sum_ms"].append(sum(e["dur"] for e in colls) / 1e3)
        per["allreduce_union_ms"].append(union / 1e3)
        per["queued_sum_ms"].append(sum(max(0.0, e["ts"] - e["args"].get("enqueued_us", e["ts"]))
                                        for e in colls) / 1e3)
        per["backward_ms"].append(back["dur"] / 1e3)
        per["exposed_ms"].append((_end(copy) - _end(back)) / 1e3)
        per["total_ms"].append((_end(opt) - fwd["ts"]) / 1e3)
    return {"max": {k: round(max(v), 3) if isinstance(v[0], float) else max(v)
                    for k, v in per.items()},
            "rank": {k: [round(x, 3) if isinstance(x, float) else x for x in v]
                     for k, v in per.items()}}


def concurrency_median(doc: dict, ranks: list[int], iterations: int) -> dict:
    """:func:`concurrency` of each of the ``iterations`` recorded iterations, and per
    key the median over them of the max over ranks (``median``)."""
    its = [concurrency(doc, ranks, i) for i in range(iterations)]
    med = {}
    for k in its[0]["max"]:
        v = float(np.median([it["max"][k] for it in its]))
        med[k] = (round(v, 3) if isinstance(its[0]["max"][k], float) or not v.is_integer()
                  else int(v))
    totals = [it["max"]["total_ms"] for it in its]
    typical = sorted(range(len(its)), key=lambda i: totals[i])[(len(its) - 1) // 2]
    return {"median": med, "iterations": [it["max"] for it in its],
            "typical_iteration": typical}


def iteration_window(doc: dict, i: int) -> tuple[float, float]:
    """(start, end) in microseconds of recorded iteration ``i`` over the ranks: its
    earliest forward to its latest optimizer step end, with a margin of 2%."""
    ranks = sorted({e["pid"] for e in doc["traceEvents"] if e.get("name") == "forward"})
    t0 = min(_spans(doc, r, "forward")[i]["ts"] for r in ranks)
    t1 = max(_end(_spans(doc, r, "optimizer step")[i]) for r in ranks)
    pad = 0.02 * (t1 - t0)
    return t0 - pad, t1 + pad


def draw_roundrobin(traces: dict, summary: dict, model: str, out_dir: str) -> list[str]:
    """The timeline of a typical traced iteration (:func:`concurrency_median`) of the
    smallest and the largest K (``traces[k]``: a merged trace; ``summary``: the
    section's ``trace`` part) as ``bench_ddp_roundrobin_timeline_k<K>.png``."""
    import os

    from ringcomm.trace import timeline

    written = []
    ks = sorted(traces, key=int)
    for k in dict.fromkeys((ks[0], ks[-1])):
        e = summary["per_k"].get(str(k), {})
        if "typical_iteration" not in e:
            continue
        path = os.path.join(out_dir, f"bench_ddp_roundrobin_timeline_k{k}.png")
        m = e["median"]
        timeline.draw(traces[k], path, iteration_window(traces[k], e["typical_iteration"]),
                      title=f"one iteration of {summary['config']} on {k} channel"
                            f"{'s' if int(k) > 1 else ''}, {model}, bucket_cap_mb "
                            f"{summary['bucket_cap_mb']}: {m['allreduces']} bucket allreduces, "
                            f"at most {m['max_in_flight']} at once")
        written.append(path)
    return written


def draw(traces: dict, model: str, out_dir: str) -> list[str]:
    """The timelines of ``model``'s traced iterations (``traces[config]``: a merged
    trace) as ``bench_ddp_timeline.png`` (ours/ringcomm) and
    ``bench_ddp_timeline_off.png`` (overlap off)."""
    import os

    from ringcomm.trace import timeline

    written = []
    for config, name, what in (
            (TRACED, "bench_ddp_timeline.png", "overlap on: buckets allreduced on the "
             "progress thread during backward"),
            (TRACED_OFF, "bench_ddp_timeline_off.png", "overlap off: backward under no_sync() "
             "(not traced: the gap after forward), then one flat allreduce")):
        doc = traces.get(config)
        if doc is None:
            continue
        ranks = doc["otherData"]["ranks"]
        path = os.path.join(out_dir, name)
        timeline.draw(doc, path, window(doc),
                      title=f"one iteration of {config}, {model}, {len(ranks)} ranks\n{what}")
        written.append(path)
    return written
