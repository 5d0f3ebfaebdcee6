"""Timing replicas on every rank and combining the ranks' spans into statistics."""
from __future__ import annotations

import contextlib
import gc
import math
from typing import Any, Callable, ContextManager

import numpy as np
import torch.distributed as dist

from ringcomm.bench.timing import Progress

from ddp.bench.configs import Replica, World
from ddp.bench.constants import SPANS

def nosync_cycles(iters: int, n: int) -> int:
    """Timed cycles of n iterations: about ``iters`` iterations, at least 3 cycles."""
    return max(3, math.ceil(iters / n))


def measure(replicas: dict[str, Replica], cycles: int, warmup: int, rounds: int,
            ctrl: Any, progress: Progress, what: str,
            session: Callable[[Replica], ContextManager] | None = None) -> dict[str, dict]:
    """Time ``cycles`` cycles (``every`` iterations each) of every replica on this rank.

    Each replica first runs ``warmup`` synchronized iterations (the first builds the
    buckets from the observed gradient order). The timed cycles are split into
    ``rounds`` rounds that visit the replicas in turn, rotating the order, so load
    from other processes falls on all of them alike; the ranks of ``ctrl`` start each
    batch together. Returns per replica this rank's per-cycle spans (seconds per
    iteration, amortized over the cycle), as a list of rows in SPANS order.
    ``session(replica)``, if given, is entered around each of a replica's batches of
    timed cycles (outside the timed spans): e.g. a trace recording on or off.
    """
    names = list(replicas)
    for name in names:
        r = replicas[name]
        for i in range(warmup):
            r.iteration(r.every - 1 if r.every else i)  # synchronized where it ever is
    rounds = max(1, min(rounds, cycles))
    times: dict[str, list] = {n: [] for n in names}
    gc_was = gc.isenabled()
    gc.collect()
    gc.disable()  # a collection pause in one rank stalls all of them
    try:
        for rnd in range(rounds):
            k = rnd % len(names)
            for name in names[k:] + names[:k]:
                progress.step(f"{what} {name}")
                r = replicas[name]
                cycle = max(1, r.every)
                n = cycles // rounds + (1 if rnd < cycles % rounds else 0)
                dist.barrier(group=ctrl)
                with session(r) if session else contextlib.nullcontext():
                    for _ in range(n):
                        spans = np.zeros(len(SPANS))
                        for i in range(cycle):
                            spans += r.iteration(i)
                        times[name].append((spans / cycle).tolist())
    finally:
        if gc_was:
            gc.enable()
    return times


def statistics(world: World, mine: dict[str, list] | None) -> dict[str, dict]:
    """Combine every rank's spans: per span, each rank's median (ms) and their maximum;
    the spread as each rank's first and third quartile, each the maximum over ranks
    (``q1_ms``, ``q3_ms``: the statistic applied to the quartiles). Ranks that did
    not take part pass None."""
    qs = None
    if mine is not None:
        qs = {n: np.percentile(np.array(rows), [25, 50, 75], axis=0).tolist()
              for n, rows in mine.items()}
    everyone = [m for m in world.gather(qs) if m is not None]
    out = {}
    for name in everyone[0]:
        per_rank = np.array([m[name] for m in everyone]) * 1e3  # ranks x quartiles x spans, ms

        def top(q: int) -> dict[str, float]:
            return {s: round(float(per_rank[:, q, j].max()), 3) for j, s in enumerate(SPANS)}

        out[name] = {"ms": top(1),
                     "rank_median_ms": {s: [round(float(v), 3) for v in per_rank[:, 1, j]]
                                        for j, s in enumerate(SPANS)},
                     "q1_ms": top(0), "q3_ms": top(2),
                     "samples": len(mine[name]) if mine else None}
    return out
