"""MSCCL's algorithm XML as data: read (with every check MSCCL's runtime makes, and
the ones it leaves out), and written as msccl-tools writes it.

The format is described, with the source line of each fact, in
docs/msccl-format.md: ``<algo>`` holds one ``<gpu>`` per rank, a gpu holds thread
blocks (``<tb>``), a thread block its ``<step>``s, run in order.
"""
from __future__ import annotations

import dataclasses
import enum
import os
import xml.etree.ElementTree as ET
from typing import Iterable

#: the XML's ``coll`` -> ringcomm's collective (both spellings of reduce-scatter:
#: msccl-tools' MSCCLang writes ``reducescatter``, its older releases and its
#: synthesizer ``reduce_scatter``)
COLLECTIVES = {"allreduce": "allreduce", "allgather": "allgather",
               "reducescatter": "reduce_scatter", "reduce_scatter": "reduce_scatter",
               "alltoall": "alltoall", "broadcast": "broadcast", "reduce": "reduce"}
#: ringcomm's collective -> the ``coll`` written on export (MSCCL's runtime reads these)
COLL_NAMES = {"allreduce": "allreduce", "allgather": "allgather",
              "reduce_scatter": "reducescatter", "alltoall": "alltoall",
              "broadcast": "broadcast", "reduce": "reduce"}
#: collectives whose buffers are one block, not one per rank
WHOLE = frozenset({"allreduce", "broadcast", "reduce"})
class StepType(str, enum.Enum):
    """A ``<step>``'s ``type``: what the step receives, does locally and sends
    (msccl-tools' ``Instruction`` names). A member is the XML's spelling too
    (``StepType.SEND == "s"``), so it is written as it is read."""
    SEND = "s"
    RECV = "r"
    RECV_COPY_SEND = "rcs"
    RECV_REDUCE_SEND = "rrs"
    RECV_REDUCE_COPY = "rrc"
    RECV_REDUCE_COPY_SEND = "rrcs"
    COPY = "cpy"
    REDUCE = "re"
    NOP = "nop"

    def __str__(self) -> str:
        return self.value

    @property
    def receives(self) -> bool:
        """It takes a message from its thread block's ``recv`` peer."""
        return self in _RECEIVING

    @property
    def sends(self) -> bool:
        """It gives a message to its thread block's ``send`` peer."""
        return self in _SENDING

    @property
    def reduces(self) -> bool:
        """Its local work is a reduction (of what it received, or ``re``'s source)."""
        return self in _REDUCING

    @property
    def copies(self) -> bool:
        """Its local work is a copy (``cpy``)."""
        return self is StepType.COPY

    @property
    def local(self) -> bool:
        """It has no message: ``cpy``, ``re`` and ``nop``."""
        return not (self.receives or self.sends)

    @property
    def uses_src(self) -> bool:
        """Its ``srcbuf``/``srcoff`` name data of its own rank: what a send sends, what
        a reduction or copy reads (the others' hold the sender's side, or nothing)."""
        return self is StepType.SEND or self.reduces or self.copies

    @property
    def uses_dst(self) -> bool:
        """Its ``dstbuf``/``dstoff`` name data of its own rank that it writes (a send's
        and ``rrs``'s hold the receiver's side, or nothing)."""
        return self not in (StepType.SEND, StepType.RECV_REDUCE_SEND, StepType.NOP)


_RECEIVING = frozenset({StepType.RECV, StepType.RECV_COPY_SEND, StepType.RECV_REDUCE_SEND,
                        StepType.RECV_REDUCE_COPY, StepType.RECV_REDUCE_COPY_SEND})
_SENDING = frozenset({StepType.SEND, StepType.RECV_COPY_SEND, StepType.RECV_REDUCE_SEND,
                      StepType.RECV_REDUCE_COPY_SEND})
_REDUCING = frozenset({StepType.RECV_REDUCE_SEND, StepType.RECV_REDUCE_COPY,
                       StepType.RECV_REDUCE_COPY_SEND, StepType.REDUCE})

BUFFERS = ("i", "o", "s")
PROTOCOLS = ("Simple", "LL", "LL128")
_ALGO_ATTRS = ("name", "proto", "nchannels", "nchunksperloop", "ngpus", "coll", "inplace",
               "outofplace", "minBytes", "maxBytes")
_STEP_ATTRS = ("s", "type", "srcbuf", "srcoff", "dstbuf", "dstoff", "cnt", "depid", "deps",
               "hasdep")


@dataclasses.dataclass(frozen=True)
class Step:
    """One ``<step>``: ``cnt`` chunks from ``srcbuf[srcoff]`` and/or to
    ``dstbuf[dstoff]``; it waits for step ``deps`` of thread block ``depid`` (-1: none)
    and publishes its completion when ``hasdep``. ``type`` is a :class:`StepType` as
    :func:`parse` reads it (or its spelling, as a caller may write it); :attr:`kind`
    is always the member."""
    s: int
    type: str
    srcbuf: str
    srcoff: int
    dstbuf: str
    dstoff: int
    cnt: int
    depid: int = -1
    deps: int = -1
    hasdep: bool = False

    @property
    def kind(self) -> StepType:
        """Its type as a :class:`StepType` (ValueError: not one)."""
        return StepType(self.type)


@dataclasses.dataclass(frozen=True)
class ThreadBlock:
    """One ``<tb>``: its steps in order; it sends to ``send`` and receives from ``recv``
    (-1: no peer) on channel ``chan``."""
    id: int
    send: int
    recv: int
    chan: int
    steps: tuple[Step, ...]


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One ``<gpu>``: a rank's thread blocks; ``s_chunks`` sizes its scratch."""
    id: int
    i_chunks: int
    o_chunks: int
    s_chunks: int
    tbs: tuple[ThreadBlock, ...]


@dataclasses.dataclass(frozen=True)
class Program:
    """A whole ``<algo>``.

    Attributes:
        name: its ``name``.
        coll: its ``coll`` as written; :attr:`collective` is ringcomm's name for it.
        ngpus: the world size it is written for.
        nchunksperloop: chunks of the full-size buffer (the input of allreduce,
            reduce-scatter and alltoall, the output of allgather).
        nchannels, proto, min_bytes, max_bytes: read and kept (MSCCL's runtime picks
            the algorithm by the byte range, 0 as maximum meaning none).
        inplace, outofplace: the calls it serves.
        gpus: one per rank, in rank order.
    """
    name: str
    coll: str
    ngpus: int
    nchunksperloop: int
    nchannels: int
    proto: str
    inplace: bool
    outofplace: bool
    min_bytes: int
    max_bytes: int
    gpus: tuple[Gpu, ...]

    @property
    def collective(self) -> str:
        return COLLECTIVES[self.coll]

    @property
    def root(self) -> int | None:
        """The root of a broadcast (the one rank that receives nothing) or a reduce (the
        one that sends nothing), which the XML does not state; None for the others."""
        if self.collective not in ("broadcast", "reduce"):
            return None
        what = "receives" if self.collective == "broadcast" else "sends"
        quiet = [g.id for g in self.gpus
                 if not any(getattr(st.kind, what) for tb in g.tbs for st in tb.steps)]
        return quiet[0] if len(quiet) == 1 else 0 if self.ngpus == 1 else -1

    def chunks(self, buf: str) -> int:
        """Chunks of buffer ``buf`` (``i``/``o``; ``s`` is per gpu): the full-size
        buffer has :attr:`nchunksperloop`, allgather's input and reduce-scatter's
        output one rank's share of it."""
        c, p = self.nchunksperloop, self.ngpus
        if (self.collective, buf) in (("allgather", "i"), ("reduce_scatter", "o")):
            return c // p
        return c


def _where(gpu: int | None = None, tb: int | None = None, step: int | None = None) -> str:
    parts = [f"gpu {gpu}" if gpu is not None else None, f"tb {tb}" if tb is not None else None,
             f"step {step}" if step is not None else None]
    return " ".join(p for p in parts if p)


def _int(el: ET.Element, attr: str, where: str, default: int | None = None) -> int:
    raw = el.get(attr)
    if raw is None:
        if default is not None:
            return default
        raise ValueError(f"MSCCL XML: {where}: <{el.tag}> has no {attr}=")
    try:
        return int(raw, 0)  # as MSCCL's runtime reads numbers: strtol, base 0
    except ValueError:
        raise ValueError(f"MSCCL XML: {where}: {attr}={raw!r} is not an integer") from None


def _text(source: str | os.PathLike) -> str:
    if isinstance(source, os.PathLike) or not str(source).lstrip().startswith("<"):
        try:
            with open(source, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"MSCCL XML: cannot read {source}: {e.strerror}") from None
    return str(source)


def parse(source: str | os.PathLike) -> Program:
    """Read an algorithm from a path or from XML text and check it on its own terms.

    Raises:
        ValueError: not MSCCL XML, or wrong, naming the gpu, tb and step at fault:
            an unknown ``coll`` or step type, ranks missing or doubled, thread blocks
            not numbered 0.., steps not numbered by position, peers outside the world
            or the gpu itself, a step whose peer its tb lacks, chunks outside their
            buffer, a dependency on a step that does not exist or does not publish
            (``hasdep``), or two thread blocks of a gpu on one connection.
    """
    text = _text(source)
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise ValueError(f"MSCCL XML: not well-formed XML: {e}") from None
    if root.tag != "algo":
        raise ValueError(f"MSCCL XML: the first element is <{root.tag}>, expected <algo>")
    where = "<algo>"
    coll = root.get("coll")
    if coll not in COLLECTIVES:
        raise ValueError(f"MSCCL XML: coll={coll!r} is not served; ringcomm runs "
                         f"{', '.join(sorted(COLLECTIVES))}")
    ngpus = _int(root, "ngpus", where)
    chunks = _int(root, "nchunksperloop", where)
    if ngpus < 1 or chunks < 1:
        raise ValueError(f"MSCCL XML: ngpus={ngpus} and nchunksperloop={chunks} must be at "
                         "least 1")
    collective = COLLECTIVES[coll]
    if collective not in WHOLE and chunks % ngpus:
        raise ValueError(f"MSCCL XML: {coll} splits its buffers among ranks: nchunksperloop="
                         f"{chunks} must be a multiple of ngpus={ngpus}")
    proto = root.get("proto", "Simple")
    if proto not in PROTOCOLS:
        raise ValueError(f"MSCCL XML: proto={proto!r} must be one of {', '.join(PROTOCOLS)}")
    inplace = bool(_int(root, "inplace", where, 0))
    program = Program(
        name=root.get("name", ""), coll=coll, ngpus=ngpus, nchunksperloop=chunks,
        nchannels=_int(root, "nchannels", where, 1), proto=proto, inplace=inplace,
        outofplace=bool(_int(root, "outofplace", where, 0 if inplace else 1)),
        min_bytes=_int(root, "minBytes", where, 0), max_bytes=_int(root, "maxBytes", where, 0),
        gpus=())
    gpus: dict[int, Gpu] = {}
    for g_el in root:
        if g_el.tag != "gpu":
            continue  # as MSCCL's runtime: other elements are skipped
        gid = _int(g_el, "id", "<gpu>")
        if not 0 <= gid < ngpus:
            raise ValueError(f"MSCCL XML: gpu {gid} is outside ngpus={ngpus}")
        if gid in gpus:
            raise ValueError(f"MSCCL XML: gpu {gid} appears twice")
        gpus[gid] = _gpu(g_el, gid, program)
    missing = sorted(set(range(ngpus)) - set(gpus))
    if missing:
        raise ValueError(f"MSCCL XML: ngpus={ngpus}, but gpus {missing} have no <gpu>")
    program = dataclasses.replace(program, gpus=tuple(gpus[g] for g in range(ngpus)))
    if program.root == -1:
        what = "receives" if collective == "broadcast" else "sends"
        raise ValueError(f"MSCCL XML: a {coll} names no root: exactly one gpu must be the "
                         f"one that {what} nothing")
    return program


def _gpu(el: ET.Element, gid: int, program: Program) -> Gpu:
    where = _where(gid)
    s_chunks = _int(el, "s_chunks", where, 0)
    if s_chunks < 0:
        raise ValueError(f"MSCCL XML: {where}: s_chunks={s_chunks} is negative")
    tbs: dict[int, ThreadBlock] = {}
    for t_el in el:
        if t_el.tag != "tb":
            continue
        tid = _int(t_el, "id", where)
        if tid in tbs:
            raise ValueError(f"MSCCL XML: {_where(gid, tid)} appears twice")
        send, recv = _int(t_el, "send", _where(gid, tid)), _int(t_el, "recv", _where(gid, tid))
        for what, peer in (("send", send), ("recv", recv)):
            if peer != -1 and not (0 <= peer < program.ngpus and peer != gid):
                raise ValueError(f"MSCCL XML: {_where(gid, tid)}: {what}={peer} is not another "
                                 f"rank of ngpus={program.ngpus} (or -1)")
        chan = _int(t_el, "chan", _where(gid, tid), 0)
        if not 0 <= chan < program.nchannels:
            raise ValueError(f"MSCCL XML: {_where(gid, tid)}: chan={chan} is outside "
                             f"nchannels={program.nchannels}")
        steps = [_step(s_el, gid, tid, i, send, recv, program, s_chunks)
                 for i, s_el in enumerate(x for x in t_el if x.tag == "step")]
        tbs[tid] = ThreadBlock(tid, send, recv, chan, tuple(steps))
    if sorted(tbs) != list(range(len(tbs))):
        raise ValueError(f"MSCCL XML: {where}: thread blocks are numbered {sorted(tbs)}; they "
                         "must run 0, 1, ... without a gap")
    for what in ("send", "recv"):
        seen: dict[tuple, int] = {}
        for tb in tbs.values():
            peer = getattr(tb, what)
            uses = any(st.kind.sends if what == "send" else st.kind.receives
                       for st in tb.steps)
            if peer < 0 or not uses:
                continue
            other = seen.setdefault((peer, tb.chan), tb.id)
            if other != tb.id:
                raise ValueError(f"MSCCL XML: {where}: tb {other} and tb {tb.id} both {what} "
                                 f"{'to' if what == 'send' else 'from'} gpu {peer} on channel "
                                 f"{tb.chan}: their messages would share one connection in "
                                 "no defined order")
    for tb in tbs.values():
        for st in tb.steps:
            if st.depid < 0:
                continue
            at = _where(gid, tb.id, st.s)
            target = tbs.get(st.depid)
            if target is None or not 0 <= st.deps < len(target.steps):
                raise ValueError(f"MSCCL XML: {at}: depends on tb {st.depid} step {st.deps}, "
                                 "which does not exist")
            if not target.steps[st.deps].hasdep and st.depid != tb.id:
                raise ValueError(f"MSCCL XML: {at}: depends on tb {st.depid} step {st.deps}, "
                                 "which does not publish its completion (hasdep=0): the wait "
                                 "would never end")
    return Gpu(gid, _int(el, "i_chunks", where, 0), _int(el, "o_chunks", where, 0), s_chunks,
               tuple(tbs[i] for i in range(len(tbs))))


def _step(el: ET.Element, gid: int, tid: int, pos: int, send: int, recv: int,
          program: Program, s_chunks: int) -> Step:
    at = _where(gid, tid, pos)
    s = _int(el, "s", at)
    if s != pos:
        raise ValueError(f"MSCCL XML: {at}: s={s}, but it is step {pos} of its tb (steps are "
                         "numbered by position, nops included)")
    raw = el.get("type")
    try:
        kind = StepType(raw)
    except ValueError:
        raise ValueError(f"MSCCL XML: {at}: type={raw!r} is not one of "
                         f"{' '.join(t.value for t in StepType)}") from None
    step = Step(s, kind, el.get("srcbuf", "i"), _int(el, "srcoff", at, -1),
                el.get("dstbuf", "o"), _int(el, "dstoff", at, -1), _int(el, "cnt", at, 0),
                _int(el, "depid", at, -1), _int(el, "deps", at, -1),
                bool(_int(el, "hasdep", at, 0)))
    if kind.sends and send < 0:
        raise ValueError(f"MSCCL XML: {at}: a {kind} step sends, but tb {tid} has send=-1")
    if kind.receives and recv < 0:
        raise ValueError(f"MSCCL XML: {at}: a {kind} step receives, but tb {tid} has recv=-1")
    if kind is StepType.NOP:
        if step.depid < 0:
            raise ValueError(f"MSCCL XML: {at}: a nop carries a dependency, this one none")
        return step
    if step.cnt < 1:
        raise ValueError(f"MSCCL XML: {at}: cnt={step.cnt}; a {kind} step moves at least "
                         "one chunk")
    # the fields each type uses (the others hold the peer's side, or nothing)
    fields = []
    if kind.uses_src:
        fields.append(("src", step.srcbuf, step.srcoff))
    if kind.uses_dst:
        fields.append(("dst", step.dstbuf, step.dstoff))
    for what, buf, off in fields:
        if buf not in BUFFERS:
            raise ValueError(f"MSCCL XML: {at}: {what}buf={buf!r} must be i, o or s")
        size = s_chunks if buf == "s" else program.chunks(buf)
        if off < 0 or off + step.cnt > size:
            raise ValueError(f"MSCCL XML: {at}: chunks {off}..{off + step.cnt - 1} of {buf} "
                             f"({what}off={off}, cnt={step.cnt}) are outside its {size} chunks")
    return step


def _attrs(el_name: str, items: Iterable[tuple[str, object]]) -> str:
    def text(v: object) -> str:
        if isinstance(v, bool):
            return "1" if v else "0"
        return str(v).replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")
    return f"<{el_name} " + " ".join(f'{k}="{text(v)}"' for k, v in items)


def write(program: Program) -> str:
    """The XML text of ``program``, laid out as msccl-tools writes it: attributes in
    its order, each element on one line, two-space indents, no ``<?xml?>`` line (the
    runtime's reader takes none of those liberties)."""
    a = program
    lines = [_attrs("algo", zip(_ALGO_ATTRS, (
        a.name, a.proto, a.nchannels, a.nchunksperloop, a.ngpus, a.coll, a.inplace,
        a.outofplace, a.min_bytes, a.max_bytes))) + ">"]
    for g in a.gpus:
        lines.append("  " + _attrs("gpu", (("id", g.id), ("i_chunks", g.i_chunks),
                                           ("o_chunks", g.o_chunks),
                                           ("s_chunks", g.s_chunks))) + ">")
        for tb in g.tbs:
            lines.append("    " + _attrs("tb", (("id", tb.id), ("send", tb.send),
                                                 ("recv", tb.recv), ("chan", tb.chan))) + ">")
            for st in tb.steps:
                lines.append("      " + _attrs("step", zip(_STEP_ATTRS, (
                    st.s, st.type, st.srcbuf, st.srcoff, st.dstbuf, st.dstoff, st.cnt,
                    st.depid, st.deps, st.hasdep))) + "/>")
            lines.append("    </tb>")
        lines.append("  </gpu>")
    lines.append("</algo>")
    return "\n".join(lines) + "\n"
