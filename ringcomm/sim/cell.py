"""One simulated call: an algorithm's schedules (proven first), timed on a topology.

:func:`simulate` is what ``python -m ringcomm.sim`` runs for every (algorithm,
size) cell: it proves the algorithm with the checker on a few ranks (a refusal is
reported instead of a time), picks the program source (every rank's schedule, or
rank 0's rotated where the ranks are alike and every rank's would cost too much),
and times it with :func:`ringcomm.sim.engine.run` within a time budget.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

from ringcomm.execution import checker
from ringcomm.execution.plan import compile_steps, dependencies
from ringcomm.schedule import ScheduleError, ShapeNotServed, buffer_lengths
from ringcomm.sim import costs as _costs
from ringcomm.sim.engine import PARTS, OutOfTime, run, run_rounds
from ringcomm.sim.layouts import layout_for
from ringcomm.sim.network import Network
from ringcomm.sim.program import (FullProgram, MpiProgram, NotRotation, RotatedProgram,
                                  same_rotation, sample_ranks, skeleton)
from ringcomm.sim.topology import Topology

#: the contents are proven on at most this many ranks (the structure, matching and
#: freedom from deadlock at the full size, by the timing itself)
PROOF_RANKS = 16
#: every rank's schedule is built when all ranks' messages are at most this many,
#: or when the ranks are not rotations of rank 0; above it, rank 0's rotated
FULL_MESSAGES = 200_000
#: and never above this many (the build alone would take minutes)
FULL_LIMIT = 4_000_000
#: a program of more messages than this is timed round by round
#: (:func:`ringcomm.sim.engine.run_rounds`), not event by event: a rotated one (whose
#: rounds are exact where its ranks move in lockstep), and every rank's (whose rounds
#: are an approximation where messages of different rounds overlap: below this many,
#: the exact events cost seconds at most)
EVENT_MESSAGES = {"rotated": 1_000_000, "full": 20_000, "mpi": 1 << 62}


@dataclasses.dataclass
class Result:
    """One simulated cell. ``refused`` says why there is no time (the checker's
    refusal, or the budget), and then the times are None.

    Attributes:
        seconds: the call's time.
        critical: the last rank's critical path, seconds per part (latency,
            bandwidth, local, software).
        busiest_link, busiest_bytes, busiest_utilisation: the link with the most
            busy time, what crossed it, and its busy share of the call.
        source: how the ranks' schedules were had ("every rank's", or "rank 0's
            rotated, 14 ranks sampled").
        engine: ``"events"`` or ``"rounds"``.
        proven: the ranks the contents were proven on.
        events, messages, sim_seconds: what the simulation handled and took.
    """
    collective: str
    algorithm: str
    ranks: int
    nbytes: int
    seconds: float | None = None
    critical: dict | None = None
    busiest_link: str | None = None
    busiest_bytes: float | None = None
    busiest_utilisation: float | None = None
    source: str = ""
    engine: str = ""
    proven: int = 0
    events: int = 0
    messages: int = 0
    sim_seconds: float = 0.0
    refused: str | None = None

    def shares(self) -> dict:
        """The critical path's parts as shares of the call's time."""
        total = sum(self.critical.values()) if self.critical else 0.0
        return {k: (v / total if total else 0.0) for k, v in (self.critical or {}).items()}


def network(topo: Topology) -> Network:
    """One :class:`Network` per topology (its routes are kept between calls)."""
    net = topo.__dict__.get("_network")
    if net is None:
        net = topo.__dict__["_network"] = Network(topo)
    return net


@functools.lru_cache(maxsize=256)
def _proof(build: Callable, collective: str, q: int, hosts: tuple) -> None:
    """The checker's shapes (even, uneven, empty chunks) that ``build`` serves; an
    algorithm written for some counts only (an MSCCL file's multiples of its chunks)
    is proven on those it takes, and refused when it takes none."""
    not_served, proven = None, 0
    for layout, seg in checker.shapes(collective, q, 2):
        try:
            checker.check(build, collective, q, layout, seg=seg, hosts=hosts)
            proven += 1
        except ShapeNotServed as e:
            not_served = e
    if not proven:
        raise not_served


def prove(build: Callable, collective: str, topo: Topology) -> int:
    """Prove ``build`` with the checker on up to :data:`PROOF_RANKS` ranks of
    ``topo`` (its first ranks, on their hosts); the ranks proven.

    Raises:
        ScheduleError: the checker's refusal.
    """
    q = min(topo.size, PROOF_RANKS)
    hosts = tuple(topo.rank_host[:q]) if len(set(topo.rank_host[:q])) > 1 else ()
    _proof(build, collective, q, hosts)
    return q


def program_for(build: Callable, collective: str, topo: Topology, layout: tuple, root: int,
                seg: int, mode: str = "auto", order: str = "nccl", itemsize: int = 4):
    """The program to time, and how it was had (see the module docstring).

    ``mode``: ``"auto"``, ``"full"`` (every rank's schedule) or ``"rotated"``.
    ``order``: ``"nccl"`` (a step's messages one group: what runs on GPUs) or
    ``"mpi"`` (ringcomm's point-to-point executor, on CPUs: every rank's schedule).
    ``itemsize``: the element's bytes, as the planner tells builders.

    Raises:
        ScheduleError: a schedule is refused (bounds, peers, matching).
        OutOfTime: every rank's schedule would be too many messages, and the ranks
            are not rotations of rank 0.
    """
    p = topo.size
    hosts = topo.host_numbers()
    if order == "mpi":
        return mpi_program(build, collective, topo, layout, root, seg, itemsize), \
            "every rank's, in MPI's order"
    _, steps0 = checker.compiled_rank(build, collective, p, 0, layout, root, seg, hosts,
                                      itemsize=itemsize)
    base = skeleton(0, p, steps0)
    estimate = len(base.kind) * p
    why = ""
    if mode == "rotated" or (mode == "auto" and estimate > FULL_MESSAGES):
        try:
            picks = sample_ranks(p)
            for r in picks:
                _, steps = checker.compiled_rank(build, collective, p, r, layout, root, seg,
                                                 hosts, itemsize=itemsize)
                same_rotation(base, skeleton(r, p, steps), r)
            return RotatedProgram(p, base), f"rank 0's rotated, {len(picks)} ranks sampled"
        except NotRotation as e:
            if mode == "rotated":
                raise
            why = f" (not rotations of rank 0: {e})"
    if estimate > FULL_LIMIT:
        raise OutOfTime(f"every rank's schedule would be about {estimate:,} messages, over "
                        f"the {FULL_LIMIT:,} the simulator builds{why}")
    world, _ = checker.world_of(build, collective, p, layout, root, seg, hosts,
                                itemsize=itemsize)
    prog = FullProgram(world)
    prog.rounds()  # the structure at the full size: matching, sizes, no deadlock
    return prog, "every rank's"


def mpi_program(build: Callable, collective: str, topo: Topology, layout: tuple, root: int,
                seg: int, itemsize: int = 4) -> MpiProgram:
    """Every rank's schedule in the point-to-point executor's order
    (:class:`~ringcomm.sim.program.MpiProgram`), its structure checked at the full size
    (``itemsize``: the element's bytes, as builders are told them).

    Raises:
        ScheduleError: a schedule is refused.
        OutOfTime: it would be more than :data:`FULL_LIMIT` messages.
    """
    p = topo.size
    _, steps0 = checker.compiled_rank(build, collective, p, 0, layout, root, seg,
                                      topo.host_numbers(), itemsize=itemsize)
    estimate = sum(len(a) + len(b) for a, b, _ in steps0[1]) * p
    if estimate > FULL_LIMIT:
        raise OutOfTime(f"every rank's schedule would be about {estimate:,} messages, over "
                        f"the {FULL_LIMIT:,} the simulator builds")
    deps: list[dict] = []

    def keep(s) -> None:
        lengths = [*buffer_lengths(s.ctx), *s.scratch]
        regions, steps = compile_steps(s, lengths)
        deps.append(dependencies(regions, steps, lengths))
    world, _ = checker.world_of(build, collective, p, layout, root, seg, topo.host_numbers(),
                                on_built=keep, itemsize=itemsize)
    world.run()  # the structure at the full size: matching, sizes, no deadlock
    return MpiProgram(world, deps)


def simulate(collective: str, algorithm: str, build: Callable, topo: Topology, nbytes: int,
             *, esize: int = 4, segment_bytes: int = 1 << 21, root: int = 0,
             mode: str = "auto", engine: str = "auto", order: str = "nccl",
             budget_s: float = 60.0) -> Result:
    """Simulate one call of ``algorithm`` (builder ``build``) for ``collective`` on
    ``topo``'s ranks, moving ``nbytes`` bytes as nccl-tests counts them.

    ``mode`` and ``order``: the program's source and order (:func:`program_for`; the
    MPI order is timed by events only); ``engine``: ``"events"``
    (:func:`ringcomm.sim.engine.run`), ``"rounds"`` (:func:`~ringcomm.sim.engine.run_rounds`)
    or ``"auto"``: rounds for a program of more than :data:`EVENT_MESSAGES` messages,
    else events. A refusal (the checker's, or the
    budget's) is returned in ``Result.refused``, never raised: a table of many
    cells goes on.
    """
    out = Result(collective, algorithm, topo.size, int(nbytes))
    deadline = time.monotonic() + budget_s
    began = time.perf_counter()
    try:
        out.proven = prove(build, collective, topo)
        layout = layout_for(collective, topo.size, max(int(nbytes) // esize, 0))
        seg = max(1, segment_bytes // esize)
        prog, out.source = program_for(build, collective, topo, layout, root, seg, mode,
                                       order, esize)
        net = network(topo)
        if order == "mpi" and engine == "rounds":
            raise NotRotation("the MPI order has no rounds: time it by events")
        if isinstance(prog, MpiProgram):
            kind, messages = "mpi", 0
        elif isinstance(prog, RotatedProgram):
            kind, messages = "rotated", prog.m * prog.size
        else:
            kind, messages = "full", len(prog.world.m_rank)
        by_rounds = engine == "rounds" or (engine == "auto"
                                           and messages > EVENT_MESSAGES[kind])
        out.engine = "rounds" if by_rounds else "events"
        t = (run_rounds if by_rounds else run)(prog, net, _costs.costs(topo, esize), deadline)
    except (ScheduleError, OutOfTime, NotRotation) as e:
        kind = "budget" if isinstance(e, OutOfTime) else "refused"
        out.refused = f"{kind}: {e}"
        out.sim_seconds = time.perf_counter() - began
        return out
    busy = t.link_bytes / net.capacity
    i = int(busy.argmax())
    out.seconds = t.time
    out.critical = {k: float(t.critical[k]) for k in PARTS}
    out.busiest_link = net.names[i]
    out.busiest_bytes = float(t.link_bytes[i])
    out.busiest_utilisation = float(busy[i] / t.time) if t.time > 0 else 0.0
    out.events, out.messages = t.events, t.messages
    out.sim_seconds = time.perf_counter() - began
    return out
