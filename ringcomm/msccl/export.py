"""Any registered schedule as MSCCL XML: one element per chunk, one thread block per
peer and direction (and one for local work), and dependencies that keep every
read and write in the order the schedule gives them.

For ``nchunksperloop`` chunks the schedules are built with one element per chunk,
so their regions are chunk ranges. A rank's thread blocks are: one for its local
work (``cpy``, ``re``), one per peer it sends to (``s``) and one per peer it
receives from (``r``). Each step depends on the latest earlier step of every
other block of its gpu that touches the same chunks in a conflicting way (a read
after a write, or a write after a read or a write); the first such dependency
is the step's own, the others go on ``nop`` steps just before it, as
msccl-tools writes them. A send's unused destination fields name where its
receiver puts the data, and a receive's source fields where its sender took
it, as msccl-tools does.
"""
from __future__ import annotations

from typing import Callable

from ringcomm.schedule import Context, Copy, Region, Schedule
from ringcomm.msccl.xmlformat import (COLL_NAMES, WHOLE, Gpu, Program, Step, StepType,
                                      ThreadBlock)

#: MSCCL's runtime takes fewer than this many chunks per step (MSCCL_MAX_COUNT)
MAX_COUNT = 72


def layout(collective: str, size: int, chunks: int) -> tuple:
    """The global layout (as the checker takes it) with one element per chunk."""
    if collective in WHOLE:
        return (chunks,)
    per = chunks // size
    if collective == "alltoall":
        return tuple((per,) * size for _ in range(size))
    return (per,) * size


def _places(collective: str, size: int, chunks: int, sched: Schedule) -> dict[int, tuple]:
    """Buffer id -> (MSCCL buffer, first chunk) of one rank's buffers."""
    per = chunks // size if collective not in WHOLE else chunks
    if collective in WHOLE:
        out = {0: ("i", 0)}
    elif collective == "allgather":
        out = {j: ("o", j * per) for j in range(size)}
        out[size] = ("i", 0)
    elif collective == "reduce_scatter":
        out = {j: ("i", j * per) for j in range(size)}
        out[size] = ("o", 0)
    else:
        out = {j: ("i", j * per) for j in range(size)}
        out.update({size + j: ("o", j * per) for j in range(size)})
    off = 0
    for k, n in enumerate(sched.scratch):
        out[sched.nbuffers + k] = ("s", off)
        off += n
    return out


def program(name: str, collective: str, scheds: list[Schedule], chunks: int) -> Program:
    """The MSCCL program of every rank's schedule ``scheds`` (built with one element
    per chunk, :func:`layout`)."""
    size = len(scheds)
    places = [_places(collective, size, chunks, s) for s in scheds]

    def ref(r: int, rg: Region) -> tuple[str, int, int]:
        letter, base = places[r][rg.buf]
        return letter, base + rg.off, rg.n

    # the k-th send from a to b meets the k-th receive at b from a: pair their places
    sent: dict[tuple[int, int], list] = {}
    for a, s in enumerate(scheds):
        for st in s.steps:
            for x in st.sends:
                sent.setdefault((a, x.peer), []).append(ref(a, x.region))
    taken: dict[tuple[int, int], list] = {}
    for b, s in enumerate(scheds):
        for st in s.steps:
            for x in st.recvs:
                taken.setdefault((x.peer, b), []).append(ref(b, x.region))
    gpus = []
    for r, s in enumerate(scheds):
        gpus.append(_gpu(r, s, ref, sent, taken, collective, size, chunks))
    return Program(name=name, coll=COLL_NAMES[collective], ngpus=size, nchunksperloop=chunks,
                   nchannels=1, proto="Simple", inplace=collective in WHOLE,
                   outofplace=collective not in WHOLE, min_bytes=0, max_bytes=0,
                   gpus=tuple(gpus))


class _Block:
    """One thread block being written: its peers and its steps (attribute dicts,
    their dependencies as (block key, index) lists under ``_deps``)."""

    def __init__(self, send: int, recv: int):
        self.send, self.recv = send, recv
        self.steps: list[dict] = []


class _Blocks:
    """A rank's thread blocks as its steps are added, keyed ``("local", -1)``,
    ``("send", peer)`` or ``("recv", peer)``; each step depends on the latest
    earlier step of every other block that touches the same chunks in a
    conflicting way (a read after a write, a write after a read or a write)."""

    def __init__(self) -> None:
        self.blocks: dict[tuple, _Block] = {}
        self.history: list[tuple] = []  # (block key, step index, letter, lo, hi, writes)

    def add(self, key: tuple, attrs: dict, reads: list, writes: list) -> None:
        """Append step ``attrs`` to block ``key``; it reads and writes the chunk spans
        (letter, lo, hi) ``reads`` and ``writes``."""
        if key not in self.blocks:
            self.blocks[key] = _Block(key[1] if key[0] == "send" else -1,
                                      key[1] if key[0] == "recv" else -1)
        bl = self.blocks[key]
        index = len(bl.steps)
        deps: dict[tuple, int] = {}
        for other, i, letter, lo, hi, wrote in self.history:
            if other == key:
                continue
            for acc, is_write in [(x, False) for x in reads] + [(x, True) for x in writes]:
                if acc[0] == letter and acc[1] < hi and lo < acc[2] and (wrote or is_write):
                    deps[other] = max(deps.get(other, -1), i)
        attrs["_deps"] = sorted(deps.items())
        bl.steps.append(attrs)
        for letter, lo, hi in reads:
            self.history.append((key, index, letter, lo, hi, False))
        for letter, lo, hi in writes:
            self.history.append((key, index, letter, lo, hi, True))


def _span(x: tuple) -> tuple:
    return x[0], x[1], x[1] + x[2]


def _gpu(r: int, sched: Schedule, ref: Callable, sent: dict, taken: dict, collective: str,
         size: int, chunks: int) -> Gpu:
    """Rank ``r``'s ``<gpu>``: its schedule's steps lowered into blocks
    (:func:`_lower`), numbered and given their nops (:func:`_thread_blocks`), with
    the chunk counts of the buffers they use."""
    tbs = _thread_blocks(_lower(r, sched, ref, sent, taken))
    used = {st.srcbuf for tb in tbs for st in tb.steps if st.kind is not StepType.NOP} | \
        {st.dstbuf for tb in tbs for st in tb.steps if st.kind is not StepType.NOP}
    per = chunks if collective in WHOLE else chunks // size
    i_chunks = (chunks if collective in ("reduce_scatter", "alltoall") or collective in WHOLE
                else per)
    o_chunks = (chunks if collective in ("allgather", "alltoall") else per)
    if collective in WHOLE:
        o_chunks = 0  # in place: everything is in i
    return Gpu(r, i_chunks if "i" in used else 0, o_chunks if "o" in used else 0,
               sum(sched.scratch), tbs)


def _lower(r: int, sched: Schedule, ref: Callable, sent: dict, taken: dict) -> _Blocks:
    """Rank ``r``'s steps as MSCCL steps, in order: a send ``s`` and a receive ``r``
    in the block of its peer and direction (the other side's place in the fields it
    does not use), a reduce ``re`` and a copy ``cpy`` in the local block; each cut
    into pieces of fewer than :data:`MAX_COUNT` chunks."""
    out = _Blocks()
    counters: dict[tuple, int] = {}
    for st in sched.steps:
        for kind, xfers in (("send", st.sends), ("recv", st.recvs)):
            for x in xfers:
                pair = (r, x.peer) if kind == "send" else (x.peer, r)
                k = counters.get((kind, pair), 0)
                counters[kind, pair] = k + 1
                mine = ref(r, x.region)
                theirs = (taken if kind == "send" else sent)[pair][k]
                for a in range(0, mine[2], MAX_COUNT - 1):
                    cnt = min(MAX_COUNT - 1, mine[2] - a)
                    m, t = (mine[0], mine[1] + a, cnt), (theirs[0], theirs[1] + a, cnt)
                    src, dst = (m, t) if kind == "send" else (t, m)
                    attrs = {"type": StepType.SEND if kind == "send" else StepType.RECV,
                             "srcbuf": src[0], "srcoff": src[1], "dstbuf": dst[0],
                             "dstoff": dst[1], "cnt": cnt}
                    access = [_span(m)]
                    out.add((kind, x.peer), attrs, access if kind == "send" else [],
                            access if kind == "recv" else [])
        # MSCCL's reduce names no operand order: a src_first Reduce exports as a reduce
        # (the same values, but for which zero's sign MIN and MAX of +0 and -0 keep)
        for op in st.local:
            d, s_ = ref(r, op.dst), ref(r, op.src)
            for a in range(0, d[2], MAX_COUNT - 1):
                cnt = min(MAX_COUNT - 1, d[2] - a)
                dd, ss = (d[0], d[1] + a, cnt), (s_[0], s_[1] + a, cnt)
                attrs = {"type": StepType.COPY if isinstance(op, Copy) else StepType.REDUCE,
                         "srcbuf": ss[0], "srcoff": ss[1], "dstbuf": dd[0], "dstoff": dd[1],
                         "cnt": cnt}
                reads = [_span(ss)] + ([] if isinstance(op, Copy) else [_span(dd)])
                out.add(("local", -1), attrs, reads, [_span(dd)])
    return out


def _thread_blocks(lowered: _Blocks) -> tuple[ThreadBlock, ...]:
    """The blocks numbered (local work, then sends, then receives, by peer), their
    steps numbered by position: of a step's dependencies the first is its own, the
    others go on ``nop`` s just before it; a step that is waited on publishes."""
    blocks = lowered.blocks
    order = sorted(blocks, key=lambda k: ({"local": 0, "send": 1, "recv": 2}[k[0]], k[1]))
    ids = {k: i for i, k in enumerate(order)}
    positions: dict[tuple, list[int]] = {}  # block -> each step's position, nops counted
    for k in order:
        pos, at = [], 0
        for attrs in blocks[k].steps:
            at += max(0, len(attrs["_deps"]) - 1)
            pos.append(at)
            at += 1
        positions[k] = pos
    published = {(ids[o], positions[o][i]) for k in order for attrs in blocks[k].steps
                 for o, i in attrs["_deps"]}
    tbs = []
    for k in order:
        steps: list[Step] = []
        for attrs in blocks[k].steps:
            deps = [(ids[o], positions[o][i]) for o, i in attrs["_deps"]]
            for dep_tb, dep_s in deps[1:]:
                steps.append(Step(len(steps), StepType.NOP, "i", -1, "o", -1, 0, dep_tb, dep_s,
                                  (ids[k], len(steps)) in published))
            own = deps[0] if deps else (-1, -1)
            steps.append(Step(len(steps), attrs["type"], attrs["srcbuf"], attrs["srcoff"],
                              attrs["dstbuf"], attrs["dstoff"], attrs["cnt"], own[0], own[1],
                              (ids[k], len(steps)) in published))
        bl = blocks[k]
        tbs.append(ThreadBlock(ids[k], bl.send, bl.recv, 0, tuple(steps)))
    return tuple(tbs)


def export(collective: str, name: str, build: Callable, size: int, chunks: int,
           seg: int = 1 << 30) -> Program:
    """The MSCCL program of builder ``build`` for ``collective`` on ``size`` ranks."""
    from ringcomm.execution.checker import local_layout

    lay = layout(collective, size, chunks)
    scheds = [build(Context(collective, size, r, local_layout(collective, lay, r, 0), 0, seg))
              for r in range(size)]
    return program(name, collective, scheds, chunks)
