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
from typing import TYPE_CHECKING, Sequence

from ringcomm.schedule import (Context, Copy, Reduce, Region, Schedule, ShapeNotServed, Step,
                               Xfer, buffer_count, split_even)
from ringcomm.msccl.xmlformat import WHOLE, Program, StepType, ThreadBlock
from ringcomm.msccl.xmlformat import Step as XmlStep

if TYPE_CHECKING:
    from ringcomm.execution.checker import Finding


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
    """One step of one slice of one thread block, as the program plays."""
    gpu: int
    tb: int
    loop: int
    step: XmlStep
    label: str
    phase: int = 0  # 0: not started; 1: received and reduced, its send to come
    temp: list | None = None  # regions of the temporary a fused step reduces into

    @property
    def kind(self) -> StepType:
        return self.step.kind


def translate(program: Program, n: int, seg: int) -> Translation:
    """Every rank's steps for blocks of ``n`` elements (:func:`served_count`) and a
    pipeline segment of ``seg`` elements, made in four stages:

    1. :class:`_Layout`: where MSCCL's buffers lie among ringcomm's, and the slices
       a chunk is cut into;
    2. :func:`_unroll` and :func:`_connections`: every thread block's steps slice
       after slice, and which blocks meet on each connection;
    3. :class:`_Play`: MSCCL's program played in rounds, each round lowered to
       every rank's messages and local work (:class:`_Rounds`);
    4. :func:`_assemble`: the rounds as schedule steps, between the in-place
       set-up and the in-place result's copy.

    Raises:
        ValueError: the program cannot finish, naming the XML's steps that wait.
    """
    lay = _Layout(program, n, seg)
    if lay.total == 0:  # nothing to play: the set-up alone (as empty as the call)
        return _assemble(lay, None)
    ops = _unroll(program, lay.loops)
    rounds = _Play(program, lay, ops, _connections(program)).run()
    return _assemble(lay, rounds)


# -- stage 1: buffers and slices -----------------------------------------------------
class _Layout:
    """Stage 1: a call shape's chunk and slices, and every rank's buffers.

    Takes the program, ``n`` (:func:`served_count`) and the segment; gives
    :attr:`chunk` (elements per chunk), :attr:`loops` slices of it (:attr:`slices`:
    (offset, length) within a chunk), per rank its :class:`_Buffers` (:attr:`bufs`)
    and scratch lengths (:attr:`scratch`, grown by :class:`_Temporaries` later), and
    :meth:`regions`: MSCCL chunks of one slice as ringcomm regions.
    """

    def __init__(self, program: Program, n: int, seg: int):
        p, c = program.ngpus, program.collective
        self.total = n * (1 if c in WHOLE else p)
        self.chunk = self.total // program.nchunksperloop
        self.loops = max(1, min(self.chunk, -(-self.chunk // max(1, seg))))
        self.slices = [(r.off, r.n) for r in split_even(Region(0, 0, self.chunk), self.loops)]
        self.scratch: list[list[int]] = [[] for _ in range(p)]
        self.bufs = [_Buffers(program, g, n, self.chunk, self.scratch[g]) for g in range(p)]

    def regions(self, g: int, letter: str, off: int, cnt: int, loop: int) -> list[Region]:
        """Chunks ``off .. off+cnt`` of rank ``g``'s MSCCL buffer ``letter``, slice
        ``loop`` of each, as ringcomm regions."""
        a, ln = self.slices[loop]
        if self.loops == 1:
            return self.bufs[g].regions(letter, off * self.chunk, cnt * self.chunk)
        out: list[Region] = []
        for k in range(off, off + cnt):
            out.extend(self.bufs[g].regions(letter, k * self.chunk + a, ln))
        return out

    def src(self, op: _Op) -> list[Region]:
        """What ``op``'s ``srcbuf``/``srcoff`` name, in its slice."""
        st = op.step
        return self.regions(op.gpu, st.srcbuf, st.srcoff, st.cnt, op.loop)

    def dst(self, op: _Op) -> list[Region]:
        """What ``op``'s ``dstbuf``/``dstoff`` name, in its slice."""
        st = op.step
        return self.regions(op.gpu, st.dstbuf, st.dstoff, st.cnt, op.loop)


# -- stage 2: thread blocks' steps and connections -------------------------------------
def _unroll(program: Program, loops: int) -> dict[tuple[int, int], collections.deque]:
    """Stage 2a: per (gpu, tb), in gpu and tb order, the block's steps as
    :class:`_Op` s, slice after slice (MSCCL's loop), each labelled with the XML's
    gpu, tb and step (and slice, when there are several)."""
    queues: dict[tuple[int, int], collections.deque] = {}
    for g, gpu in enumerate(program.gpus):
        for tb in gpu.tbs:
            q: collections.deque = collections.deque()
            for j in range(loops):
                for st in tb.steps:
                    where = f"gpu {g} tb {tb.id} step {st.s} ({st.kind})"
                    q.append(_Op(g, tb.id, j, st, where + (f", slice {j}" if loops > 1 else "")))
            queues[g, tb.id] = q
    return queues


@dataclasses.dataclass
class _Connections:
    """Stage 2b's result: every thread block by (gpu, tb), and every connection
    (from, to, channel) with its [sender tb, receiver tb] (None: no such block)."""
    tbs: dict[tuple[int, int], ThreadBlock]
    links: dict[tuple[int, int, int], list]

    def send_link(self, g: int, t: int) -> tuple[int, int, int]:
        """The connection block ``t`` of gpu ``g`` sends on."""
        tb = self.tbs[g, t]
        return (g, tb.send, tb.chan)


def _connections(program: Program) -> _Connections:
    """Stage 2b: which thread blocks meet on each connection (a channel and a pair of
    ranks): the k-th send on it meets its k-th receive."""
    tbs = {(g, tb.id): tb for g, gpu in enumerate(program.gpus) for tb in gpu.tbs}
    links: dict[tuple[int, int, int], list] = {}
    for (g, t), tb in tbs.items():
        if tb.send >= 0:
            links.setdefault((g, tb.send, tb.chan), [None, None])[0] = t
        if tb.recv >= 0:
            links.setdefault((tb.recv, g, tb.chan), [None, None])[1] = t
    return _Connections(tbs, links)


# -- stage 3: the play, round by round -------------------------------------------------
class _Rounds:
    """Stage 3's output: per gpu, per round, the messages, the snapshots that go
    ahead of local work, the local work and the XML steps carried; and every
    region written, with its round (to tell when a posted send's data changed)."""

    def __init__(self, p: int):
        self.p = p
        self.count = 0
        self.sends: list[list[list[Xfer]]] = [[] for _ in range(p)]
        self.recvs: list[list[list[Xfer]]] = [[] for _ in range(p)]
        self.first: list[list[list]] = [[] for _ in range(p)]  # snapshots
        self.local: list[list[list]] = [[] for _ in range(p)]
        self.where: list[list[list[str]]] = [[] for _ in range(p)]
        self.writes: list[list[tuple[int, Region]]] = [[] for _ in range(p)]

    def open(self) -> int:
        """Start the next round on every gpu; its number."""
        for lst in (self.sends, self.recvs, self.first, self.local, self.where):
            for g in range(self.p):
                lst[g].append([])
        self.count += 1
        return self.count - 1

    def wrote(self, g: int, regs: list[Region], rnd: int) -> None:
        self.writes[g].extend((rnd, w) for w in regs)

    def written_since(self, g: int, regs: list[Region], since: int) -> bool:
        return any(r >= since and any(_overlaps(w, x) for x in regs)
                   for r, w in self.writes[g])


class _Temporaries:
    """Scratch buffers a rank borrows for a while (a fused step's reduction, a
    send's snapshot), reused once given back; new ones are added to the rank's
    scratch."""

    def __init__(self, lay: _Layout):
        self.lay = lay
        self.free: list[dict[int, list]] = [collections.defaultdict(list)
                                            for _ in range(len(lay.bufs))]

    def take(self, g: int, length: int, rnd: int) -> list[Region]:
        """A temporary of ``length`` elements on gpu ``g``, free from round ``rnd``."""
        pool = self.free[g][length]
        for i, (ready, buf) in enumerate(pool):
            if ready <= rnd:
                del pool[i]
                return [Region(buf, 0, length)]
        scratch = self.lay.scratch[g]
        scratch.append(length)
        return [Region(self.lay.bufs[g].nbuf + len(scratch) - 1, 0, length)]

    def give_back(self, g: int, regs: list[Region], rnd: int) -> None:
        """``regs`` are free again from the round after ``rnd``."""
        for rg in regs:
            self.free[g][rg.n].append((rnd + 1, rg.buf))


class _Play:
    """Stage 3: MSCCL's program played for every rank at once, in rounds (the
    module's docstring says the rules); :meth:`run` gives the :class:`_Rounds`.

    A round: sends are posted into their connection (:meth:`_post_sends`), each
    connection's next receive meets its oldest send (:meth:`_match_receives`,
    lowered by :meth:`_transfer`), the receives' local work follows
    (:meth:`_complete_receive`), then the local steps whose turn has come
    (:meth:`_run_local_steps`).
    """

    def __init__(self, program: Program, lay: _Layout, queues: dict, conns: _Connections):
        self.lay, self.queues, self.conns = lay, queues, conns
        self.out = _Rounds(program.ngpus)
        self.temps = _Temporaries(lay)
        self.done: dict[tuple[int, int, int, int], int] = {}  # (gpu, tb, slice, s) -> round
        self.last_round: dict[tuple[int, int], int] = {}  # a block's last round (posts aside)
        self.pending: dict[tuple, collections.deque] = {k: collections.deque()
                                                        for k in conns.links}
        self.left = sum(len(q) for q in queues.values())
        self.rnd = 0

    def run(self) -> _Rounds:
        """Play every op. Raises ValueError: nothing can move while ops are left, or
        sends are left that no receive takes."""
        while self.left:
            self.rnd = self.out.open()
            moved = self._post_sends()
            matched = self._match_receives()
            for m in matched:
                self._transfer(*m)
            for m in matched:
                self._complete_receive(m[3])
            moved = self._run_local_steps() or moved or bool(matched)
            if not moved:
                raise ValueError("MSCCL XML: the program cannot finish (a dependency cycle, "
                                 "or a connection's sends and receives in different orders): "
                                 + "; ".join(_stuck(self.queues, self.conns.tbs)))
        unmatched = [f"{e[0].label}" for q in self.pending.values() for e in q]
        if unmatched:
            raise ValueError("MSCCL XML: sends that no receive takes: "
                             + "; ".join(unmatched[:8]))
        return self.out

    # -- when an op may go
    def _dep_done(self, op: _Op, before: int) -> bool:
        st = op.step
        if st.depid < 0:
            return True
        r = self.done.get((op.gpu, st.depid, op.loop, st.deps))
        return r is not None and r < before

    def _ready(self, op: _Op) -> bool:
        """Its block's previous step and its dependency finished in an earlier round."""
        return (self.last_round.get((op.gpu, op.tb), -1) < self.rnd
                and bool(op.phase or self._dep_done(op, self.rnd)))

    def _finish(self, op: _Op) -> None:
        self.done[op.gpu, op.tb, op.loop, op.step.s] = self.rnd
        self.queues[op.gpu, op.tb].popleft()
        self.left -= 1

    # -- the round's parts
    def _post_sends(self) -> bool:
        """Sends complete into their connection (MSCCL's FIFO) once their block is
        there: posted now, they meet their receives in this round or a later one."""
        moved, posted = False, True
        while posted:
            posted = False
            for (g, t), q in self.queues.items():
                while q and (q[0].kind is StepType.SEND or q[0].phase == 1) \
                        and self._ready(q[0]):
                    op = q[0]
                    if op.kind is StepType.SEND:
                        src = self.lay.src(op)
                    elif op.kind is StepType.RECV_REDUCE_SEND:
                        src = op.temp
                    else:  # rcs, rrcs: what was received (and reduced) in place
                        src = self.lay.dst(op)
                    self.pending[self.conns.send_link(g, t)].append((op, self.rnd, src))
                    self._finish(op)
                    posted = moved = True
        return moved

    def _match_receives(self) -> list[tuple]:
        """Each connection's next receive, if ready, meets the oldest send posted on
        it: (send op, its round, its regions, receive op, the regions it writes)."""
        matched = []
        for key in sorted(self.conns.links):
            b, tr = key[1], self.conns.links[key][1]
            if tr is None or not self.pending[key] or not self.queues[b, tr]:
                continue
            r_op = self.queues[b, tr][0]
            if not (r_op.kind.receives and r_op.phase == 0 and self._ready(r_op)):
                continue
            s_op, since, src = self.pending[key].popleft()
            if s_op.step.cnt != r_op.step.cnt:
                raise ValueError(f"MSCCL XML: {s_op.label} sends {s_op.step.cnt} chunks to gpu "
                                 f"{b}, whose matching receive {r_op.label} takes "
                                 f"{r_op.step.cnt}")
            dst = self._receive_place(r_op, sum(x.n for x in src))
            self.out.wrote(b, dst, self.rnd)
            matched.append((s_op, since, src, r_op, dst))
        return matched

    def _receive_place(self, op: _Op, length: int) -> list[Region]:
        """Where a receive lands: its destination, or a temporary for a reduction
        that is sent on (``rrs``) or whose source is its destination."""
        st = op.step
        if not op.kind.reduces:  # r, rcs
            return self.lay.dst(op)
        if op.kind is StepType.RECV_REDUCE_SEND or \
                (st.srcbuf, st.srcoff) == (st.dstbuf, st.dstoff):
            op.temp = self.temps.take(op.gpu, length, self.rnd)
            return op.temp
        return self.lay.dst(op)  # rrc, rrcs into another place: the source is added in

    def _transfer(self, s_op: _Op, since: int, src: list, r_op: _Op, dst: list) -> None:
        """A matched message as both ranks' transfers of this round; sent from a
        snapshot taken in its posting round when its data was overwritten since."""
        a, b, rnd, out = s_op.gpu, r_op.gpu, self.rnd, self.out
        if out.written_since(a, src, since):
            snap = self.temps.take(a, sum(x.n for x in src), since)
            out.first[a][since].extend(Copy(d, s_) for d, s_ in _pair(snap, src))
            self.temps.give_back(a, snap, rnd)
            src = snap
        for x, y in _pair(src, dst):
            out.sends[a][rnd].append(Xfer(b, x))
            out.recvs[b][rnd].append(Xfer(a, y))
        out.where[a][rnd].append(s_op.label)
        out.where[b][rnd].append(r_op.label)
        if s_op.kind is StepType.RECV_REDUCE_SEND:
            self.temps.give_back(a, s_op.temp, rnd)

    def _complete_receive(self, op: _Op) -> None:
        """A receive's local work: its reduction; then its send to come (a later
        round), or the op is done."""
        g, kind = op.gpu, op.kind
        if kind.reduces:
            self._reduce_into(op)
        self.last_round[g, op.tb] = self.rnd
        if kind.sends:
            op.phase = 1
            if kind is not StepType.RECV_REDUCE_SEND and op.temp is not None:
                self.temps.give_back(g, op.temp, self.rnd)
        else:
            if op.temp is not None:
                self.temps.give_back(g, op.temp, self.rnd)
            self._finish(op)

    def _reduce_into(self, op: _Op) -> None:
        src = self.lay.src(op)
        if op.kind is StepType.RECV_REDUCE_SEND:
            pairs = _pair(op.temp, src)
        elif op.temp is not None:  # received into a temporary: dst (== src) += it
            pairs = _pair(self.lay.dst(op), op.temp)
        else:  # received into dst: dst += src
            pairs = _pair(self.lay.dst(op), src)
        self.out.local[op.gpu][self.rnd].extend(Reduce(d, s_) for d, s_ in pairs)
        self.out.wrote(op.gpu, [d for d, _ in pairs], self.rnd)

    def _run_local_steps(self) -> bool:
        """Every ``cpy``, ``re`` and ``nop`` whose turn has come, in an order that
        respects its block and its dependency (one finished this round counts)."""
        moved, changed = False, True
        while changed:
            changed = False
            for (g, t), q in self.queues.items():
                while q and q[0].kind.local and self._dep_done(q[0], self.rnd + 1):
                    op = q[0]
                    if op.kind is not StepType.NOP:
                        dst = self.lay.dst(op)
                        make = Copy if op.kind.copies else Reduce
                        pairs = _pair(dst, self.lay.src(op))
                        self.out.local[g][self.rnd].extend(make(d, s_) for d, s_ in pairs)
                        self.out.wrote(g, dst, self.rnd)
                        self.out.where[g][self.rnd].append(op.label)
                    self._finish(op)
                    changed = moved = True
        return moved


def _stuck(queues: dict, tbs: dict) -> list[str]:
    """What every block that has steps left waits for (at most 8 of them)."""
    out = []
    for (g, t), q in sorted(queues.items()):
        if not q:
            continue
        op = q[0]
        st, tb = op.step, tbs[g, t]
        if op.phase == 1 or op.kind is StepType.SEND:
            why = f"waits to send to gpu {tb.send} (channel {tb.chan})"
        elif op.kind.receives:
            why = f"waits to receive from gpu {tb.recv} (channel {tb.chan})"
        else:
            why = "waits"
        if st.depid >= 0 and op.phase == 0:
            why += f", after tb {st.depid} step {st.deps}"
        out.append(f"{op.label} {why}")
    return out[:8] + ([f"... {len(out) - 8} more"] if len(out) > 8 else [])


# -- stage 4: the schedule steps ------------------------------------------------------
def _assemble(lay: _Layout, rounds: _Rounds | None) -> Translation:
    """Stage 4: per rank, the in-place set-up, then one step per round in which it
    has something to do (snapshots ahead of the local work), then the in-place
    result's copy; ``rounds`` None (an empty call): the set-up alone."""
    p = len(lay.bufs)
    steps: list[list[Step]] = [[] for _ in range(p)]
    origins: list[list[list[str]]] = [[] for _ in range(p)]
    for g in range(p):
        if lay.bufs[g].first:
            steps[g].append(Step((), (), tuple(lay.bufs[g].first)))
            origins[g].append([f"gpu {g}: the in-place set-up"])
    if rounds is None:
        return Translation(steps, lay.scratch, origins, lay.chunk)
    for g in range(p):
        for t in range(rounds.count):
            st = Step(tuple(rounds.sends[g][t]), tuple(rounds.recvs[g][t]),
                      tuple(rounds.first[g][t] + rounds.local[g][t]))
            if st.sends or st.recvs or st.local:
                steps[g].append(st)
                origins[g].append(rounds.where[g][t])
    for g in range(p):
        if lay.bufs[g].last:
            steps[g].append(Step((), (), tuple(lay.bufs[g].last)))
            origins[g].append([f"gpu {g}: the in-place result's copy"])
    return Translation(steps, lay.scratch, origins, lay.chunk)


def schedule_of(tr: Translation, ctx: Context) -> Schedule:
    """Rank ``ctx.rank``'s schedule from a translation."""
    return Schedule(ctx, buffer_count(ctx.collective, ctx.size), tuple(tr.scratch[ctx.rank]),
                    tuple(tr.steps[ctx.rank]))


def explain(message: str, finding: Finding | None, tr: Translation, program: Program) -> str:
    """The checker's ``message`` with what it names in the XML's terms. What is named
    comes from the checker's ``finding`` (:class:`ringcomm.execution.checker.Finding`),
    never parsed out of the message's words.

    A wrong element of an allreduce's, broadcast's or reduce's buffer is given its
    chunk: placed after the words that name the element where the message has them
    (the finding's own ``element_words()``), else at the end. Every rank's step the
    finding names is given the XML's gpu, tb and step it carries. Without a finding
    (not the checker's refusal) the message is returned as it is.
    """
    if finding is None:
        return message
    if (finding.kind == "wrong result" and finding.buffer == 0 and tr.chunk
            and program.collective in WHOLE):  # an element's chunk
        words, k = finding.element_words(), finding.element // tr.chunk
        message = (message.replace(words, f"{words} (chunk {k})", 1) if words in message
                   else f"{message} ({words} is in chunk {k})")
    notes = [f"rank {r} step {i} is {', '.join(tr.origins[r][i]) or 'nothing'}"
             for r, i in finding.steps_named()
             if 0 <= r < len(tr.origins) and 0 <= i < len(tr.origins[r])]
    return message + (f" (in the XML: {'; '.join(dict.fromkeys(notes))})" if notes else "")


def counts(program: Program) -> Sequence[int]:
    """Steps per gpu (nops included)."""
    return [sum(len(tb.steps) for tb in gpu.tbs) for gpu in program.gpus]
