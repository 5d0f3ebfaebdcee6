"""The alpha-beta-gamma cost model of collective algorithms: the features counted
from the schedules, the fit to measured timings, predictions and crossovers.

No MPI and no torch process group: the structural features come from
ringcomm's schedule builders through :func:`ringcomm.execution.checker.check` (imported
on first use), the rest is numpy. The benchmark (:mod:`ringcomm.bench.analysis`)
uses it, and so can a notebook or a test.

The model of one algorithm of one collective is::

    T(p, n) = o + alpha * A(p, n) + beta * B(p, n) + gamma * G(p, n)

``p`` is the world size and ``n`` the message size in bytes as nccl-tests
reports it: the buffer for allreduce, broadcast and reduce; the whole gathered
buffer for allgather (p chunks of n/p); the whole input for reduce_scatter (p
chunks of n/p); one rank's send buffer for alltoall (n/p to each peer).
:func:`layout_for` turns ``n`` into the layout a schedule builder gets, with one
byte per element and the pipeline segment in bytes, so ``B`` and ``G`` come out
in bytes.

The features are counted from the algorithm's registered schedules
(``ringcomm.algorithms.REGISTRY``) run without data under NCCL's lockstep rules
(:func:`ringcomm.execution.checker.check` with ``symbolic=False``):

* ``A`` = ``Stats.rounds``: synchronous rounds with messages, the latency terms
  on the critical path (each pipeline segment is a message);
* ``B`` = ``Stats.busiest``: per round the largest in- or outflow of any rank,
  summed over rounds: the bytes that cross the busiest link one after another;
* ``G`` = ``Stats.reduced_max``: the most bytes any rank reduces.

So every registered builder has a model (``ring``, ``tree``,
``recursive_doubling``, and any added with ``ringcomm.register_algorithm``);
``native`` (MPI's own collective), ``auto`` and other libraries get the
black-box model ``o + beta * n``, fitted at the measured world size only.

``alpha`` is the cost of one message, ``beta`` the cost of one byte on a link
(1/bandwidth), ``gamma`` the cost of reducing one byte, ``o`` a per-call
overhead. With timings from one world size ``o`` and ``alpha`` cannot be told
apart (both scale with the call count only), so ``o`` is fitted only when the
samples span at least two world sizes; otherwise ``alpha`` absorbs it and
predictions for larger ``p`` are upper bounds for latency-bound sizes. At one
world size ``beta`` and ``gamma`` are not separable either (both grow with
``n``), so callers measure ``gamma`` directly (a local reduction) and pass it in.

Cost of the features. The checker is pure Python and walks every step of every
rank: a ring on p ranks has about 2p(p-1) steps, so one evaluation grows
quadratically with p (milliseconds on a few ranks, seconds on hundreds). Three
rules keep the number of evaluations small, and every evaluation is cached
(:func:`functools.lru_cache` on collective, algorithm, p, n, segment, and the
builder itself, so that a replaced registration is counted afresh):

* pipelining: above ``2 * p * segment`` bytes the features are the straight line
  through their exact values at ``p * segment`` and ``2 * p * segment`` (every
  chunk is then whole segments, and a pipelined schedule's counts grow by the
  same amount per segment; for ringcomm's builders this is exact at every
  multiple of ``p * segment``), so no evaluation simulates more than two
  segments per ring chunk;
* up to :data:`EXACT_RANKS` ranks every size below that is simulated;
* on more ranks only the anchor sizes are: 1, the segment size times the powers
  of :data:`ANCHOR_RATIO`, ``p * segment`` and ``2 * p * segment``; in between the
  features are interpolated linearly in ``n``. That is exact wherever the counts
  are linear in ``n`` (ringcomm's builders between segment boundaries, e.g. the
  ring up to ``p * segment``) and smooths the one-segment steps of pipelined
  schedules elsewhere. Checked on 16 ranks, where both can be computed, for
  ringcomm's builders above 256 B: exact at most sizes; the latency count up to
  18% low where a tree starts its second segment, and up to 43% low just above
  ``p * segment``, where every ring chunk gets a second segment and the ring's
  rounds double at once (the interpolation spreads that step up to
  ``2 * p * segment``, as the pipelining rule does for every later one). The
  ring/tree crossover on 64 ranks came out at the same size as with exact
  features for allreduce and 5% lower for broadcast. A curve on 64 ranks costs
  about eight simulations.

:func:`crossovers` scans a grid of a few points per octave and bisects only where
the faster algorithm changes. Of the tuning rows that ringcomm's ``auto`` follows,
the 2-rank ones come from measured times (:mod:`ringcomm.bench.tuning`), the
library's and those from 512 ranks on from this model (scripts/library_tuning.py,
and scripts/auto_at_scale.py with :func:`features_at`, which counts the features at
any world size without the anchors above).
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from typing import Callable, Iterable

import numpy as np

from ringcomm.sim.layouts import SIZED, layout_for

#: feature function: (p, n, segment_bytes) -> (A, B, G)
FeatureFn = Callable[[int, int, int], "tuple[float, float, float]"]

PARAMS = ("o", "alpha", "beta", "gamma")

#: world sizes up to this are simulated at every size (one evaluation: milliseconds)
EXACT_RANKS = 8
#: on more ranks, the segment size times the powers of this (and p*seg, 2*p*seg)
#: are simulated and the features interpolated in between
ANCHOR_RATIO = 16

#: collectives the checker can count (barrier has no message size)
_SIZED = SIZED


def _builder(collective: str, algorithm: str | None):
    """The registered schedule builder, or None (native, auto, other libraries,
    unknown names, an algorithm written for one world size, as MSCCL's are, or
    ringcomm not importable)."""
    if algorithm is None or collective not in _SIZED:
        return None
    try:
        from ringcomm.algorithms import REGISTRY, is_schedule
    except ImportError:  # pragma: no cover - ringcomm is this repository
        return None
    build = REGISTRY.get(collective, {}).get(algorithm)
    if build is None or not is_schedule(build) or not callable(build):
        return None
    if getattr(build, "fixed_world_size", None) is not None:  # ringcomm.msccl
        return None
    return build


@functools.lru_cache(maxsize=1 << 14)
def _simulate(collective: str, algorithm: str, p: int, n: int, seg: int,
              build: Callable) -> tuple[float, float, float]:
    # ``build`` is part of the key so that a replaced registration is not served
    # the old builder's counts.
    from ringcomm.execution import checker

    st = checker.check(build, collective, p, layout_for(collective, p, n), seg=seg,
                       symbolic=False)
    return float(st.rounds), float(st.busiest), float(st.reduced_max)


def _anchors(seg: int, u: int) -> list[int]:
    """Sizes simulated on many ranks: 1, the segment size times the powers of
    ANCHOR_RATIO (so that the segment size, where pipelined schedules start
    cutting messages, is one), up to ``u``; then ``u`` and ``2u``."""
    out = {1}
    a = seg
    while a >= 1:
        out.add(int(a))
        a /= ANCHOR_RATIO
    a = seg * ANCHOR_RATIO
    while a < u:
        out.add(a)
        a *= ANCHOR_RATIO
    return sorted(x for x in out if x < u) + [u, 2 * u]


def _lerp(fa, fb, t: float) -> tuple[float, float, float]:
    return tuple(x + (y - x) * t for x, y in zip(fa, fb))


def _features(collective: str, algorithm: str, build: Callable, p: int, n: int,
              seg: int) -> tuple[float, float, float]:
    p, n, seg = int(p), int(n), int(seg)
    if p < 1 or seg < 1 or n < 0:
        raise ValueError(f"cost model: need p >= 1, n >= 0 and a positive segment, got "
                         f"p={p}, n={n}, segment={seg}")

    def sim(m: int):
        return _simulate(collective, algorithm, p, m, seg, build)

    u = p * seg  # every chunk one whole segment
    if n > 2 * u:  # pipelined: linear in the number of segments
        return _lerp(sim(u), sim(2 * u), (n - u) / u)
    if p <= EXACT_RANKS or n == 0:
        return sim(n)
    anchors = _anchors(seg, u)
    i = bisect.bisect_left(anchors, n)
    if anchors[i] == n:
        return sim(n)
    a, b = anchors[i - 1], anchors[i]
    return _lerp(sim(a), sim(b), (n - a) / (b - a))


def _effective(p: int, n: int, seg: int):
    """A black box (another library's collective): one latency plus n bytes."""
    return 1.0, float(n), 0.0


#: collective -> whether its algorithms reduce (have a gamma term)
REDUCING = {"allreduce": True, "reduce_scatter": True, "reduce": True, "broadcast": False,
            "allgather": False, "alltoall": False, "gather": False, "scatter": False}


def features_for(collective: str, algorithm: str | None) -> FeatureFn:
    """The feature function ``(p, n, segment_bytes) -> (A, B, G)`` of ``algorithm``
    for ``collective``, counted from its registered schedules (see the module
    docstring); the black-box model (``o + beta * n``) for ``None`` or an algorithm
    without schedules (``native``, ``auto``, other libraries).

    The builder is looked up when the function is called, so an algorithm
    registered (or replaced) later is modelled as it is then.
    """
    if _builder(collective, algorithm) is None:
        return _effective

    def fn(p: int, n: int, seg: int) -> tuple[float, float, float]:
        build = _builder(collective, algorithm)
        if build is None:
            raise ValueError(f"cost model: {collective} algorithm {algorithm!r} is no longer "
                             "registered")
        return _features(collective, str(algorithm), build, p, n, seg)

    fn.__name__ = f"features_{collective}_{algorithm}"
    return fn


def ring_allreduce(p: int, n: int, seg: int) -> tuple[float, float, float]:
    """The built-in ring allreduce's features in closed form: ``2(p-1)`` steps of
    every chunk's ``k`` segments (``k`` = the longest chunk, ``ceil(n/p)``, in
    segments) are the rounds; the busiest rank moves the longest chunk twice per
    step; a rank reduces every chunk but the one left of it. Rounds and reduced bytes
    equal the simulation's everywhere; the bytes do where the chunks are whole
    segments or equal (every power-of-two size on a power-of-two world), and are up
    to a few percent low elsewhere, where ranks a step apart share a round
    (tests/test_costmodel.py)."""
    if p == 1 or n == 0:
        return 0.0, 0.0, 0.0
    chunk = -(-n // p)
    k = -(-chunk // seg)
    return float(2 * (p - 1) * k), float(2 * (p - 1) * chunk), float(n - n // p)


def rabenseifner_allreduce(p: int, n: int, seg: int) -> tuple[float, float, float]:
    """The library's Rabenseifner allreduce in closed form, on a power-of-two ``p``
    dividing ``n`` (every block whole): step k of the halving and of the doubling
    moves ``n / 2^k`` in its segments; the busiest rank sends and receives all but
    its own block twice; it reduces all but its own block. Equal to the simulation
    there (tests/test_costmodel.py).

    Raises:
        ValueError: ``p`` is not a power of two or does not divide ``n``.
    """
    if p & (p - 1) or n % p:
        raise ValueError(f"cost model: rabenseifner in closed form needs a power-of-two p "
                         f"dividing n, got p={p}, n={n}")
    if p == 1 or n == 0:
        return 0.0, 0.0, 0.0
    rounds = 2 * sum(-(-(n >> k) // seg) for k in range(1, p.bit_length()))
    return float(rounds), float(2 * (n - n // p)), float(n - n // p)


def hierarchical_allreduce(p: int, n: int, seg: int, per_host: int
                           ) -> tuple[float, float, float]:
    """The library's registered hierarchical allreduce on ``p / per_host`` hosts of
    ``per_host`` ranks, by its phases one after another: a tree reduce within each
    host, the leaders' allreduce (:func:`ringcomm.library.hierarchical.leaders_algorithm`),
    a tree broadcast within each host. Their features add (each phase starts
    once the one before has ended on every host): equal to the simulation on 64 to
    1,024 ranks (tests/test_costmodel.py), in a fraction of its time: at 16,384 ranks
    the leaders' ring alone holds 8.4 million steps."""
    from ringcomm.library import hierarchical

    hosts = p // per_host
    reduce = _phase("reduce", "tree", per_host, n, seg)
    bcast = _phase("broadcast", "tree", per_host, n, seg)
    # the builder's elements are the model's bytes
    inter = features_at(hierarchical.leaders_algorithm(hosts, n), hosts, n, seg)
    return (reduce[0] + inter[0] + bcast[0], reduce[1] + inter[1] + bcast[1],
            reduce[2] + inter[2])


@functools.lru_cache(maxsize=1 << 10)
def _phase(collective: str, algorithm: str, p: int, n: int, seg: int
           ) -> tuple[float, float, float]:
    from ringcomm.algorithms import REGISTRY
    from ringcomm.execution import checker

    st = checker.check(REGISTRY[collective][algorithm], collective, p, (int(n),), seg=seg,
                       symbolic=False)
    return float(st.rounds), float(st.busiest), float(st.reduced_max)


#: world sizes above which :func:`features_at` composes hierarchical's phases
#: (:func:`hierarchical_allreduce`) instead of simulating it
COMPOSED_FROM = 1024
#: allreduce algorithms whose features :func:`features_at` extends in a straight line
#: in the number of segments: one pipeline of segments through fixed trees, name ->
#: ``k``: the line through ``k`` and ``2k`` segments, above ``2k``. A tree's pipeline
#: fills for about its depth in segments before each adds the same (double_tree's
#: bytes: 1.5 segments a segment from 2 to 4, 2.0 from 32 on); recursive doubling
#: sends the whole buffer every step (tests/test_costmodel.py checks the lines
#: against simulations). Not hierarchical: its leaders' ring adds a segment a chunk
#: at every multiple of leaders x segment
PIPELINED = {"tree": 32, "double_tree": 32, "recursive_doubling": 2}


def features_at(algorithm: str, p: int, n: int, seg: int,
                hosts: tuple = ()) -> tuple[float, float, float]:
    """An allreduce algorithm's features ``(A, B, G)`` at any world size, for
    ``auto``'s picks at scale (scripts/auto_at_scale.py), with the ranks on
    ``hosts`` (:class:`ringcomm.schedule.Context`). Unlike :func:`features_for`,
    whose anchors at ``p * segment`` bytes hold a ring's ``2p(p-1)`` steps and a
    tree's ``p`` segments: the built-in ring in closed form
    (:func:`ring_allreduce`); the algorithms of :data:`PIPELINED` simulated up to
    their line's end and on the line above; any other (the
    recursive halving of ``rabenseifner``, whose segments per step change at every
    power of two) simulated at ``n`` itself. Simulations are cached as
    :func:`features_for`'s are. Rabenseifner's on a power-of-two world dividing the
    size, in closed form (:func:`rabenseifner_allreduce`); hierarchical's above
    :data:`COMPOSED_FROM` ranks with equal hosts, by phases
    (:func:`hierarchical_allreduce`).

    Raises:
        ValueError: an algorithm without registered allreduce schedules.
    """
    build = _builder("allreduce", algorithm)
    if build is None:
        raise ValueError(f"cost model: allreduce algorithm {algorithm!r} has no schedules")
    from ringcomm.algorithms import ring

    if build is ring.allreduce:
        return ring_allreduce(p, n, seg)
    from ringcomm.library import hierarchical, rabenseifner

    if build is rabenseifner.allreduce and not p & (p - 1) and n % p == 0:
        return rabenseifner_allreduce(p, n, seg)
    hosts = tuple(hosts)
    per_host = len(hosts) // len(set(hosts)) if hosts else p
    if (build is hierarchical.allreduce and p > COMPOSED_FROM and hosts
            and hosts == tuple(r // per_host for r in range(p))):
        return hierarchical_allreduce(p, n, seg, per_host)

    def sim(m: int) -> tuple[float, float, float]:
        return _simulate_hosts(algorithm, p, m, seg, hosts, build)

    k = PIPELINED.get(algorithm)
    if k is not None and n > 2 * k * seg:
        lo, hi = k * seg, 2 * k * seg
        return _lerp(sim(lo), sim(hi), (n - lo) / (hi - lo))
    return sim(n)


@functools.lru_cache(maxsize=1 << 12)
def _simulate_hosts(algorithm: str, p: int, n: int, seg: int, hosts: tuple,
                    build: Callable) -> tuple[float, float, float]:
    from ringcomm.execution import checker

    st = checker.check(build, "allreduce", p, (int(n),), seg=seg, symbolic=False,
                       hosts=hosts)
    return float(st.rounds), float(st.busiest), float(st.reduced_max)


def has_model(collective: str, algorithm: str | None) -> bool:
    """True when ``algorithm`` has a structural model, i.e. registered schedules (so
    it can be extrapolated in p)."""
    return _builder(collective, algorithm) is not None


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
        """Modelled time (s) of one call on ``p`` ranks with message size ``n`` (bytes,
        as nccl-tests counts them; see :func:`layout_for`)."""
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
        ValueError: fewer than two usable samples, a bad segment size, or schedules
            the checker refuses (:class:`ringcomm.schedule.ScheduleError`).
    """
    if segment_bytes <= 0:
        raise ValueError(f"cost model fit: segment_bytes must be positive, got {segment_bytes}")
    pts = [(int(p), int(n), float(t)) for p, n, t in samples
           if t is not None and math.isfinite(float(t)) and float(t) > 0]
    if len(pts) < 2:
        raise ValueError(f"cost model fit {collective}/{algorithm}: need at least two timings, "
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
               tolerance: float = 0.02, points_per_octave: int = 4) -> list[tuple[int, str, str]]:
    """Sizes where the faster of two fitted algorithms changes, on ``p`` ranks.

    Scans ``[lo, hi]`` on a log grid of ``points_per_octave`` sizes per octave and
    bisects only between grid points where the winner changes, so the features are
    evaluated at a few hundred sizes at most (and on many ranks mostly
    interpolated, see the module docstring). Sizes where the two are within
    ``tolerance`` of each other are ties and do not count as a change (two models
    of near-identical algorithms would otherwise "cross" on rounding); each real
    change is refined by bisection to where the two times are equal. Two changes
    closer together than one grid step may be missed.

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

    lo = max(1, int(lo))
    octaves = max(1.0, math.log2(max(hi, lo + 1) / lo))
    count = int(math.ceil(octaves * max(1, points_per_octave))) + 1
    grid = sorted({int(round(v)) for v in np.geomspace(lo, max(hi, lo + 1), count)})
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
