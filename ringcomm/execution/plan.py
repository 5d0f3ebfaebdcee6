"""A schedule (:mod:`ringcomm.schedule`) compiled once per call shape, for the
executors (:mod:`ringcomm.execution.executors`): regions numbered, and the
dependencies the point-to-point executor needs to post receives ahead and send
as soon as data is final, in schedule order.
"""
from __future__ import annotations

import bisect

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


class Plan:
    """A schedule compiled for execution (built once per call shape, then cached).

    It keeps what the executors read, not the schedule: a cached plan of a
    16,384-rank ring costs what its own 32,766 steps take (docs/architecture.md).

    Attributes:
        ctx: the schedule's context.
        regions: the distinct regions, indexed by the per-step tuples below.
        steps: per step ``(sends, recvs, local)``: ``((peer, region index), ...)`` twice
            and ``((kind, dst index, src index), ...)``, ``kind`` one of :data:`COPY`,
            :data:`REDUCE` and :data:`REDUCE_SRC_FIRST` (true for both reduces).
    """

    def __init__(self, schedule: Schedule):
        self.ctx = ctx = schedule.ctx
        lens = buffer_lengths(ctx)
        self.lengths = [*lens, *schedule.scratch]
        self.nbuffers = schedule.nbuffers
        self.scratch = schedule.scratch
        self.regions, self.steps = compile_steps(schedule, self.lengths)
        #: what the plan holds, in entries: steps, messages and local operations (the
        #: plan cache's measure of a plan: it holds 100-250 bytes an entry)
        self.weight = sum(1 + len(a) + len(b) + len(c) for a, b, c in self.steps)
        self._dependencies()
        self._held: dict[int, tuple[int, int]] | None = None  # see held_receives

    def _dependencies(self) -> None:
        """For the point-to-point executor: when each send may go out and each
        receive be posted (as a count of retired steps), and which sends must have
        completed before a receive or a step's local work overwrites their data."""
        spans = [_Spans(n or 0) for n in self.lengths]
        send_ready, recv_ready, recv_waits = [], [], []
        self.step_send_waits = []
        self.step_recvs = []
        self.send_list, self.recv_list = [], []
        for i, (sends, recvs, local) in enumerate(self.steps):
            for x in sends:
                peer, v = x
                buf, a, e, _ = self.regions[v]
                j = len(self.send_list)
                ready = 0
                for sp in spans[buf].cover(a, e):
                    ready = max(ready, sp[2] + 1)
                    sp[4].append(j)
                send_ready.append(ready)
                self.send_list.append(x)
            mine = []
            for x in recvs:
                peer, v = x
                buf, a, e, _ = self.regions[v]
                ready, waits = 0, set()
                for sp in spans[buf].cover(a, e):
                    ready = max(ready, sp[2] + 1, sp[3] + 1)
                    waits.update(sp[4])
                    sp[2], sp[3], sp[4] = i, -1, []
                mine.append(len(self.recv_list))
                recv_ready.append(ready)
                recv_waits.append(tuple(sorted(waits)) or ())
                self.recv_list.append(x)
            self.step_recvs.append(tuple(mine) or ())
            waits = set()
            for _, d, s in local:
                sbuf, sa, se, _ = self.regions[s]
                for sp in spans[sbuf].cover(sa, se):
                    sp[3] = max(sp[3], i)
                dbuf, da, de, _ = self.regions[d]
                for sp in spans[dbuf].cover(da, de):
                    waits.update(sp[4])
                    sp[2], sp[3], sp[4] = i, -1, []
            self.step_send_waits.append(tuple(sorted(waits)) or ())
        self.recv_waits = recv_waits
        n = len(self.steps)
        # Sends go out in order: before retiring step i, every send of the longest
        # prefix whose data is final by then.
        self.send_upto = _prefix_upto(send_ready, n)
        # Receives are posted in order, at most RECV_AHEAD beyond the current step's,
        # and never ahead where they would first have to wait for a send.
        first_of_step = []
        k = 0
        for i in range(n):
            first_of_step.append(k)
            k += len(self.step_recvs[i])
        recv_step = [i for i in range(n) for _ in self.step_recvs[i]]
        upto, best, j = [], 0, 0
        for i in range(n):
            must = first_of_step[i] + len(self.step_recvs[i])
            while (j < len(recv_ready) and recv_ready[j] <= i
                   and j < first_of_step[i] + RECV_AHEAD
                   and (not recv_waits[j] or recv_step[j] <= i)):
                j += 1
            best = max(best, j, must)
            upto.append(best)
        self.recv_upto = upto
        #: sends no step waits for: P2PProgram.run waits for them at the end
        waited = {k for ws in self.step_send_waits for k in ws}
        waited.update(k for ws in self.recv_waits for k in ws)
        self.tail_sends = [k for k in range(len(self.send_list)) if k not in waited]
        #: per step, what P2PProgram.run needs, in one tuple
        self.p2p_steps = [(self.send_upto[i], self.recv_upto[i], self.step_recvs[i],
                           self.step_send_waits[i], st[2]) for i, st in enumerate(self.steps)]

    def held_receives(self) -> dict[int, tuple[int, int]]:
        """Receives whose data a transport may leave in the sender's memory until the
        one local step that reads it (a reduction or copy straight from there, no copy
        into scratch first): ``{receive number: (step, index in the step's local
        work)}``.

        A receive qualifies when it lands in scratch and exactly one local step reads
        what it brought: the first local step of the step that waits for it to touch
        that scratch, which reads it whole and writes elsewhere; nothing after reads
        that scratch before a receive or a copy overwrites all of it (a send of it
        would send what was never written there). It must also be the last receive
        from its peer that its step waits for: messages from a peer are taken in
        order, and a later one the step awaits could need the sender's slots the held
        data occupies."""
        if self._held is not None:
            return self._held
        out: dict[int, tuple[int, int]] = {}
        self._held = out
        for i, mine in enumerate(self.step_recvs):
            last_of_peer = {self.recv_list[j][0]: j for j in mine}
            for peer, j in last_of_peer.items():
                v = self.recv_list[j][1]
                if self.regions[v][0] < self.nbuffers:
                    continue
                li = self._sole_reader(i, j, v, mine)
                if li is not None:
                    out[j] = (i, li)
        return out

    def _sole_reader(self, i: int, j: int, v: int, mine: list[int]) -> int | None:
        """The index in step ``i``'s local work of the one step that reads receive
        ``j``'s region ``v``, if that step is the only reader (see
        :meth:`held_receives`)."""
        buf, a, e, _ = self.regions[v]

        def touches(u: int) -> bool:
            b2, a2, e2, _ = self.regions[u]
            return b2 == buf and a2 < e and a < e2 and e2 > a2

        def covers(u: int) -> bool:
            b2, a2, e2, _ = self.regions[u]
            return b2 == buf and a2 <= a and e <= e2

        if any(touches(self.recv_list[k][1]) for k in mine if k != j):
            return None
        local = self.steps[i][2]
        li = next((k for k, (_, d, s) in enumerate(local) if touches(d) or touches(s)), None)
        if li is None or local[li][2] != v or touches(local[li][1]):
            return None
        # what follows, in program order: the rest of step i's local work, then each
        # later step's sends, receives and local work
        later = [("local", op) for op in local[li + 1:]]
        for sends, recvs, work in self.steps[i + 1:]:
            later += [("send", u) for _, u in sends]
            later += [("recv", u) for _, u in recvs]
            later += [("local", op) for op in work]
        for kind, x in later:
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

    @property
    def peers(self) -> list[int]:
        """The ranks this rank exchanges messages with."""
        return sorted({peer for peer, _ in self.send_list} | {peer for peer, _ in self.recv_list})

    def trace_step(self, i: int, start_us: float) -> float:
        """Record step ``i`` (from ``start_us`` to now) in the trace, with its
        messages as ``[peer, elements]``; return now."""
        sends, recvs, _ = self.steps[i]
        end = trace.now()
        trace.complete(f"step {i}", "step", start_us, end,
                       sends=[[p, self._elements(v)] for p, v in sends],
                       recvs=[[p, self._elements(v)] for p, v in recvs])
        return end

    def _elements(self, v: int) -> int:
        _, a, e, _ = self.regions[v]
        return e - a


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
