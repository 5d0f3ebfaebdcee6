"""An MSCCL program as ringcomm schedules: one run of MSCCL's semantics, played out
for every rank at once, written down as each rank's steps.

MSCCL runs a rank's thread blocks side by side, each through its steps in order;
a step may wait for a step of another block (``depid``/``deps``), and the k-th
send of a connection (a channel and a pair of ranks) meets its k-th receive.
ringcomm runs a rank's steps one after another: a step's messages progress
together, then its local work. The translation plays MSCCL's program in rounds:

* a round's messages are every send that meets its receive while both ends are
  ready (their thread block's previous step and their dependency finished in an
  earlier round), so a message's two ends are in the same round on both ranks,
  and no round waits for one that comes after it;
* a round's local work follows: the reductions of the fused steps whose receive
  was in the round (``rrc``, ``rrcs``, ``rrs``), then every local step (``cpy``,
  ``re``, ``nop``) whose turn has come, in an order that respects its block and
  its dependency;
* a fused step that sends what it received (``rcs``, ``rrcs``, ``rrs``) sends it
  in a later round.

A round becomes one step of every rank's schedule. MSCCL's loops (a chunk
processed in slices, the program run once per slice) are kept: with the group's
pipeline segment smaller than a chunk, each chunk is cut into slices of at most
a segment, and a block runs its steps slice after slice, so one slice is reduced
while the next arrives. A program that can never finish (a dependency cycle,
sends and receives of a connection in different orders or sizes) is refused
here, naming the XML's gpu, tb and step.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Sequence

from ringcomm.schedule import (Context, Copy, Reduce, Region, Schedule, ShapeNotServed, Step,
                               Xfer, buffer_count, split_even)
from ringcomm.msccl.xmlformat import STEP_TYPES, WHOLE, Program


@dataclasses.dataclass
class Translation:
    """Every rank's steps for one call shape, and where each step came from.

    Attributes:
        steps: per rank, its steps.
        scratch: per rank, its scratch buffers' lengths.
        origins: per rank, per step, the XML steps it carries (``gpu 0 tb 1 step 2
            (rrcs)``, with the slice when there are several).
        chunk: elements per chunk.
    """
    steps: list[list[Step]]
    scratch: list[list[int]]
    origins: list[list[list[str]]]
    chunk: int


def served_count(program: Program, ctx: Context) -> int:
    """The elements per rank of a call, in the unit the XML's chunks divide: the
    allreduce buffer, or one rank's block of the others.

    Raises:
        ShapeNotServed: another world size than ``ngpus``, blocks of unequal sizes, or
            a count the chunks do not divide (the message names the multiple needed).
    """
    p, c = program.ngpus, program.collective
    if ctx.size != p:
        raise ShapeNotServed(f"MSCCL algorithm {program.name!r} is written for ngpus={p} "
                             f"ranks; this group has {ctx.size}")
    if program.root is not None and ctx.root != program.root:
        raise ShapeNotServed(f"MSCCL algorithm {program.name!r} is a {c} from root "
                             f"{program.root} (the rank that "
                             f"{'receives' if c == 'broadcast' else 'sends'} nothing); this "
                             f"call's root is {ctx.root}")
    lay = ctx.layout
    if c in WHOLE:
        counts = [lay[0]]
    elif c == "alltoall":
        counts = [*lay[0], *lay[1]]
    else:
        counts = list(lay)
    if len(set(counts)) > 1:
        raise ShapeNotServed(f"MSCCL algorithm {program.name!r} ({c}) needs every rank's "
                             f"block of the same size; got sizes {sorted(set(counts))}")
    n = counts[0]
    per = program.nchunksperloop if c in WHOLE else program.nchunksperloop // p
    if n % per:
        what = "elements" if c in WHOLE else "elements per rank"
        raise ShapeNotServed(f"MSCCL algorithm {program.name!r} cuts the buffer into "
                             f"{program.nchunksperloop} chunks: {c} needs a multiple of "
                             f"{per} {what}, got {n}")
    return n


class _Buffers:
    """Where MSCCL's ``i``, ``o`` and ``s`` lie among a rank's ringcomm buffers."""

    def __init__(self, program: Program, rank: int, n: int, chunk: int, scratch: list[int]):
        p, c = program.ngpus, program.collective
        self.nbuf = buffer_count(c, p)
        self.first: list[tuple] = []  # local work before the program (in-place set-up)
        self.last: list[tuple] = []  # and after it
        self.blocks: dict[str, tuple[int, list[int]]] = {}  # letter -> (block size, bufs)

        def fresh(size: int) -> int:
            scratch.append(size)
            return self.nbuf + len(scratch) - 1

        if c in WHOLE:
            self.blocks["o"] = (n, [0])
            if program.inplace:
                self.blocks["i"] = (n, [0])
            else:  # the input is read after the output was written: a copy of it
                x = fresh(n)
                self.first.append(Copy(Region(x, 0, n), Region(0, 0, n)))
                self.blocks["i"] = (n, [x])
        elif c == "allgather":
            self.blocks["o"] = (n, list(range(p)))
            if program.inplace:  # the input is this rank's block of the output
                self.first.append(Copy(Region(rank, 0, n), Region(p, 0, n)))
                self.blocks["i"] = (n, [rank])
            else:
                self.blocks["i"] = (n, [p])
        elif c == "reduce_scatter":
            self.blocks["i"] = (n, list(range(p)))  # ringcomm lets it be overwritten
            if program.inplace:  # the result is left in this rank's block of the input
                self.blocks["o"] = (n, [rank])
                self.last.append(Copy(Region(p, 0, n), Region(rank, 0, n)))
            else:
                self.blocks["o"] = (n, [p])
        else:  # alltoall: the send blocks stay untouched, as torch's contract says
            if program.inplace:
                for j in range(p):
                    self.first.append(Copy(Region(p + j, 0, n), Region(j, 0, n)))
                self.blocks["i"] = self.blocks["o"] = (n, [p + j for j in range(p)])
            else:
                self.blocks["i"] = (n, list(range(p)))
                self.blocks["o"] = (n, [p + j for j in range(p)])
        s_chunks = program.gpus[rank].s_chunks
        if s_chunks:
            self.blocks["s"] = (s_chunks * chunk, [fresh(s_chunks * chunk)])

    def regions(self, letter: str, start: int, length: int) -> list[Region]:
        """Elements ``start .. start+length`` of MSCCL buffer ``letter``, as ringcomm
        regions (one per block they touch)."""
        size, bufs = self.blocks[letter]
        out, end = [], start + length
        while start < end:
            k, off = divmod(start, size)
            take = min(end - start, size - off)
            out.append(Region(bufs[k], off, take))
            start += take
        return out


def _cut(regions: list[Region], cuts: list[int]) -> list[Region]:
    """``regions`` (back to back) cut at the relative offsets ``cuts`` too."""
    out, pos = [], 0
    for rg in regions:
        a = 0
        for c in cuts:
            if pos < c < pos + rg.n and c - pos > a:
                out.append(Region(rg.buf, rg.off + a, c - pos - a))
                a = c - pos
        out.append(Region(rg.buf, rg.off + a, rg.n - a))
        pos += rg.n
    return out


def _bounds(regions: list[Region]) -> list[int]:
    out, pos = [], 0
    for rg in regions:
        pos += rg.n
        out.append(pos)
    return out


def _overlaps(a: Region, b: Region) -> bool:
    return a.buf == b.buf and a.off < b.off + b.n and b.off < a.off + a.n


def _pair(a: list[Region], b: list[Region]) -> list[tuple[Region, Region]]:
    """Equal-length region lists cut alike, piece by piece."""
    cuts = sorted(set(_bounds(a)) | set(_bounds(b)))
    return list(zip(_cut(a, cuts), _cut(b, cuts)))


@dataclasses.dataclass
class _Op:
    """One step of one slice of one thread block."""
    gpu: int
    tb: int
    loop: int
    step: object  # xmlformat.Step
    label: str
    phase: int = 0  # 0: not started; 1: received and reduced, its send to come
    temp: list | None = None  # regions of the temporary a fused step reduces into


def translate(program: Program, n: int, seg: int) -> Translation:
    """Every rank's steps for blocks of ``n`` elements (:func:`served_count`) and a
    pipeline segment of ``seg`` elements.

    Raises:
        ValueError: the program cannot finish, naming the XML's steps that wait.
    """
    p, c = program.ngpus, program.collective
    total = n * (1 if c in WHOLE else p)
    chunk = total // program.nchunksperloop
    loops = max(1, min(chunk, -(-chunk // max(1, seg))))
    slices = [(r.off, r.n) for r in split_even(Region(0, 0, chunk), loops)]
    scratch: list[list[int]] = [[] for _ in range(p)]
    bufs = [_Buffers(program, g, n, chunk, scratch[g]) for g in range(p)]
    steps: list[list[Step]] = [[] for _ in range(p)]
    origins: list[list[list[str]]] = [[] for _ in range(p)]
    for g in range(p):
        if bufs[g].first:
            steps[g].append(Step((), (), tuple(bufs[g].first)))
            origins[g].append([f"gpu {g}: the in-place set-up"])
    if total == 0:
        return Translation(steps, scratch, origins, chunk)

    def regions(g: int, letter: str, off: int, cnt: int, loop: int) -> list[Region]:
        a, ln = slices[loop]
        if loops == 1:
            return bufs[g].regions(letter, off * chunk, cnt * chunk)
        out: list[Region] = []
        for k in range(off, off + cnt):
            out.extend(bufs[g].regions(letter, k * chunk + a, ln))
        return out

    # every thread block's ops: its steps, slice after slice
    queues: dict[tuple[int, int], collections.deque] = {}
    for g, gpu in enumerate(program.gpus):
        for tb in gpu.tbs:
            q = collections.deque()
            for j in range(loops):
                for st in tb.steps:
                    where = f"gpu {g} tb {tb.id} step {st.s} ({st.type})"
                    q.append(_Op(g, tb.id, j, st, where + (f", slice {j}" if loops > 1 else "")))
            queues[g, tb.id] = q
    tbs = {(g, tb.id): tb for g, gpu in enumerate(program.gpus) for tb in gpu.tbs}
    links: dict[tuple[int, int, int], list] = {}  # (from, to, chan) -> [sender tb, receiver tb]
    for (g, t), tb in tbs.items():
        if tb.send >= 0:
            links.setdefault((g, tb.send, tb.chan), [None, None])[0] = t
        if tb.recv >= 0:
            links.setdefault((tb.recv, g, tb.chan), [None, None])[1] = t
    done: dict[tuple[int, int, int, int], int] = {}  # (gpu, tb, slice, s) -> round
    free: list[dict[int, list]] = [collections.defaultdict(list) for _ in range(p)]

    def dep_done(op: _Op, before: int) -> bool:
        st = op.step
        if st.depid < 0:
            return True
        r = done.get((op.gpu, st.depid, op.loop, st.deps))
        return r is not None and r < before

    def finish(op: _Op, rnd: int) -> None:
        done[op.gpu, op.tb, op.loop, op.step.s] = rnd
        queues[op.gpu, op.tb].popleft()

    def temp(g: int, length: int, rnd: int) -> list[Region]:
        pool = free[g][length]
        for i, (ready, buf) in enumerate(pool):
            if ready <= rnd:
                del pool[i]
                return [Region(buf, 0, length)]
        scratch[g].append(length)
        return [Region(bufs[g].nbuf + len(scratch[g]) - 1, 0, length)]

    def release(g: int, regs: list[Region], rnd: int) -> None:
        for rg in regs:
            free[g][rg.n].append((rnd + 1, rg.buf))

    last_round: dict[tuple[int, int], int] = {}  # a block's last round (posts aside)
    pending: dict[tuple, collections.deque] = {k: collections.deque() for k in links}
    writes: list[list[tuple[int, Region]]] = [[] for _ in range(p)]  # (round, region)
    out_sends: list[list[list[Xfer]]] = [[] for _ in range(p)]  # per gpu, per round
    out_recvs: list[list[list[Xfer]]] = [[] for _ in range(p)]
    out_first: list[list[list]] = [[] for _ in range(p)]  # snapshots, ahead of local work
    out_local: list[list[list]] = [[] for _ in range(p)]
    out_where: list[list[list[str]]] = [[] for _ in range(p)]

    def written_since(g: int, regs: list[Region], since: int) -> bool:
        return any(r >= since and any(_overlaps(w, x) for x in regs) for r, w in writes[g])

    def wrote(g: int, regs: list[Region], rnd: int) -> None:
        writes[g].extend((rnd, w) for w in regs)

    def link_of(g: int, t: int, what: str) -> tuple:
        tb = tbs[g, t]
        return (g, tb.send, tb.chan) if what == "send" else (tb.recv, g, tb.chan)

    rnd, left = 0, sum(len(q) for q in queues.values())
    while left:
        for lst in (out_sends, out_recvs, out_first, out_local, out_where):
            for g in range(p):
                lst[g].append([])
        moved = False

        def ready(op: _Op) -> bool:
            return last_round.get((op.gpu, op.tb), -1) < rnd and (op.phase or dep_done(op, rnd))

        # -- sends complete into their connection (MSCCL's FIFO) once their block is
        # there: posted now, they meet their receives in this round or a later one
        posted = True
        while posted:
            posted = False
            for (g, t), q in queues.items():
                while q and (q[0].step.type == "s" or q[0].phase == 1) and ready(q[0]):
                    op, st = q[0], q[0].step
                    if st.type == "s":
                        src = regions(g, st.srcbuf, st.srcoff, st.cnt, op.loop)
                    elif st.type == "rrs":
                        src = op.temp
                    else:  # rcs, rrcs: what was received (and reduced) in place
                        src = regions(g, st.dstbuf, st.dstoff, st.cnt, op.loop)
                    pending[link_of(g, t, "send")].append((op, rnd, src))
                    finish(op, rnd)
                    left -= 1
                    posted = moved = True
        # -- receives: each connection's next one meets the oldest send posted on it
        matched = []
        for key in sorted(links):
            a, b, chan = key
            tr = links[key][1]
            if tr is None or not pending[key] or not queues[b, tr]:
                continue
            r_op = queues[b, tr][0]
            if not (STEP_TYPES[r_op.step.type][0] and r_op.phase == 0 and ready(r_op)):
                continue
            s_op, since, src = pending[key].popleft()
            if s_op.step.cnt != r_op.step.cnt:
                raise ValueError(f"MSCCL XML: {s_op.label} sends {s_op.step.cnt} chunks to gpu "
                                 f"{b}, whose matching receive {r_op.label} takes "
                                 f"{r_op.step.cnt}")
            rt = r_op.step
            if rt.type in ("r", "rcs"):
                dst = regions(b, rt.dstbuf, rt.dstoff, rt.cnt, r_op.loop)
            elif rt.type == "rrs" or (rt.srcbuf, rt.srcoff) == (rt.dstbuf, rt.dstoff):
                dst = r_op.temp = temp(b, sum(x.n for x in src), rnd)
            else:  # rrc, rrcs into another place: receive there, reduce the source in
                dst = regions(b, rt.dstbuf, rt.dstoff, rt.cnt, r_op.loop)
            wrote(b, dst, rnd)
            matched.append((s_op, since, src, r_op, dst))
        for s_op, since, src, r_op, dst in matched:
            a, b = s_op.gpu, r_op.gpu
            if written_since(a, src, since):
                # overwritten since it was sent: the data as it was then, kept aside
                snap = temp(a, sum(x.n for x in src), since)
                out_first[a][since].extend(Copy(d, s_) for d, s_ in _pair(snap, src))
                release(a, snap, rnd)
                src = snap
            for x, y in _pair(src, dst):
                out_sends[a][rnd].append(Xfer(b, x))
                out_recvs[b][rnd].append(Xfer(a, y))
            out_where[a][rnd].append(s_op.label)
            out_where[b][rnd].append(r_op.label)
            if s_op.step.type == "rrs":
                release(a, s_op.temp, rnd)
            moved = True

        # -- local work: the reductions of what was received, then local steps
        def reduce_into(op: _Op) -> None:
            st, g = op.step, op.gpu
            src = regions(g, st.srcbuf, st.srcoff, st.cnt, op.loop)
            if st.type == "rrs":
                pairs = _pair(op.temp, src)
            elif op.temp is not None:  # received into a temporary: dst (== src) += it
                pairs = _pair(regions(g, st.dstbuf, st.dstoff, st.cnt, op.loop), op.temp)
            else:  # received into dst: dst += src
                pairs = _pair(regions(g, st.dstbuf, st.dstoff, st.cnt, op.loop), src)
            out_local[g][rnd].extend(Reduce(d, s_) for d, s_ in pairs)
            wrote(g, [d for d, _ in pairs], rnd)

        for _, _, _, op, _ in matched:
            g, kind = op.gpu, op.step.type
            if STEP_TYPES[kind][1] == "reduce":
                reduce_into(op)
            last_round[g, op.tb] = rnd
            if STEP_TYPES[kind][2]:  # its send is posted in a later round
                op.phase = 1
                if kind != "rrs" and op.temp is not None:
                    release(g, op.temp, rnd)
            else:
                if op.temp is not None:
                    release(g, op.temp, rnd)
                finish(op, rnd)
                left -= 1
        changed = True
        while changed:
            changed = False
            for (g, t), q in queues.items():
                while q and q[0].step.type in ("cpy", "re", "nop") and dep_done(q[0], rnd + 1):
                    op = q[0]
                    st = op.step
                    if st.type != "nop":
                        dst = regions(g, st.dstbuf, st.dstoff, st.cnt, op.loop)
                        src = regions(g, st.srcbuf, st.srcoff, st.cnt, op.loop)
                        kind = Copy if st.type == "cpy" else Reduce
                        pairs = _pair(dst, src)
                        out_local[g][rnd].extend(kind(d, s_) for d, s_ in pairs)
                        wrote(g, dst, rnd)
                        out_where[g][rnd].append(op.label)
                    finish(op, rnd)
                    left -= 1
                    changed = moved = True
        if not moved:
            raise ValueError("MSCCL XML: the program cannot finish (a dependency cycle, or "
                             "a connection's sends and receives in different orders): "
                             + "; ".join(_stuck(queues, tbs)))
        rnd += 1
    unmatched = [f"{e[0].label}" for q in pending.values() for e in q]
    if unmatched:
        raise ValueError("MSCCL XML: sends that no receive takes: " + "; ".join(unmatched[:8]))
    for g in range(p):
        for t in range(rnd):
            st = Step(tuple(out_sends[g][t]), tuple(out_recvs[g][t]),
                      tuple(out_first[g][t] + out_local[g][t]))
            if st.sends or st.recvs or st.local:
                steps[g].append(st)
                origins[g].append(out_where[g][t])
    for g in range(p):
        if bufs[g].last:
            steps[g].append(Step((), (), tuple(bufs[g].last)))
            origins[g].append([f"gpu {g}: the in-place result's copy"])
    return Translation(steps, scratch, origins, chunk)


def _stuck(queues: dict, tbs: dict) -> list[str]:
    out = []
    for (g, t), q in sorted(queues.items()):
        if not q:
            continue
        op = q[0]
        st, tb = op.step, tbs[g, t]
        if op.phase == 1 or st.type == "s":
            why = f"waits to send to gpu {tb.send} (channel {tb.chan})"
        elif STEP_TYPES[st.type][0]:
            why = f"waits to receive from gpu {tb.recv} (channel {tb.chan})"
        else:
            why = "waits"
        if st.depid >= 0 and op.phase == 0:
            why += f", after tb {st.depid} step {st.deps}"
        out.append(f"{op.label} {why}")
    return out[:8] + ([f"... {len(out) - 8} more"] if len(out) > 8 else [])


def schedule_of(tr: Translation, ctx: Context) -> Schedule:
    """Rank ``ctx.rank``'s schedule from a translation."""
    return Schedule(ctx, buffer_count(ctx.collective, ctx.size), tuple(tr.scratch[ctx.rank]),
                    tuple(tr.steps[ctx.rank]))


def explain(message: str, tr: Translation, program: Program) -> str:
    """A checker's message about ranks' steps, with the XML's steps they carry."""
    if program.collective in WHOLE and tr.chunk:  # an element's chunk
        message = re.sub(r"(rank \d+ buffer 0 element (\d+))",
                         lambda m: f"{m.group(1)} (chunk {int(m.group(2)) // tr.chunk})", message)
    notes = []
    for m in re.finditer(r"rank (\d+)[^;:()]*?step (\d+)", message):
        r, i = int(m.group(1)), int(m.group(2))
        if r < len(tr.origins) and i < len(tr.origins[r]):
            notes.append(f"rank {r} step {i} is {', '.join(tr.origins[r][i]) or 'nothing'}")
    return message + (f" (in the XML: {'; '.join(dict.fromkeys(notes))})" if notes else "")


def counts(program: Program) -> Sequence[int]:
    """Steps per gpu (nops included)."""
    return [sum(len(tb.steps) for tb in gpu.tbs) for gpu in program.gpus]
