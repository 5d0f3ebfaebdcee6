"""From a call's shape to something that runs: which algorithm (the group's
choice, or ``auto``'s), its compiled schedule (cached per call shape, and for a
user's algorithm checked before first use), and the program that runs it on a
lane (:mod:`ringcomm.executors`). Also the ``RINGCOMM_DEBUG=DETAIL`` check that
every rank runs the same call, and the group's epoch (message tags).
"""
from __future__ import annotations

import collections
import logging
import threading
import zlib
from typing import Any, Callable

import torch

from . import algorithms, checker
from .algorithms import NATIVE, REGISTRY, select
from .algorithms import names as algorithm_names
from .algorithms import ring as _ring
from .executors import GroupProgram, NativeProgram, P2PProgram, Plan
from .lanes import Lane
from .schedule import Context, ScheduleError
from .settings import Options
from .transport import Channel, Transport

log = logging.getLogger("ringcomm")

#: compiled schedules kept per group (least recently used dropped first)
PLAN_CACHE_SIZE = 512
#: a user's schedule is checked symbolically at its real shape up to this many
#: elements over all ranks, at a proportionally smaller shape above it
CHECK_ELEMENTS = 1 << 18

#: what :meth:`Planner.prepare` returns: ``run(bufs)`` runs one collective on the
#: caller's buffers, ordered as ``ringcomm.schedule.BUFFERS`` lists them
Program = Any


class AlgorithmFailed(RuntimeError):
    """A user's schedule builder raised (not a wrong schedule: an exception)."""


class Planner:
    """One group's algorithm choices and compiled schedules.

    Args:
        rank, size: this rank and the group size.
        options: the group's settings, decided (:meth:`ringcomm.Options.resolve`).
        hosts: the host of every rank (:class:`ringcomm.schedule.Context`); empty: one host.
    """

    def __init__(self, rank: int, size: int, options: Options, hosts: tuple = ()):
        self.rank, self.size = rank, size
        self.hosts = tuple(hosts)
        self.segment_bytes: int = options.segment_bytes  # type: ignore[assignment]
        self.algos: dict[str, str] = {c: "auto" for c in REGISTRY}
        self.algos.update(options.algorithms)
        self._tuning = select.load_tuning(options.tuning_file)
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._fingerprints: dict = {}
        #: bumped by :meth:`refused`; part of every message tag
        self.epoch = 0
        self._lock = threading.Lock()
        self._logged: set = set()

    def choose(self, collective: str, nbytes: int) -> str:
        """The algorithm a ``collective`` of ``nbytes`` per rank runs."""
        name = self.algos[collective]
        if name == "auto":
            name = select.choose(self._tuning, collective, nbytes, self.size, self.hosts)
            if log.isEnabledFor(logging.INFO):
                key = (collective, name, max(nbytes, 1).bit_length())
                if key not in self._logged:
                    self._logged.add(key)
                    log.info("ringcomm auto: %s of %d B on %d ranks -> %s",
                             collective, nbytes, self.size, name)
        return name

    def prepare(self, lane: Lane, collective: str, layout: tuple, dtype: torch.dtype, *,
                nbytes: int, root: int = 0, op: Any = None,
                name: str | None = None) -> tuple[str, Program]:
        """Choose the algorithm for one call shape and return ``(name, program)``: the
        program runs it on ``lane`` (``program.run(bufs)``, the caller's buffers in the
        order of ``ringcomm.schedule.BUFFERS``). A new program every time: the caller
        (a prepared call) owns it, and closes it when it is dropped.

        Runs on the caller's thread, so a schedule a user's builder gets wrong is
        refused here, on every rank alike, before anything is sent.
        """
        if name is None:
            name = self.choose(collective, nbytes)
            if REGISTRY[collective].get(name) is NATIVE and self.algos[collective] == "auto":
                # a measured table may pick the library's own collective; where it cannot
                # take this call (a dtype or op MPI lacks) auto takes the modelled choice
                try:
                    lane.tp.check_native(collective, dtype, op)
                except ValueError:
                    name = select.choose(select.MODELLED, collective, nbytes, self.size,
                                         self.hosts)
        build = REGISTRY[collective].get(name)
        if build is None:
            raise ValueError(f"ringcomm {collective}: algorithm {name!r} is not registered "
                             f"(available: {algorithm_names(collective)})")
        tp = lane.tp
        if build is NATIVE:
            tp.check_native(collective, dtype, op)
            return name, NativeProgram(tp, collective, layout, dtype, op, root)
        plan = self.plan(collective, name, build, layout, root, dtype)
        return name, program(tp, plan, dtype, op, self.epoch)

    def plan(self, collective: str, name: str, build: Callable, layout: tuple, root: int,
             dtype: torch.dtype) -> Plan:
        """The compiled schedule for this call shape, from the cache or built (and, for
        an algorithm that did not ship with ringcomm, checked) now."""
        seg = max(1, self.segment_bytes // dtype.itemsize)
        key = (collective, name, build, layout, root, seg, algorithms.generation)
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        ctx = Context(collective, self.size, self.rank, layout, root, seg, self.hosts)
        if (collective, name) not in algorithms.TRUSTED:
            schedule = check_user_schedule(build, ctx, name)
        else:
            schedule = build(ctx)
        plan = Plan(schedule)
        with self._lock:
            self._plans[key] = plan
            if len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        return plan

    def same_call(self, lane: Lane, op: str, fields: list[int]) -> None:
        """``RINGCOMM_DEBUG=DETAIL``: raise unless every rank runs the same collective
        with the same sizes, compared as a fixed-length fingerprint over the built-in
        ring (the group's choice of algorithm is what may be wrong)."""
        if self.size == 1:
            return
        mine = _fingerprint(op, fields)
        dev = lane.tp.device
        rows = torch.empty(self.size, mine.numel(), dtype=torch.uint8, device=dev)
        checker_prog = self._fingerprints.get(lane)
        if checker_prog is None:
            plan = self.plan("allgather", "ring", _ring.allgather, (mine.numel(),) * self.size,
                             0, torch.uint8)
            checker_prog = self._fingerprints[lane] = program(lane.tp, plan, torch.uint8,
                                                              None, self.epoch)
        checker_prog.run([*rows.unbind(0), mine.to(dev)])
        rows = rows.cpu()  # on a stream: waits for the exchange
        bad = [r for r in range(self.size) if not torch.equal(rows[r], mine)]
        if bad:
            theirs = "; ".join(f"rank {r} runs {_describe(rows[r])}" for r in bad)
            raise RuntimeError(f"collective mismatch: rank {self.rank} runs {_describe(mine)}, "
                               f"but {theirs}")

    def refused(self) -> None:
        """A call was refused on this rank (bad input): a new epoch. Later messages
        carry other tags than the ranks that ran the call expect, so the mismatch ends
        in a clear timeout rather than in data exchanged between different calls."""
        self.epoch += 1
        for prog in self._fingerprints.values():
            prog.close()
        self._fingerprints.clear()


#: the DETAIL fingerprint: the operation's name in this many bytes, then this many
#: int64 fields (sizes, op, root, dtype)
NAME_BYTES, FINGERPRINT_FIELDS = 32, 4


def _fingerprint(op: str, fields: list[int]) -> torch.Tensor:
    name = op.encode()[:NAME_BYTES].ljust(NAME_BYTES, b"\0")
    nums = torch.zeros(FINGERPRINT_FIELDS, dtype=torch.int64)
    nums[:len(fields)] = torch.tensor(fields[:FINGERPRINT_FIELDS], dtype=torch.int64)
    return torch.cat([torch.frombuffer(bytearray(name), dtype=torch.uint8),
                      nums.view(torch.uint8)])


def _describe(row: torch.Tensor) -> str:
    name = bytes(row[:NAME_BYTES].tolist()).rstrip(b"\0").decode(errors="replace")
    return f"{name or '?'} {row[NAME_BYTES:].clone().view(torch.int64).tolist()}"


def dtype_code(dtype: torch.dtype) -> int:
    """A dtype as a number for the DETAIL fingerprint."""
    return zlib.crc32(str(dtype).encode())


def program(channel: Channel, plan: Plan, dtype: torch.dtype, op: Any, epoch: int = 0):
    """The program that runs ``plan`` on ``channel``: over point-to-point messages on a
    transport, one group per step on an NCCL communicator."""
    scratch = [channel.scratch(i, n, dtype) for i, n in enumerate(plan.scratch)]
    if isinstance(channel, Transport):
        return P2PProgram(plan, channel, scratch, op, epoch)
    return GroupProgram(plan, channel, scratch, op)


def check_user_schedule(build: Callable, ctx: Context, name: str):
    """Check a user's builder for this call shape and return this rank's schedule,
    the very one that was checked (every rank checks the same, so every rank
    refuses a wrong schedule alike).

    At the real shape: bounds, matching and freedom from deadlock always, contents
    too up to ``CHECK_ELEMENTS`` elements over all ranks (and 62 ranks); above that
    the contents are checked at a proportionally smaller shape with the same
    number of segments per chunk.

    Raises:
        ScheduleError: (a ValueError) naming the algorithm, step and element at fault.
        AlgorithmFailed: the builder raised, for some rank's view of this call (every
            rank builds every rank's schedule, so every rank raises alike).
    """
    coll, p, r, lay = ctx.collective, ctx.size, ctx.rank, ctx.layout
    # The checker needs every rank's view; where a rank knows only its own sizes
    # (gather/scatter non-roots, alltoall) a consistent global layout stands in;
    # this rank's part of it is exactly its own layout.
    if coll in ("gather", "scatter"):
        own = lay[r]
        layout = tuple(own if c is None else c for c in lay)
    elif coll == "alltoall":
        sends, recvs = lay
        layout = tuple(tuple(sends[j] if i == r else recvs[i] if j == r else 1
                             for j in range(p)) for i in range(p))
    else:
        layout = lay
    total = sum(_leaves(layout)) * max(p, 1)
    small = total <= CHECK_ELEMENTS and p <= checker.MAX_RANKS
    try:
        scheds = checker.schedules(build, coll, p, layout, ctx.root, ctx.seg, ctx.hosts)
        checker.check(build, coll, p, layout, root=ctx.root, seg=ctx.seg, symbolic=small,
                      built=scheds, hosts=ctx.hosts)
        if not small and p <= checker.MAX_RANKS:  # same segments per chunk, fewer elements
            f = -(-total // CHECK_ELEMENTS)
            checker.check(build, coll, p, _scaled(layout, f), root=ctx.root,
                          seg=max(1, ctx.seg // f), hosts=ctx.hosts)
    except ScheduleError as e:
        raise ScheduleError(f"ringcomm: algorithm {name!r} is wrong: {e}") from None
    except Exception as e:  # noqa: BLE001 - a user's code may raise anything
        raise AlgorithmFailed(f"algorithm {name!r} raised {type(e).__name__}: {e} while "
                              f"building its {coll} schedule for {p} ranks, layout "
                              f"{layout}") from e
    return scheds[r]


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
