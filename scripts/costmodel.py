"""Alpha-beta-gamma cost models for collective algorithms, their fit to measured
timings, predictions, crossovers, and the ``auto`` tuning rows derived from them.

Pure numpy; no MPI, no torch. ``compare_collectives.py`` uses it, and so can a
notebook or a test.

The model of one algorithm of one collective is::

    T(p, n) = o + alpha * A(p, n) + beta * B(p, n) + gamma * G(p, n)

``p`` is the world size and ``n`` the message size as nccl-tests reports it
(the buffer for allreduce and broadcast, the whole gathered buffer for
allgather, the whole input for reduce_scatter, one rank's send buffer for
alltoall). ``A`` counts the messages on the critical path (each pipeline
segment is one message), ``B`` the bytes that cross the busiest link one
after another, ``G`` the bytes the busiest rank reduces. ``alpha`` is the cost
of one message, ``beta`` the cost of one byte on a link (1/bandwidth),
``gamma`` the cost of reducing one byte, ``o`` a per-call overhead.

With timings from one world size ``o`` and ``alpha`` cannot be told apart (both
scale with the call count only), so ``o`` is fitted only when the samples span
at least two world sizes; otherwise ``alpha`` absorbs it and predictions for
larger ``p`` are upper bounds for latency-bound sizes. At one world size
``beta`` and ``gamma`` are not separable either (both grow with ``n``), so
callers measure ``gamma`` directly (a local reduction) and pass it in.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

#: feature function: (p, n, segment_bytes) -> (A, B, G)
FeatureFn = Callable[[int, int, int], "tuple[float, float, float]"]

PARAMS = ("o", "alpha", "beta", "gamma")


def _log2ceil(p: int) -> int:
    return max(1, math.ceil(math.log2(p))) if p > 1 else 0


def _segs(nbytes: float, segment_bytes: int) -> int:
    """Pipeline segments of a buffer (at least one message even when empty)."""
    return max(1, math.ceil(nbytes / segment_bytes))


def _ring_allreduce(p: int, n: int, seg: int):
    k = _segs(n / p, seg)
    return 2 * (p - 1) * k, 2 * (p - 1) / p * n, (p - 1) / p * n


def _tree_allreduce(p: int, n: int, seg: int):
    # Binomial reduce then broadcast: the root receives and then sends every
    # segment once per child (log2 p children), and reduces each received one.
    L, k = _log2ceil(p), _segs(n, seg)
    return 2 * L * k, 2 * L * n, L * n


def _tree_broadcast(p: int, n: int, seg: int):
    L, k = _log2ceil(p), _segs(n, seg)
    return L * k, L * n, 0.0


def _chain_broadcast(p: int, n: int, seg: int):
    # A pipeline through p ranks: p - 1 hops to fill, then one segment per step.
    k = _segs(n, seg)
    steps = p - 2 + k
    return steps, steps * n / k, 0.0


def _ring_allgather(p: int, n: int, seg: int):
    k = _segs(n / p, seg)
    return (p - 1) * k, (p - 1) / p * n, 0.0


def _ring_reduce_scatter(p: int, n: int, seg: int):
    k = _segs(n / p, seg)
    return (p - 1) * k, (p - 1) / p * n, (p - 1) / p * n


def _pairwise_alltoall(p: int, n: int, seg: int):
    k = _segs(n / p, seg)
    return (p - 1) * k, (p - 1) / p * n, 0.0


def _effective(p: int, n: int, seg: int):
    """A black box (another library's collective): one latency plus n bytes."""
    return 1.0, float(n), 0.0


#: (collective, algorithm) -> features; algorithms not listed get no model
#: (their column is still fitted with the black-box model, but not extrapolated).
MODELS: dict[tuple[str, str], FeatureFn] = {
    ("allreduce", "ring"): _ring_allreduce,
    ("allreduce", "tree"): _tree_allreduce,
    ("broadcast", "tree"): _tree_broadcast,
    ("broadcast", "ring"): _chain_broadcast,
    ("allgather", "ring"): _ring_allgather,
    ("reduce_scatter", "ring"): _ring_reduce_scatter,
    ("alltoall", "pairwise"): _pairwise_alltoall,
}

#: collective -> whether its algorithms reduce (have a gamma term)
REDUCING = {"allreduce": True, "reduce_scatter": True, "broadcast": False,
            "allgather": False, "alltoall": False}


def features_for(collective: str, algorithm: str | None) -> FeatureFn:
    """The feature function of ``algorithm`` for ``collective``; the black-box model
    (``o + beta * n``) for ``None`` or an algorithm without a structural model."""
    if algorithm is None:
        return _effective
    return MODELS.get((collective, algorithm), _effective)


def has_model(collective: str, algorithm: str) -> bool:
    """True when ``algorithm`` has a structural model (so it can be extrapolated in p)."""
    return (collective, algorithm) in MODELS


@dataclasses.dataclass
class Fit:
    """A fitted cost model. Times in seconds, sizes in bytes.

    Attributes:
        collective, algorithm: what was fitted (``algorithm`` None: black box).
        o, alpha, beta, gamma: the parameters (s, s/message, s/byte, s/byte).
        fitted: names of the parameters fitted from the timings (the others were
            fixed or left at zero because the samples cannot determine them).
        rms_rel_err: root mean square of (model - measured) / measured.
        samples: number of timings used.
        world_sizes: distinct world sizes among them.
        segment_bytes: pipeline segment size the features assume.
    """

    collective: str
    algorithm: str | None
    o: float
    alpha: float
    beta: float
    gamma: float
    fitted: tuple[str, ...]
    rms_rel_err: float
    samples: int
    world_sizes: tuple[int, ...]
    segment_bytes: int

    def predict(self, p: int, n: int) -> float:
        """Modelled time (s) of one call on ``p`` ranks with message size ``n``."""
        A, B, G = features_for(self.collective, self.algorithm)(p, n, self.segment_bytes)
        return self.o + self.alpha * A + self.beta * B + self.gamma * G

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["world_sizes"] = list(self.world_sizes)
        d["fitted"] = list(self.fitted)
        return d


def _nnls_subsets(M: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best of the
    unconstrained solutions on every subset of columns that is non-negative."""
    cols = M.shape[1]
    best, best_res = np.zeros(cols), float(np.sum(y * y))
    for r in range(1, cols + 1):
        for subset in itertools.combinations(range(cols), r):
            sub = M[:, subset]
            x, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(x < 0):
                continue
            res = float(np.sum((sub @ x - y) ** 2))
            if res < best_res - 1e-18 * max(1.0, best_res):
                best_res = res
                best = np.zeros(cols)
                best[list(subset)] = x
    return best


def fit(collective: str, algorithm: str | None, samples: Iterable[tuple[int, int, float]], *,
        segment_bytes: int, gamma: float | None = None) -> Fit:
    """Fit the cost model of ``algorithm`` to measured timings.

    Minimises the relative error sum(((model - t) / t)^2) with every parameter
    non-negative, so small and large messages weigh alike.

    Args:
        collective: e.g. ``"allreduce"``.
        algorithm: e.g. ``"ring"``; ``None`` fits the black-box model ``o + beta * n``.
        samples: ``(world_size, nbytes, seconds)`` triples; non-positive or
            non-finite times are ignored.
        segment_bytes: the pipeline segment size the algorithm ran with.
        gamma: the measured reduction cost (s/byte) to hold fixed; ``None`` fits it
            when the samples can tell it from ``beta``, else leaves it at zero.
    Returns:
        The fit; ``fitted`` names the parameters the timings determined.
    Raises:
        ValueError: fewer than two usable samples, or a bad segment size.
    """
    if segment_bytes <= 0:
        raise ValueError(f"costmodel.fit: segment_bytes must be positive, got {segment_bytes}")
    pts = [(int(p), int(n), float(t)) for p, n, t in samples
           if t is not None and math.isfinite(float(t)) and float(t) > 0]
    if len(pts) < 2:
        raise ValueError(f"costmodel.fit {collective}/{algorithm}: need at least two timings, "
                         f"got {len(pts)}")
    fn = features_for(collective, algorithm)
    feats = np.array([(1.0, *fn(p, n, segment_bytes)) for p, n, _ in pts])
    t = np.array([x[2] for x in pts])
    world_sizes = tuple(sorted({p for p, _, _ in pts}))

    # Which parameters can these samples determine?
    free = [0, 1, 2, 3]
    black_box = fn is _effective
    if black_box:
        free = [0, 2]  # o + beta * n; A is constant 1 and G is zero
    elif len(world_sizes) < 2:
        free.remove(0)  # o is alpha * A / A at one world size: give it to alpha
    fixed_gamma = gamma if gamma is not None else 0.0
    if gamma is not None or black_box or not REDUCING.get(collective, False):
        if 3 in free:
            free.remove(3)
    y = t - fixed_gamma * feats[:, 3]
    W = 1.0 / t
    # Scale columns so the least squares is well conditioned (bytes vs messages).
    M = feats[:, free] * W[:, None]
    scale = np.abs(M).max(axis=0)
    scale[scale == 0] = 1.0
    M = M / scale
    # Drop columns that the others explain (e.g. beta and gamma at one world size).
    keep: list[int] = []
    for j in range(len(free)):
        if np.linalg.matrix_rank(M[:, keep + [j]], tol=1e-9 * math.sqrt(len(t))) == len(keep) + 1:
            keep.append(j)
    free, M, scale = [free[j] for j in keep], M[:, keep], scale[keep]
    x = _nnls_subsets(M, y * W) / scale
    params = np.zeros(4)
    params[free] = x
    if 3 not in free:
        params[3] = fixed_gamma
    model = feats @ params
    rms = float(np.sqrt(np.mean(((model - t) / t) ** 2)))
    fitted = tuple(PARAMS[i] for i in free)
    return Fit(collective, None if black_box else algorithm, float(params[0]), float(params[1]),
               float(params[2]), float(params[3]), fitted, rms, len(pts), world_sizes,
               segment_bytes)


def crossovers(a: Fit, b: Fit, p: int, lo: int = 1, hi: int = 1 << 36,
               tolerance: float = 0.02) -> list[tuple[int, str, str]]:
    """Sizes where the faster of two fitted algorithms changes, on ``p`` ranks.

    Scans ``[lo, hi]`` on a fine log grid. Sizes where the two are within
    ``tolerance`` of each other are ties and do not count as a change (two models
    of near-identical algorithms would otherwise "cross" on rounding); each real
    change is refined by bisection to where the two times are equal.

    Returns:
        ``(n, slower_below, faster_from_n)`` for each change: from size ``n`` on,
        ``faster_from_n`` is the faster one (until the next change).
    """
    def diff(n: int) -> float:
        return a.predict(p, n) - b.predict(p, n)

    def state(n: int) -> int:
        ta, tb = a.predict(p, n), b.predict(p, n)
        if abs(ta - tb) <= tolerance * min(ta, tb):
            return 0
        return -1 if ta < tb else 1

    grid = sorted({int(round(v)) for v in np.geomspace(max(1, lo), hi, 2000)})
    out: list[tuple[int, str, str]] = []
    last_n, last_s = None, 0  # the last size with a clear winner, and who (-1: a, 1: b)
    for n in grid:
        st = state(n)
        if st == 0:
            continue
        if last_s and st != last_s:
            left, right = last_n, n  # diff changes sign in between
            while right - left > 1:
                mid = (left + right) // 2
                if (diff(mid) < 0) == (last_s < 0):
                    left = mid
                else:
                    right = mid
            winner, loser = (a.algorithm, b.algorithm) if st < 0 else (b.algorithm, a.algorithm)
            out.append((right, str(loser), str(winner)))
        last_n, last_s = n, st
    return out


def _ok(v) -> bool:
    return v is not None and math.isfinite(v) and v > 0


def smooth(values: Sequence[float | None]) -> list[float | None]:
    """Running median of three neighbouring sizes (ends kept): removes a spike at
    one size, of any height, and keeps trends and real crossings in place."""
    out = list(values)
    for i in range(1, len(values) - 1):
        if not _ok(values[i]):
            continue
        window = [v for v in values[i - 1:i + 2] if _ok(v)]
        out[i] = float(np.median(window))
    return out


def best_per_size(sizes: Sequence[int], times: Mapping[str, Sequence[float | None]],
                  tolerance: float = 0.05) -> list[str]:
    """The fastest algorithm at each size, robust to noise.

    Times are smoothed (:func:`smooth`), and the winner changes only when another
    algorithm is faster by more than ``tolerance`` (a fraction): within that,
    the two are a tie and the previous winner stays, so the table does not flip
    back and forth on noise.

    Args:
        sizes: message sizes, ascending.
        times: algorithm -> time at each size (None or non-finite: not measured).
    Raises:
        ValueError: a size where no algorithm has a time, or mismatched lengths.
    """
    names = list(times)
    for name in names:
        if len(times[name]) != len(sizes):
            raise ValueError(f"costmodel.best_per_size: {name} has {len(times[name])} times "
                             f"for {len(sizes)} sizes")
    sm = {a: smooth(times[a]) for a in names}
    winners: list[str] = []
    for i, n in enumerate(sizes):
        cands = [(sm[a][i], a) for a in names if _ok(sm[a][i])]
        if not cands:
            raise ValueError(f"costmodel.best_per_size: no algorithm has a time at {n} B")
        t_best, best = min(cands)
        prev = winners[-1] if winners else None
        if prev is not None and prev != best and _ok(sm[prev][i]) and \
                sm[prev][i] <= t_best * (1 + tolerance):
            best = prev
        winners.append(best)
    return winners


def tuning_rows(sizes: Sequence[int], times: Mapping[str, Sequence[float | None]],
                tolerance: float = 0.05) -> list[list]:
    """Tuning rows ``[[max_bytes, algorithm], ..., [None, algorithm]]`` for ringcomm's
    ``auto`` choice from measured times (first matching row wins).

    Where the winner changes between two measured sizes, the threshold is where the
    two time curves cross, interpolated linearly in log(size).

    Args:
        sizes: message sizes in the unit ``auto`` is asked with, ascending.
        times: algorithm -> time at each size (None: not measured).
        tolerance: see :func:`best_per_size`.
    """
    sizes = list(sizes)
    if sorted(sizes) != sizes or len(set(sizes)) != len(sizes):
        raise ValueError("costmodel.tuning_rows: sizes must be strictly ascending")
    winners = best_per_size(sizes, times, tolerance)
    sm = {a: smooth(times[a]) for a in times}
    rows: list[list] = []
    for i in range(len(sizes) - 1):
        a, b = winners[i], winners[i + 1]
        if a == b:
            continue
        s0, s1 = sizes[i], sizes[i + 1]
        ta0, ta1 = sm[a][i], sm[a][i + 1]
        tb0, tb1 = sm[b][i], sm[b][i + 1]
        frac = 0.0
        if all(_ok(v) for v in (ta0, ta1, tb0, tb1)):
            d0, d1 = ta0 - tb0, ta1 - tb1  # d0 <= 0 (a wins at s0), d1 >= 0
            if d1 != d0:
                frac = min(1.0, max(0.0, d0 / (d0 - d1)))
        if s0 > 0:
            cut = math.exp(math.log(s0) + frac * (math.log(s1) - math.log(s0)))
        else:
            cut = s0 + frac * (s1 - s0)
        max_bytes = int(min(s1 - 1, max(s0, math.floor(cut))))
        rows.append([max_bytes, a])
    rows.append([None, winners[-1]])
    return rows
