"""Check a schedule builder without running it (in the spirit of MSCCLang's ``Check()``).

For one call shape, :func:`check` builds every rank's schedule and proves:

* every region lies inside a buffer that exists on that rank, and a step never
  receives into memory it sends from or receives into twice;
* the steps run to the end under NCCL's group rules (:mod:`ringcomm.execution.nccl_rules`):
  every send has a receive of the same size on the peer, and no cycle of steps
  waits on itself;
* a symbolic run ends with the right contents: every element carries the
  identity of the input element it came from and the set of ranks that
  contributed to it, so a reduction that mixes different elements, counts a
  rank twice or misses one, or a copy from the wrong place, is named with the
  rank, buffer, element and step.

It also counts what the cost model needs (:class:`Stats`). A refusal is a
:class:`~ringcomm.schedule.ScheduleError` whose message names what is wrong, and
which carries the same facts as data (:class:`Finding`, :func:`finding_of`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Callable

from ringcomm.execution.contents import Contents, RankSets
from ringcomm.execution.findings import KINDS, Finding, finding_of, refusal, short_layout
from ringcomm.execution.plan import compile_steps
from ringcomm.execution.structure import validate
from ringcomm.execution.world import SEND, World
from ringcomm.schedule import BuildFn, Context, Schedule, ScheduleError, buffer_lengths

__all__ = ["check", "world_of", "compiled_rank", "schedules", "shapes", "local_layout", "Stats", "Finding", "KINDS",
           "finding_of", "validate", "RankSets", "ROOTED"]

@dataclasses.dataclass
class Stats:
    """What one call costs, counted from the schedules under NCCL's rules.

    Attributes:
        rounds: synchronous rounds with messages (latency terms on the critical path).
        busiest: elements moved one after another by the busiest rank: per round, the
            largest in- or outflow of any rank, summed over rounds.
        sent_max: most elements any rank sends in total.
        reduced_max: most elements any rank reduces locally.
        steps_max: most steps in any rank's schedule.
        messages: sends over all ranks.
    """
    rounds: int
    busiest: int
    sent_max: int
    reduced_max: int
    steps_max: int
    messages: int


def local_layout(collective: str, layout: tuple, rank: int, root: int) -> tuple:
    """What ``rank`` knows of a global ``layout`` (gather and scatter non-roots know
    only their own count)."""
    if collective in ("gather", "scatter") and rank != root:
        return tuple(c if i == rank else None for i, c in enumerate(layout))
    if collective == "alltoall":
        # global layout: matrix[i][j] = elements rank i sends to rank j
        return (tuple(layout[rank]), tuple(row[rank] for row in layout))
    return tuple(layout)


def schedules(build: BuildFn, collective: str, size: int, layout: tuple, root: int = 0,
              seg: int = 1 << 30, hosts: tuple = (), *, itemsize: int = 4) -> list[Schedule]:
    """Every rank's schedule for a global ``layout`` (``hosts``, ``itemsize``: see
    :class:`ringcomm.schedule.Context`)."""
    return [_built(build, Context(collective, size, r, local_layout(collective, layout, r, root),
                                  root, seg, tuple(hosts), itemsize)) for r in range(size)]


def _built(build: BuildFn, ctx: Context) -> Schedule:
    s = build(ctx)
    if not isinstance(s, Schedule):
        raise refusal(f"{ctx.collective} builder returned {type(s).__name__} on rank "
                       f"{ctx.rank}, expected a ringcomm.schedule.Schedule",
                       Finding("builder", rank=ctx.rank))
    return s


def check(build: BuildFn, collective: str, size: int, layout: tuple, *, root: int = 0,
          seg: int = 1 << 30, symbolic: bool = True,
          on_built: Callable[[Schedule], None] | None = None, hosts: tuple = ()) -> Stats:
    """Prove ``build`` right for one call shape, and count its cost.

    Every rank's schedule is built, checked and compiled in turn, then dropped, so
    memory holds arrays of every rank's steps, not their Python objects.

    Args:
        build: the schedule builder.
        collective: which collective it implements.
        size: world size (any: contributions are sets of ranks of any size).
        layout: the global layout: as :data:`ringcomm.schedule.BUFFERS` says, except
            alltoall, which takes the matrix ``layout[i][j]`` = elements rank i sends to j.
        root: root rank of rooted collectives.
        seg: elements per pipeline segment.
        symbolic: also track contents (False: structure, matching and counts only).
        on_built: called with each rank's schedule as it is built (so that a caller
            keeps exactly what was checked).
        hosts: the host of every rank (:class:`ringcomm.schedule.Context`); empty: one host.
    Raises:
        ScheduleError: the schedule is malformed, deadlocks, or computes a wrong result;
            the message names the rank, step and element, and the error carries them
            as data (:func:`finding_of`).
    """
    with _paused_gc():
        return _check(build, collective, size, layout, root, seg, symbolic, on_built, hosts)


@contextlib.contextmanager
def _paused_gc():
    """Python's cycle collector paused: a proof allocates millions of small tuples
    that reference counting frees, and each collection rescans them all (it tripled
    a 512-rank ring's build time)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def compiled_rank(build: BuildFn, collective: str, size: int, rank: int, layout: tuple,
                  root: int = 0, seg: int = 1 << 30, hosts: tuple = (), *, itemsize: int = 4
                  ) -> tuple[Schedule, tuple[list, list]]:
    """``rank``'s schedule for a global ``layout``, checked for bounds
    (:func:`validate`), and its compiled ``(regions, steps)``
    (:func:`ringcomm.execution.plan.compile_steps`)."""
    s = _built(build, Context(collective, size, rank, local_layout(collective, layout, rank, root),
                              root, seg, tuple(hosts), itemsize))
    validate(s)
    return s, compile_steps(s, [*buffer_lengths(s.ctx), *s.scratch])


def world_of(build: BuildFn, collective: str, size: int, layout: tuple, root: int = 0,
             seg: int = 1 << 30, hosts: tuple = (),
             on_built: Callable[[Schedule], None] | None = None, *, itemsize: int = 4
             ) -> tuple[World, list]:
    """Every rank's compiled steps in one :class:`~ringcomm.execution.world.World`, not
    yet run, and per rank its buffer lengths ``(caller buffers, scratch)``. Each rank's
    schedule is built, checked for bounds and compiled in turn, then dropped.

    Raises:
        ScheduleError: a builder's or the bounds check's refusal, or a message to a
            peer that is no other rank (with its :class:`Finding`).
    """
    shapes: list[tuple[list, list]] = []  # per rank: caller buffer lengths, scratch

    def compiled():
        for r in range(size):
            s, steps = compiled_rank(build, collective, size, r, layout, root, seg, hosts,
                                     itemsize=itemsize)
            if on_built is not None:
                on_built(s)
            shapes.append(([n or 0 for n in buffer_lengths(s.ctx)], list(s.scratch)))
            yield steps

    try:
        return World(compiled(), size), shapes
    except ScheduleError as e:
        if not hasattr(e, "bad_peer"):  # the builder's or validate's own
            raise
        r, i, peer = e.bad_peer  # a peer that is no other rank
        raise refusal(str(e), Finding("peer", rank=r, step=i, peer=peer)) from None


def _check(build, collective, size, layout, root, seg, symbolic, on_built, hosts) -> Stats:
    world, shapes = world_of(build, collective, size, layout, root, seg, hosts, on_built)
    contents = Contents(world, shapes, collective, layout, root) if symbolic else None
    try:
        counts = world.run(contents and contents.local, contents and contents.messages)
    except ScheduleError as e:  # the world's refusal, or the contents' (with its finding)
        raise refusal(f"{collective} on {size} ranks, layout {short_layout(layout)}: {e}",
                       finding_of(e) or _world_finding(e)) from None
    if symbolic and collective == "barrier":
        contents.check_barrier()
    if symbolic:
        contents.check_results(layout)
    return Stats(rounds=counts.rounds, busiest=counts.busiest, sent_max=int(counts.sent.max()),
                 reduced_max=int(world.reduced.max()), steps_max=int(world.steps.max()),
                 messages=int((world.m_kind == SEND).sum()))


def _world_finding(err: ScheduleError) -> Finding | None:
    """The finding of the world's refusal: a size mismatch, or, when nothing can
    move, its messages without partners (at most 4) or else its cycle of waits."""
    if getattr(err, "mismatch", None) is not None:
        rank, step, peer, peer_step = err.mismatch
        return Finding("size mismatch", rank=rank, step=step, peer=peer, peer_step=peer_step)
    orphans, cycle = getattr(err, "stuck", ([], []))
    entries = ([Finding("unmatched", rank=r, step=i, peer=q) for r, i, _, _, q in orphans[:4]]
               or [Finding("deadlock", rank=r, step=i, peer=q, peer_step=j)
                   for r, i, _, _, q, j in cycle])
    return dataclasses.replace(entries[0], more=tuple(entries[1:])) if entries else \
        Finding("deadlock")


ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})


def shapes(collective: str, p: int, k: int):
    """Layouts with about ``k`` segments per chunk: even, uneven, with empty chunks."""
    seg = 3
    if collective in ("broadcast", "reduce"):  # the whole buffer is the one chunk
        return [((seg * k,), seg), ((seg * k - 1,), seg), ((1,), seg)]
    if collective == "allreduce":  # p chunks (the ring's); a tree pipelines all of them
        n = p * seg * k
        return [((n,), seg), ((n + p - 1,), seg), ((max(p - 1, 0),), seg)]
    if collective == "barrier":
        return [((1,), seg)]
    if collective == "alltoall":
        even = tuple(tuple(seg * k for _ in range(p)) for _ in range(p))
        uneven = tuple(tuple((i + 2 * j) % 4 * k for j in range(p)) for i in range(p))
        return [(even, seg), (uneven, seg)]
    even = tuple(seg * k for _ in range(p))
    uneven = tuple(seg * k + (i % 3) - 1 if i % 4 else 0 for i in range(p))
    return [(even, seg), (uneven, seg)]
