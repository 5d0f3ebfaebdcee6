"""A schedule (:mod:`ringcomm.schedule`) compiled once per call shape, for the
executors (:mod:`ringcomm.execution.executors`): regions numbered, and the
dependencies the point-to-point executor needs to post receives ahead and send
as soon as data is final, in schedule order.
"""
from __future__ import annotations

import bisect
from itertools import chain, islice
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

from ringcomm import trace
from ringcomm.schedule import Reduce, Region, Schedule, buffer_lengths

#: receives the point-to-point executor keeps posted ahead of the step it waits on
RECV_AHEAD = 64


class _Spans:
    """Who last touched each part of one buffer, as disjoint spans:
    ``[start, end, last_write_step, last_local_read_step, sends_reading_since]``."""

    def __init__(self, n: int):
        self.starts = [0]
        self.spans = [[0, max(n, 1), -1, -1, []]]

    def cover(self, a: int, e: int) -> list:
        """The spans exactly covering ``[a, e)`` (splitting at its ends)."""
        if e <= a:
            return []
        self._split(a)
        self._split(e)
        i = bisect.bisect_left(self.starts, a)
        j = bisect.bisect_left(self.starts, e)
        return self.spans[i:j]

    def _split(self, x: int) -> None:
        i = bisect.bisect_right(self.starts, x) - 1
        if i < 0:
            return
        s = self.spans[i]
        if s[0] < x < s[1]:
            t = [x, s[1], s[2], s[3], list(s[4])]
            s[1] = x
            self.spans.insert(i + 1, t)
            self.starts.insert(i + 1, x)


#: a plan's local work: ``dst = src``, ``dst = dst (op) src``, ``dst = src (op) dst``
COPY, REDUCE, REDUCE_SRC_FIRST = 0, 1, 2


def local_kind(op) -> int:
    """The plan's code of local op ``op`` (a :class:`Reduce` or a ``Copy``)."""
    if isinstance(op, Reduce):
        return REDUCE_SRC_FIRST if op.src_first else REDUCE
    return COPY


def compile_steps(schedule: Schedule, lengths: list) -> tuple[list, list]:
    """``(regions, steps)`` of :class:`Plan`: the schedule's distinct regions as
    ``(buffer, start, end, whole)`` (``lengths``: every buffer's element count, caller
    buffers then scratch), and its steps over their numbers. What the executors and
    :class:`ringcomm.execution.world.World` read; one pass over the steps."""
    index: dict[Region, int] = {}
    regions: list[tuple[int, int, int, bool]] = []
    get = index.get

    def new(rg: Region) -> int:
        i = index[rg] = len(regions)
        whole = rg.off == 0 and rg.n == (lengths[rg.buf] or 0)
        regions.append((rg.buf, rg.off, rg.off + rg.n, whole))
        return i

    steps = []
    for sends, recvs, local in schedule.steps:
        # tuples, and one empty tuple for every empty part: a 16,384-rank ring's plan
        # holds 32,766 steps
        a = tuple([(x.peer, new(x.region) if (v := get(x.region)) is None else v)
                   for x in sends]) or ()
        b = tuple([(x.peer, new(x.region) if (v := get(x.region)) is None else v)
                   for x in recvs]) or ()
        c = tuple([(REDUCE_SRC_FIRST if type(op) is Reduce and op.src_first else
                    REDUCE if type(op) is Reduce else local_kind(op),
                    new(op.dst) if (d := get(op.dst)) is None else d,
                    new(op.src) if (v := get(op.src)) is None else v) for op in local]) or ()
        steps.append((a, b, c))
    return regions, steps


class Unpacked(NamedTuple):
    """A :class:`Plan` as Python tuples, for an executor to bind once (see
    :meth:`Plan.unpack`; none of it is kept in the plan cache)."""

    #: per region ``(buffer, start, end, whole)``
    regions: list
    #: per step ``(sends, recvs, local)``: ``((peer, region), ...)`` twice and
    #: ``((kind, dst, src), ...)``, ``kind`` one of :data:`COPY`, :data:`REDUCE` and
    #: :data:`REDUCE_SRC_FIRST` (true for both reduces)
    steps: list
    #: every send and every receive in schedule order, ``(peer, region)``
    send_list: list
    recv_list: list
    #: per receive, the sends (numbers in ``send_list``) that must complete before it
    #: is posted (they read what it overwrites)
    recv_waits: list
    #: per step, what :class:`ringcomm.execution.executors.P2PProgram` binds:
    #: ``(sends started by then, receives posted by then, this step's receives, sends
    #: to complete before its local work, its local work)``
    p2p_steps: list
    #: sends no step waits for (waited for at the end)
    tail_sends: list


#: what a plan holds beyond its arrays (its Python objects, measured with tracemalloc
#: in tests/test_units.py): part of :attr:`Plan.nbytes`
PLAN_FIXED_BYTES = 4096
#: ... and per receive, for :meth:`Plan.held_receives` once worked out
HELD_BYTES = 12


class Plan:
    """A schedule compiled for execution (built once per call shape, then cached).

    It keeps what the executors read, not the schedule, and keeps it as arrays (of
    steps, messages, local operations, regions and dependencies): a cached plan costs
    about 30 bytes a step and message, a 16,384-rank ring's (32,766 steps) about
    2 MiB (docs/architecture.md). An executor takes it as tuples once per binding
    (:meth:`unpack`).

    Attributes:
        ctx: the schedule's context.
        lengths: every buffer's element count, caller buffers then scratch.
        nbuffers: the caller's buffers (``ringcomm.schedule.BUFFERS``).
        scratch: the scratch buffers' element counts.
        nsteps: the number of steps.
        nbytes: what the plan holds, in bytes (the plan cache's measure).
    """

    def __init__(self, schedule: Schedule):
        self.ctx = ctx = schedule.ctx
        lens = buffer_lengths(ctx)
        self.lengths = [*lens, *schedule.scratch]
        self.nbuffers = schedule.nbuffers
        self.scratch = schedule.scratch
        regions, steps = compile_steps(schedule, self.lengths)
        self.nsteps = len(steps)
        self._pack(regions, steps, dependencies(regions, steps, self.lengths))
        self._held: np.ndarray | None = None  # see held_receives

    def _pack(self, regions: list, steps: list, deps: dict) -> None:
        self._regions = np.array(regions, dtype=np.int64).reshape(-1, 4)
        self._sends, self._send_at = _ragged([s for s, _, _ in steps], 2)
        self._recvs, self._recv_at = _ragged([r for _, r, _ in steps], 2)
        self._local, self._local_at = _ragged([w for _, _, w in steps], 3)
        self._recv_waits, self._recv_waits_at = _ragged(deps["recv_waits"], 0)
        self._step_waits, self._step_waits_at = _ragged(deps["step_send_waits"], 0)
        self._send_upto = np.array(deps["send_upto"], dtype=np.int32)
        self._recv_upto = np.array(deps["recv_upto"], dtype=np.int32)
        self._tail_sends = np.array(deps["tail_sends"], dtype=np.int32)
        # and room for the held receives a shared-memory binding may work out later
        # (held_receives: at most one int32 triple a receive)
        self.nbytes = PLAN_FIXED_BYTES + HELD_BYTES * len(self._recvs) + sum(
            a.nbytes for a in vars(self).values() if isinstance(a, np.ndarray))

    @property
    def nmessages(self) -> int:
        """Sends and receives."""
        return len(self._sends) + len(self._recvs)

    def unpack(self) -> Unpacked:
        """The plan as tuples (see :class:`Unpacked`), built anew at each call: for an
        executor binding it, once."""
        regions = [(b, a, e, bool(w)) for b, a, e, w in self._regions.tolist()]
        send_list = [tuple(x) for x in self._sends.tolist()]
        recv_list = [tuple(x) for x in self._recvs.tolist()]
        sends = _split(send_list, self._send_at)
        recvs = _split(recv_list, self._recv_at)
        local = _split([tuple(x) for x in self._local.tolist()], self._local_at)
        steps = list(zip(sends, recvs, local))
        recv_waits = _split(self._recv_waits.tolist(), self._recv_waits_at)
        step_waits = _split(self._step_waits.tolist(), self._step_waits_at)
        at = self._recv_at.tolist()
        p2p = list(zip(self._send_upto.tolist(), self._recv_upto.tolist(),
                       [tuple(range(at[i], at[i + 1])) for i in range(self.nsteps)],
                       step_waits, local))
        return Unpacked(regions, steps, send_list, recv_list, recv_waits, p2p,
                        self._tail_sends.tolist())

    def held_receives(self, u: Unpacked | None = None) -> dict[int, tuple[int, int]]:
        """Receives whose data a transport may leave in the sender's memory until the
        one local step that reads it (a reduction or copy straight from there, no copy
        into scratch first): ``{receive number: (step, index in the step's local
        work)}`` (``u``: this plan unpacked, if the caller has it).

        A receive qualifies when it lands in scratch and exactly one local step reads
        what it brought: the first local step of the step that waits for it to touch
        that scratch, which reads it whole and writes elsewhere; nothing after reads
        that scratch before a receive or a copy overwrites all of it (a send of it
        would send what was never written there). It must also be the last receive
        from its peer that its step waits for: messages from a peer are taken in
        order, and a later one the step awaits could need the sender's slots the held
        data occupies."""
        if self._held is not None:
            return {j: (i, li) for j, i, li in self._held.tolist()}
        u = u or self.unpack()
        out: dict[int, tuple[int, int]] = {}
        for i, (_, _, mine, _, _) in enumerate(u.p2p_steps):
            last_of_peer = {u.recv_list[j][0]: j for j in mine}
            for peer, j in last_of_peer.items():
                v = u.recv_list[j][1]
                if u.regions[v][0] < self.nbuffers:
                    continue
                li = _sole_reader(u, i, j, v, mine)
                if li is not None:
                    out[j] = (i, li)
        # kept as int32 triples, counted in nbytes from the start
        self._held = np.array([(j, i, li) for j, (i, li) in out.items()],
                              dtype=np.int32).reshape(-1, 3)
        return out

    @property
    def peers(self) -> list[int]:
        """The ranks this rank exchanges messages with."""
        return np.union1d(self._sends[:, 0], self._recvs[:, 0]).tolist()

    def trace_step(self, i: int, start_us: float) -> float:
        """Record step ``i`` (from ``start_us`` to now) in the trace, with its
        messages as ``[peer, elements]``; return now."""
        end = trace.now()
        trace.complete(f"step {i}", "step", start_us, end,
                       sends=self._messages(self._sends, self._send_at, i),
                       recvs=self._messages(self._recvs, self._recv_at, i))
        return end

    def _messages(self, msgs: np.ndarray, at: np.ndarray, i: int) -> list:
        rg = self._regions
        return [[p, int(rg[v, 2] - rg[v, 1])] for p, v in msgs[at[i]:at[i + 1]].tolist()]


def _ragged(rows: list, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of tuples (of ``width`` ints each; 0: of plain ints) as one int32 array
    and the offsets where each row starts (one more than the rows)."""
    at = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(list(map(len, rows)), out=at[1:])
    flat = chain.from_iterable(rows)
    if width:
        flat = chain.from_iterable(flat)
    arr = np.fromiter(flat, dtype=np.int32, count=int(at[-1]) * max(width, 1))
    return (arr.reshape(-1, width) if width else arr), at


def _split(flat: list, at: np.ndarray) -> list:
    """``flat`` cut at offsets ``at`` (see :func:`_ragged`) into tuples."""
    a = at.tolist()
    return [tuple(flat[a[i]:a[i + 1]]) for i in range(len(a) - 1)]


def dependencies(regions: list, steps: list, lengths: list) -> dict:
    """For the point-to-point executor: when each send may go out and each receive be
    posted (as a count of retired steps), and which sends must have completed before
    a receive or a step's local work overwrites their data (the lists of
    :class:`Unpacked`)."""
    spans = [_Spans(n or 0) for n in lengths]
    send_ready, recv_ready, recv_waits = [], [], []
    step_send_waits, step_nrecv = [], []
    for i, (sends, recvs, local) in enumerate(steps):
        for _, v in sends:
            buf, a, e, _ = regions[v]
            j = len(send_ready)
            ready = 0
            for sp in spans[buf].cover(a, e):
                ready = max(ready, sp[2] + 1)
                sp[4].append(j)
            send_ready.append(ready)
        for _, v in recvs:
            buf, a, e, _ = regions[v]
            ready, waits = 0, set()
            for sp in spans[buf].cover(a, e):
                ready = max(ready, sp[2] + 1, sp[3] + 1)
                waits.update(sp[4])
                sp[2], sp[3], sp[4] = i, -1, []
            recv_ready.append(ready)
            recv_waits.append(tuple(sorted(waits)))
        step_nrecv.append(len(recvs))
        waits = set()
        for _, d, s in local:
            sbuf, sa, se, _ = regions[s]
            for sp in spans[sbuf].cover(sa, se):
                sp[3] = max(sp[3], i)
            dbuf, da, de, _ = regions[d]
            for sp in spans[dbuf].cover(da, de):
                waits.update(sp[4])
                sp[2], sp[3], sp[4] = i, -1, []
        step_send_waits.append(tuple(sorted(waits)))
    n = len(steps)
    # Receives are posted in order, at most RECV_AHEAD beyond the current step's,
    # and never ahead where they would first have to wait for a send.
    first_of_step = []
    k = 0
    for i in range(n):
        first_of_step.append(k)
        k += step_nrecv[i]
    recv_step = [i for i in range(n) for _ in range(step_nrecv[i])]
    upto, best, j = [], 0, 0
    for i in range(n):
        must = first_of_step[i] + step_nrecv[i]
        while (j < len(recv_ready) and recv_ready[j] <= i
               and j < first_of_step[i] + RECV_AHEAD
               and (not recv_waits[j] or recv_step[j] <= i)):
            j += 1
        best = max(best, j, must)
        upto.append(best)
    waited = {k for ws in step_send_waits for k in ws}
    waited.update(k for ws in recv_waits for k in ws)
    # Sends go out in order: before retiring step i, every send of the longest prefix
    # whose data is final by then.
    return {"send_upto": _prefix_upto(send_ready, n), "recv_upto": upto,
            "recv_waits": recv_waits, "step_send_waits": step_send_waits,
            "tail_sends": [k for k in range(len(send_ready)) if k not in waited]}


def _sole_reader(u: Unpacked, i: int, j: int, v: int, mine: tuple) -> int | None:
    """The index in step ``i``'s local work of the one step that reads receive ``j``'s
    region ``v``, if that step is the only reader (see :meth:`Plan.held_receives`)."""
    buf, a, e, _ = u.regions[v]

    def touches(w: int) -> bool:
        b2, a2, e2, _ = u.regions[w]
        return b2 == buf and a2 < e and a < e2 and e2 > a2

    def covers(w: int) -> bool:
        b2, a2, e2, _ = u.regions[w]
        return b2 == buf and a2 <= a and e <= e2

    if any(touches(u.recv_list[k][1]) for k in mine if k != j):
        return None
    local = u.steps[i][2]
    li = next((k for k, (_, d, s) in enumerate(local) if touches(d) or touches(s)), None)
    if li is None or local[li][2] != v or touches(local[li][1]):
        return None
    for kind, x in _after(u, i, local[li + 1:]):
        if kind == "send":
            if touches(x):
                return None
        elif kind == "recv":
            if covers(x):
                return li
            if touches(x):
                return None
        else:
            is_reduce, d, s = x
            if touches(s) or (touches(d) and (is_reduce or not covers(d))):
                return None
            if touches(d):
                return li
    return li


def _after(u: Unpacked, i: int, rest: Sequence) -> Iterator[tuple[str, Any]]:
    """What follows step ``i``'s local operation whose later ones are ``rest``, in
    program order: those, then each later step's sends, receives and local work.
    Made as it is read: the reader stops at the first operation that decides (in a
    ring, the next step's), so a plan's held receives cost about one step each, not
    the rest of the plan each (quadratic in the ranks)."""
    for op in rest:
        yield "local", op
    for sends, recvs, work in islice(u.steps, i + 1, None):
        for _, w in sends:
            yield "send", w
        for _, w in recvs:
            yield "recv", w
        for op in work:
            yield "local", op


def _prefix_upto(ready: list[int], nsteps: int) -> list[int]:
    """``upto[i]``: length of the longest prefix of ``ready`` whose values are <= i."""
    out, m, j = [], -1, 0
    pm = []
    for r in ready:
        m = max(m, r)
        pm.append(m)
    for i in range(nsteps):
        while j < len(pm) and pm[j] <= i:
            j += 1
        out.append(j)
    return out
