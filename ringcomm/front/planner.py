"""From a call's shape to something that runs: which algorithm (the group's
choice, or ``auto``'s), its compiled schedule (cached per call shape, and for a
user's algorithm checked before first use), and the program that runs it on a
lane (:mod:`ringcomm.execution.executors`), and the group's epoch (message tags). A user's
builder is checked by :func:`ringcomm.execution.user_checks.check_user_schedule`; the
``RINGCOMM_DEBUG=DETAIL`` comparison of every rank's call is
:mod:`ringcomm.front.cross_rank_checks`.
"""
from __future__ import annotations

import collections
import logging
import threading
import zlib
from typing import Any, Callable

import torch

from ringcomm import algorithms
from ringcomm.algorithms import (NATIVE, REGISTRY, TransportCollective, expand_choices,
                                 is_schedule)
from ringcomm.algorithms import names as algorithm_names
from ringcomm.algorithms import select
from ringcomm.front.lanes import Lane
from ringcomm.schedule import Context, ShapeNotServed
from ringcomm.execution.user_checks import check_user_schedule
from ringcomm.execution.executors import GroupProgram, NativeProgram, P2PProgram
from ringcomm.execution.plan import Plan
from ringcomm.settings import Options
from ringcomm.transport import Link, Transport
from ringcomm.transport.base import NotOwnCollective

log = logging.getLogger("ringcomm")

#: collectives whose layout on a rank holds that rank's sizes only (not in signatures)
_OWN_LAYOUT = ("alltoall", "gather", "scatter")
#: collectives with a root (their signatures name it)
_ROOTED = ("broadcast", "reduce", "gather", "scatter")
#: compiled schedules kept per group (least recently used dropped first)
PLAN_CACHE_SIZE = 512
#: ... and at most this many bytes (:attr:`Plan.nbytes
#: <ringcomm.execution.plan.Plan.nbytes>`) over all its cached plans; the newest plan
#: stays whatever its size. A 16,384-rank ring's plan holds about 2 MiB
#: (docs/data/plans.json), a 2-rank allreduce's about 4 KiB
PLAN_CACHE_BYTES = 64 << 20
#: what :meth:`Planner.prepare` returns: ``run(bufs)`` runs one collective on the
#: caller's buffers, ordered as ``ringcomm.schedule.BUFFERS`` lists them
Program = Any


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
        self.algos.update(expand_choices(options.algorithms))
        self._tuning = select.load_tuning(options.tuning_file)
        self._measured = select.measured_keys(options.tuning_file)
        self._sim = None
        if options.topology:
            from ringcomm.sim.choose import Chooser  # numpy-heavy: only when asked for
            self._sim = Chooser(options.topology, size, options.segment_bytes)
            if self._sim.why_not:
                log.info("ringcomm auto: no simulated choices: %s", self._sim.why_not)
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._plan_bytes = 0  # over all cached plans
        #: bumped by :meth:`refused`; part of every message tag
        self.epoch = 0
        #: this rank's call signatures, by hash (the newest PLAN_CACHE_SIZE)
        self._signatures: dict[int, str] = {}
        self._lock = threading.Lock()
        self._logged: set = set()

    def choose(self, collective: str, nbytes: int, bands: bool = True) -> str:
        """The algorithm a ``collective`` of ``nbytes`` per rank runs (``bands``:
        :data:`ringcomm.algorithms.select.BANDS` too). ``auto`` asks, in turn: a band,
        the measured rows of its table, the simulator (``Options.topology``), the
        modelled rows; ``RINGCOMM_DEBUG=INFO`` logs which decided."""
        name = self.algos[collective]
        if name != "auto":
            return name
        name = select.choose(self._tuning, collective, nbytes, self.size, self.hosts, bands)
        banded = bands and name != select.choose(self._tuning, collective, nbytes, self.size,
                                                 self.hosts, False)
        if banded:
            source = "a band (register_msccl)"
        elif str(self.size) in self._measured.get(collective, ()):
            source = "measured table"
        else:
            source = "modelled table"
            # the simulator times schedules only: a transport's own collective the table
            # picks (shm_direct on one host) stays; where the transport cannot take the
            # call, prepare asks again (instead_of_own)
            picked = (self._sim and is_schedule(REGISTRY[collective].get(name))
                      and self._sim.choose(collective, nbytes, self._candidates(collective)))
            if picked:
                name, source = picked[0], f"simulated on {self._sim.path}"
        if log.isEnabledFor(logging.INFO):
            key = (collective, name, max(nbytes, 1).bit_length())
            if key not in self._logged:
                self._logged.add(key)
                log.info("ringcomm auto: %s of %d B on %d ranks -> %s (%s)",
                         collective, nbytes, self.size, name, source)
        return name

    def instead_of_own(self, collective: str, nbytes: int) -> str:
        """auto's choice where the transport cannot take the call with the collective
        of its own that the table picked (a dtype or op MPI lacks, ranks on several
        hosts): the simulator's fastest schedule (``Options.topology``), else the
        modelled table's."""
        picked = self._sim and self._sim.choose(collective, nbytes,
                                                self._candidates(collective))
        if picked:
            return picked[0]
        return select.choose(select.MODELLED, collective, nbytes, self.size, self.hosts)

    def _candidates(self, collective: str) -> dict[str, Callable]:
        """The schedule algorithms the simulator may pick among for ``collective``: every
        registered one, but those written for another world size."""
        return {n: b for n, b in REGISTRY[collective].items()
                if algorithms.is_schedule(b) and getattr(b, "fixed_world_size", None)
                in (None, self.size)}

    def prepare(self, lane: Lane, collective: str, layout: tuple, dtype: torch.dtype, *,
                nbytes: int, root: int = 0, op: Any = None, name: str | None = None,
                bands: bool = True, as_dtype: torch.dtype | None = None) -> tuple[str, Program]:
        """Choose the algorithm for one call shape and return ``(name, program)``: the
        program runs it on ``lane`` (``program.run(bufs)``, the caller's buffers in the
        order of ``ringcomm.schedule.BUFFERS``). A new program every time: the caller
        (a prepared call) owns it, and closes it when it is dropped.

        Runs on the caller's thread, so a schedule a user's builder gets wrong is
        refused here, on every rank alike, before anything is sent. ``as_dtype``: the
        caller's dtype where the call moves bytes (it tells calls apart in the tags).
        """
        chosen = name is None and self.algos[collective] == "auto"
        if name is None:
            name = self.choose(collective, nbytes, bands)
            own = REGISTRY[collective].get(name)
            if isinstance(own, TransportCollective) and self.algos[collective] == "auto":
                # a measured table may pick a transport's own collective; where this one
                # cannot take the call (a dtype or op MPI lacks, ranks on several hosts)
                # auto takes the modelled choice
                try:
                    lane.tp.check_own(own.name, collective, dtype, op)
                except ValueError:
                    name = self.instead_of_own(collective, nbytes)
        build = REGISTRY[collective].get(name)
        if build is None:
            raise ValueError(f"ringcomm {collective}: algorithm {name!r} is not registered "
                             f"(available: {algorithm_names(collective)})")
        tp = lane.tp
        if isinstance(build, TransportCollective):
            try:
                tp.check_own(build.name, collective, dtype, op)
            except NotOwnCollective as e:
                raise NotOwnCollective(f"{e}: algorithm {name!r} needs {build.where}") from None
            if build is NATIVE:
                return name, NativeProgram(tp, collective, layout, dtype, op, root)
            sig = self.signature(collective, name, layout, root, dtype, op, as_dtype)
            return name, tp.own_init(build.name, collective, layout, dtype, op, sig,
                                     self.epoch, self.call_named, root=root)
        try:
            plan = self.plan(collective, name, build, layout, root, dtype)
        except ShapeNotServed:
            if not chosen or not any(b[2] == name for b in select.BANDS.get(
                    (collective, self.size), ())):
                raise
            # auto's band went to an algorithm that does not serve this call (an MSCCL
            # file and a count its chunks do not divide): the table's choice runs it
            return self.prepare(lane, collective, layout, dtype, nbytes=nbytes, root=root,
                                op=op, bands=False, as_dtype=as_dtype)
        sig = self.signature(collective, name, layout, root, dtype, op, as_dtype)
        return name, program(tp, plan, dtype, op, self.epoch, sig, self.call_named)

    def signature(self, collective: str, name: str, layout: tuple, root: int,
                  dtype: torch.dtype, op: Any, as_dtype: torch.dtype | None) -> tuple[int, str]:
        """``(hash, text)`` of what a call is, equal on every rank making the same call
        (its hash goes into the call's message tags); this rank's calls are kept by
        hash, to name a peer's call in a mismatch."""
        unit = "bytes" if dtype == torch.uint8 and as_dtype is None else \
            str(as_dtype or dtype).replace("torch.", "")
        if collective in _OWN_LAYOUT:  # each rank knows only its own sizes
            layout, what = (), f"{unit}, each rank its own sizes,"
        elif len(set(layout)) == 1 and len(layout) > 1:
            what = f"{len(layout)} x {layout[0]} {unit}"
        else:
            what = "x".join(map(str, layout[:8])) + ("..." if len(layout) > 8 else "") + f" {unit}"
        text = (f"{collective}[{name}] of {what}"
                + (f" {getattr(op, 'name', op)}" if op is not None else "")
                + (f" from root {root}" if collective in _ROOTED else ""))
        code = zlib.crc32(repr((text, layout)).encode())
        with self._lock:
            self._signatures[code] = text
            if len(self._signatures) > PLAN_CACHE_SIZE:
                del self._signatures[next(iter(self._signatures))]
        return code, text

    def call_named(self, part: int, bits: int) -> str | None:
        """The one call this rank made whose signature hash ends in the ``bits``
        bits ``part`` (what a tag keeps), or None (none, or several)."""
        mask = (1 << bits) - 1
        with self._lock:
            found = {t for c, t in self._signatures.items() if c & mask == part}
        return found.pop() if len(found) == 1 else None

    def plan(self, collective: str, name: str, build: Callable, layout: tuple, root: int,
             dtype: torch.dtype) -> Plan:
        """The compiled schedule for this call shape, from the cache or built (and, for
        an algorithm that did not ship with ringcomm, checked) now."""
        seg = max(1, self.segment_bytes // dtype.itemsize)
        key = (collective, name, build, layout, root, seg, dtype.itemsize,
               algorithms.generation)
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        ctx = Context(collective, self.size, self.rank, layout, root, seg, self.hosts,
                      dtype.itemsize)
        if (collective, name) not in algorithms.TRUSTED:
            schedule = check_user_schedule(build, ctx, name)
        else:
            schedule = build(ctx)
        plan = Plan(schedule)
        with self._lock:
            replaced = self._plans.pop(key, None)  # another thread built it meanwhile
            self._plan_bytes += plan.nbytes - (replaced.nbytes if replaced else 0)
            self._plans[key] = plan
            while len(self._plans) > 1 and (len(self._plans) > PLAN_CACHE_SIZE
                                            or self._plan_bytes > PLAN_CACHE_BYTES):
                self._plan_bytes -= self._plans.popitem(last=False)[1].nbytes
        return plan

    def refused(self) -> None:
        """A call was refused on this rank (bad input): a new epoch. Later messages
        carry other tags than the ranks that ran the call expect, so the mismatch ends
        in a clear timeout rather than in data exchanged between different calls."""
        self.epoch += 1


def program(link: Link, plan: Plan, dtype: torch.dtype, op: Any, epoch: int = 0,
            signature: tuple[int, str] = (0, "this call"), names: Any = None):
    """The program that runs ``plan`` on ``link``: over point-to-point messages on a
    transport (tagged with the call's ``signature``, see
    :class:`ringcomm.execution.executors.TagLayout`), one group per step on an NCCL
    communicator."""
    scratch = [link.scratch(i, n, dtype) for i, n in enumerate(plan.scratch)]
    if isinstance(link, Transport):
        return P2PProgram(plan, link, scratch, op, epoch, signature, names)
    return GroupProgram(plan, link, scratch, op)
