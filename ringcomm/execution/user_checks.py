"""A user's schedule builder, proven before its first use on each call shape
(:func:`check_user_schedule`): at the group's size for structure, matching and
deadlock; for the contents at the real shape, or a proportionally smaller one, as
far as ``RINGCOMM_CHECK_BUDGET_S`` allows."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Callable

from ringcomm import settings
from ringcomm.execution.checker import check
from ringcomm.execution.findings import finding_of, refusal, short_layout
from ringcomm.schedule import Context, Schedule, ScheduleError, ShapeNotServed

#: a user's schedule is checked symbolically at its real shape up to this many
#: elements over all ranks, at a proportionally smaller shape above it
CHECK_ELEMENTS = 1 << 18
#: up to this many ranks the first-use check is one proof, structure and contents
#: together; above, the structure first, which also times what a proof costs
ONE_PASS_RANKS = 64
#: a proof of the contents costs about this many times the structural check of the
#: same size (it builds every rank's schedule again, then moves contents)
CONTENTS_COST = 1.5
#: the smallest size a budget's fallback proves, whatever its cost
LADDER_FLOOR = 8

log = logging.getLogger("ringcomm")


class AlgorithmFailed(RuntimeError):
    """A user's schedule builder raised (not a wrong schedule: an exception)."""


@dataclasses.dataclass(frozen=True)
class Proof:
    """What a first-use check proved: the structure at the group's ``size``, the
    contents at ``proven`` ranks (``size`` unless the budget ran out; 0: at none)."""
    size: int
    proven: int
    seconds: float


def check_user_schedule(build: Callable, ctx: Context, name: str,
                        budget_s: float | None = None) -> Schedule:
    """Check a user's builder for this call shape and return this rank's schedule,
    the very one that was checked (every rank checks the same, so every rank
    refuses a wrong schedule alike).

    At the group's size: bounds, matching and freedom from deadlock always; the
    contents too when the proof fits ``budget_s`` (``RINGCOMM_CHECK_BUDGET_S``), up to
    ``CHECK_ELEMENTS`` elements over all ranks at the real shape, at a proportionally
    smaller shape with the same number of segments per chunk above it. When it does
    not fit (a 4,096-rank ring's would take minutes), the contents are proven at the
    largest of ``p/2, p/4, ...`` down to 8 ranks whose estimated cost fits (the
    smallest, 8 to 15 ranks, whatever its cost), and rank 0 warns naming that size.
    :data:`LAST_PROOF` keeps what was proven.

    Raises:
        ScheduleError: (a ValueError) naming the algorithm, step and element at fault.
        AlgorithmFailed: the builder raised, for some rank's view of this call (every
            rank builds every rank's schedule, so every rank raises alike).
    """
    budget = settings.get("RINGCOMM_CHECK_BUDGET_S") if budget_s is None else budget_s
    start = time.monotonic()
    coll, p, r = ctx.collective, ctx.size, ctx.rank
    layout = _global_layout(ctx)
    mine: list[Schedule] = []
    keep = (lambda s: mine.append(s) if s.ctx.rank == r else None)
    with _named(name, coll, p, layout):
        if p <= ONE_PASS_RANKS:
            _prove(build, ctx, layout, p, keep, structure=True)
            proven = p
        else:
            check(build, coll, p, layout, root=ctx.root, seg=ctx.seg, symbolic=False,
                  on_built=keep, hosts=ctx.hosts)
            structure_s = time.monotonic() - start
            proven = _prove_within(build, ctx, layout, structure_s,
                                   budget - structure_s)
    LAST_PROOF[(name, coll, p)] = proof = Proof(p, proven, time.monotonic() - start)
    if proven < p and r == 0:
        log.warning("ringcomm: algorithm %r (%s on %d ranks): its contents were proven %s, "
                    "not at %d: a proof at %d ranks would not fit "
                    "RINGCOMM_CHECK_BUDGET_S=%g s; its structure (sizes, matching, no "
                    "deadlock) was checked at %d ranks (%.1f s in all)", name, coll, p,
                    f"at {proven} ranks" if proven else "at no size (it serves no smaller "
                    "one)", p, p, budget, p, proof.seconds)
    return mine[0]


#: (algorithm, collective, size) -> the :class:`Proof` of its latest first-use check
LAST_PROOF: dict[tuple[str, str, int], Proof] = {}


def _global_layout(ctx: Context) -> tuple:
    """The global layout the checker needs: every rank's view. Where a rank knows only
    its own sizes (gather/scatter non-roots, alltoall) a consistent global layout
    stands in; this rank's part of it is exactly its own layout."""
    coll, p, r, lay = ctx.collective, ctx.size, ctx.rank, ctx.layout
    if coll in ("gather", "scatter"):
        own = lay[r]
        return tuple(own if c is None else c for c in lay)
    if coll == "alltoall":
        sends, recvs = lay
        if len(set(sends) | set(recvs)) == 1:  # even splits: every rank's are (all_to_all_single)
            return tuple((sends[0],) * p for _ in range(p))
        return tuple(tuple(sends[j] if i == r else recvs[i] if j == r else 1
                           for j in range(p)) for i in range(p))
    return lay


def _prove(build: Callable, ctx: Context, layout: tuple, q: int,
           on_built: Callable | None = None, structure: bool = False) -> None:
    """The contents proof at ``q`` ranks (fewer than ``ctx.size``: the call shape cut
    down to ``q`` ranks), at the real shape up to ``CHECK_ELEMENTS`` elements, scaled
    down above; with ``structure``, also the structure at the real shape."""
    coll, p = ctx.collective, ctx.size
    if q < p:
        layout = _cut(coll, layout, q, p)
    root, hosts = (ctx.root if ctx.root < q else q - 1), tuple(ctx.hosts[:q])
    total = sum(_leaves(layout)) * max(q, 1)
    small = total <= CHECK_ELEMENTS
    if structure or small:
        check(build, coll, q, layout, root=root, seg=ctx.seg, symbolic=small,
              on_built=on_built, hosts=hosts)
    if not small:  # same segments per chunk, fewer elements
        f = -(-total // CHECK_ELEMENTS)
        check(build, coll, q, _scaled(layout, f), root=root, seg=max(1, ctx.seg // f),
              hosts=hosts)


def _prove_within(build: Callable, ctx: Context, layout: tuple, structure_s: float,
                  left_s: float) -> int:
    """Prove the contents at the group's size if its estimated cost fits ``left_s``,
    else at the largest of p/2, p/4, ... that fits (cost taken as linear in the
    ranks, which over-estimates the smaller sizes of algorithms whose steps grow
    with p); returns the size proven (0: none served)."""
    p = ctx.size
    sizes = [p]
    while sizes[-1] // 2 >= LADDER_FLOOR:
        sizes.append(sizes[-1] // 2)
    for q in sizes:
        if q != sizes[-1] and CONTENTS_COST * structure_s * q / p > left_s:
            continue  # the last rung (8 to 15 ranks) is proven whatever the budget
        try:
            _prove(build, ctx, layout, q)
        except ShapeNotServed:
            if q == p:
                raise
            continue  # the builder serves some sizes only: try a smaller one
        return q
    return 0


def _cut(collective: str, layout: tuple, q: int, p: int) -> tuple:
    """A ``p``-rank call shape cut down to ``q`` ranks: per-rank sizes of the first
    ``q`` ranks; a whole-buffer size scaled to keep the elements per rank."""
    if collective == "alltoall":
        return tuple(tuple(row[:q]) for row in layout[:q])
    if collective in ("allreduce", "broadcast", "reduce", "barrier"):
        return (max(1, -(-layout[0] * q // p)),) if layout[0] else layout
    return tuple(layout[:q])


@contextlib.contextmanager
def _named(name: str, coll: str, p: int, layout: tuple):
    """A refusal or a builder's error, named with the algorithm and the call."""
    try:
        yield
    except ShapeNotServed as e:
        raise ShapeNotServed(f"ringcomm: algorithm {name!r} does not serve this call "
                             f"({coll} on {p} ranks, layout {short_layout(layout)}): {e}") from None
    except ScheduleError as e:
        raise refusal(f"ringcomm: algorithm {name!r} is wrong: {e}", finding_of(e)) from None
    except Exception as e:  # noqa: BLE001 - a user's code may raise anything
        raise AlgorithmFailed(f"algorithm {name!r} raised {type(e).__name__}: {e} while "
                              f"building its {coll} schedule for {p} ranks, layout "
                              f"{layout}") from e


def _leaves(layout) -> list[int]:
    out = []
    for x in layout:
        if isinstance(x, tuple):
            out.extend(_leaves(x))
        elif x is not None:
            out.append(x)
    return out


def _scaled(layout, f: int):
    return tuple(_scaled(x, f) if isinstance(x, tuple) else -(-x // f) for x in layout)
