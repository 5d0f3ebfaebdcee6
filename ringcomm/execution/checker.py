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

import dataclasses
from typing import Callable, Sequence

import numpy as np

from ringcomm.schedule import (REDUCING, BuildFn, Context, Copy, Reduce, Region, Schedule,
                               ScheduleError, ShapeNotServed, buffer_lengths)
from ringcomm.execution.nccl_rules import Rules

_UNDEF = -1
_BIG = 1 << 40  # element ids: logical part * _BIG + element index
MAX_RANKS = 62  # contributions are a bitmask in an int64


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


# -- what a refusal says, as data ----------------------------------------------------
#: the kinds of :class:`Finding`
KINDS = frozenset({"builder", "structure", "peer", "size mismatch", "unmatched", "deadlock",
                   "reduce", "wrong result", "barrier", "model"})


@dataclasses.dataclass(frozen=True)
class Finding:
    """What the checker refused, as data: the facts its message gives in words, for
    a caller that relates them to something else (``ringcomm.msccl`` names the XML
    steps that a rank's step carries) without reading the words. A refusal carries
    it (:func:`finding_of`).

    Attributes:
        kind: what is wrong, one of :data:`KINDS`: ``builder`` (it returned no
            Schedule), ``structure`` (:func:`validate` refuses a region, a buffer or a
            local op), ``peer`` (a message to no other rank), ``size mismatch``,
            ``unmatched`` (a message without a partner), ``deadlock`` (steps that wait
            on each other in a cycle), ``reduce`` (a reduction of undefined or different
            data, or counting a rank twice), ``wrong result``, ``barrier`` (a rank leaves
            it early), ``model`` (no symbolic model of the collective).
        rank: the rank at fault (None: no one rank).
        step: the index of its step at fault (None: no one step).
        peer: the other rank of the message at fault.
        peer_step: the index of the peer's step that holds the message's match.
        buffer, element: where ``rank``'s wrong data lies: the element that ends wrong
            (``wrong result``), the destination element reduced (``reduce``).
        more: the report's further entries, of the same kind: the other messages
            without a partner; the rest of a deadlock's cycle (each entry waits for
            the next one's rank, the last for the first's).
    """
    kind: str
    rank: int | None = None
    step: int | None = None
    peer: int | None = None
    peer_step: int | None = None
    buffer: int | None = None
    element: int | None = None
    more: tuple[Finding, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"checker: a finding of unknown kind {self.kind!r}")

    def steps_named(self) -> list[tuple[int, int]]:
        """Every (rank, step index) the finding names, in order: each entry's own
        step, then the peer's step that holds its match."""
        out = []
        for f in (self, *self.more):
            if f.rank is not None and f.step is not None:
                out.append((f.rank, f.step))
            if f.peer is not None and f.peer_step is not None:
                out.append((f.peer, f.peer_step))
        return out

    def element_words(self) -> str:
        """The words that name :attr:`element` in the message (``rank 0 buffer 1
        element 2``)."""
        return f"rank {self.rank} buffer {self.buffer} element {self.element}"


def finding_of(err: BaseException) -> Finding | None:
    """The :class:`Finding` that a refusal of the checker carries; None for any other
    error (a builder's own :class:`~ringcomm.schedule.ShapeNotServed`, say)."""
    return getattr(err, "finding", None)


def _refusal(message: str, finding: Finding | None) -> ScheduleError:
    err = ScheduleError(message)
    err.finding = finding
    return err


class _StepLabel(str):
    """A step's label for NCCL's rules (``step 3``), keeping the step's index: the
    rules' refusals name their steps by label, and the finding reads it back."""

    def __new__(cls, step: int) -> _StepLabel:
        self = super().__new__(cls, f"step {step}")
        self.step = step
        return self


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
              seg: int = 1 << 30, hosts: tuple = ()) -> list[Schedule]:
    """Every rank's schedule for a global ``layout`` (``hosts``: see
    :class:`ringcomm.schedule.Context`)."""
    out = []
    for r in range(size):
        ctx = Context(collective, size, r, local_layout(collective, layout, r, root), root, seg,
                      tuple(hosts))
        s = build(ctx)
        if not isinstance(s, Schedule):
            raise _refusal(f"{collective} builder returned {type(s).__name__} on rank {r}, "
                           "expected a ringcomm.schedule.Schedule", Finding("builder", rank=r))
        out.append(s)
    return out


def validate(s: Schedule) -> None:
    """Structural checks of one rank's schedule.

    Raises:
        ScheduleError: naming the rank, step and region at fault (its finding:
            ``structure``).
    """
    ctx = s.ctx
    lens = buffer_lengths(ctx)
    nb = s.nbuffers + len(s.scratch)
    reducing = ctx.collective in REDUCING

    def refuse(i: int, what: str, peer: int | None = None) -> ScheduleError:
        return _refusal(f"{ctx.collective} rank {ctx.rank} step {i}: {what}",
                        Finding("structure", rank=ctx.rank, step=i, peer=peer))

    def inside(i: int, rg: Region, what: str, peer: int | None = None) -> None:
        if not 0 <= rg.buf < nb:
            raise refuse(i, f"{what} uses buffer {rg.buf}, which does not exist "
                            f"(buffers 0..{nb - 1})", peer)
        ln = s.buffer_len(rg.buf, lens)
        if ln is None:
            raise refuse(i, f"{what} uses buffer {rg.buf}, which rank {ctx.rank} does not "
                            "have", peer)
        if rg.n < 0 or rg.off < 0 or rg.off + rg.n > ln:
            raise refuse(i, f"{what} region {tuple(rg)} is outside buffer {rg.buf} of {ln} "
                            "elements", peer)

    for i, st in enumerate(s.steps):
        for x in st.sends:
            inside(i, x.region, f"send to rank {x.peer}", x.peer)
        for x in st.recvs:
            inside(i, x.region, f"receive from rank {x.peer}", x.peer)
        for op in st.local:
            name = type(op).__name__.lower()
            if not isinstance(op, (Reduce, Copy)):
                raise refuse(i, f"unknown local op {op!r}")
            if isinstance(op, Reduce) and not reducing:
                raise refuse(i, f"{ctx.collective} does not reduce, but the step has a reduce")
            inside(i, op.dst, f"{name} destination")
            inside(i, op.src, f"{name} source")
            if op.dst.n != op.src.n:
                raise refuse(i, f"{name} of {op.src.n} elements into {op.dst.n}")
            if _overlap(op.dst, op.src):  # torch refuses or is undefined for these
                raise refuse(i, f"{name} destination {tuple(op.dst)} overlaps its source "
                                f"{tuple(op.src)}")
        written = [x.region for x in st.recvs]
        for a in range(len(written)):
            for b in range(a + 1, len(written)):
                if _overlap(written[a], written[b]):
                    raise refuse(i, f"two receives write region {tuple(written[a])} and "
                                    f"{tuple(written[b])}")
        for x in st.sends:
            for w in written:
                if _overlap(x.region, w):
                    raise refuse(i, f"sends region {tuple(x.region)} while receiving into "
                                    f"{tuple(w)} in the same step")


def _overlap(a: Region, b: Region) -> bool:
    return a.buf == b.buf and a.n > 0 and b.n > 0 and a.off < b.off + b.n and b.off < a.off + a.n


# -- symbolic contents --------------------------------------------------------------
def _initial(collective: str, p: int, layout: tuple, r: int, root: int, lens: list):
    """Per caller buffer of rank ``r``: (ids, masks) before the call, and the expected
    (ids, masks) after it (None: not checked)."""
    me = np.int64(1) << np.int64(r)
    everyone = np.int64((1 << p) - 1)
    init, want = [], []

    def ids(logical: int, n: int) -> np.ndarray:
        return np.arange(n, dtype=np.int64) + logical * _BIG

    def undef(n: int):
        return (np.full(n, _UNDEF, np.int64), np.zeros(n, np.int64))

    def val(logical: int, n: int, mask) -> tuple:
        return (ids(logical, n), np.full(n, mask, np.int64))

    for b, n in enumerate(lens):
        n = n or 0
        c = collective
        if c == "allreduce":
            init.append(val(0, n, me))
            want.append(val(0, n, everyone))
        elif c == "broadcast":
            init.append(val(0, n, me) if r == root else undef(n))
            want.append(val(0, n, np.int64(1) << np.int64(root)))
        elif c == "reduce":
            init.append(val(0, n, me))
            want.append(val(0, n, everyone) if r == root else None)
        elif c == "allgather":
            if b < p:
                init.append(undef(n))
                want.append(val(b, n, np.int64(1) << np.int64(b)))
            else:  # the caller's input: read only
                init.append(val(r, n, me))
                want.append(val(r, n, me))
        elif c == "reduce_scatter":
            if b < p:
                init.append(val(b, n, me))
                want.append(None)
            else:
                init.append(undef(n))
                want.append(val(r, n, everyone))
        elif c == "gather":
            if b < p:
                init.append(undef(n))
                want.append(val(b, n, np.int64(1) << np.int64(b)) if r == root else None)
            else:  # the caller's input: read only
                init.append(val(r, n, me))
                want.append(val(r, n, me))
        elif c == "scatter":
            rootm = np.int64(1) << np.int64(root)
            if b < p:  # the root's inputs: read only
                init.append(val(b, n, rootm))
                want.append(val(b, n, rootm))
            else:
                init.append(undef(n))
                want.append(val(r, n, rootm))
        elif c == "barrier":
            init.append(val(0, n, me))
            want.append(None)
        elif c == "alltoall":
            if b < p:  # send chunk for rank b: read only
                init.append(val(r * p + b, n, me))
                want.append(val(r * p + b, n, me))
            else:  # receive chunk from rank b - p
                src = b - p
                init.append(undef(n))
                want.append(val(src * p + r, n, np.int64(1) << np.int64(src)))
        else:
            raise _refusal(f"checker: no symbolic model for {collective!r}", Finding("model"))
    return init, want


def _describe_id(collective: str, p: int, ident: int) -> str:
    if ident == _UNDEF:
        return "undefined data"
    logical, e = divmod(int(ident), _BIG)
    if collective in ("allreduce", "broadcast", "reduce"):
        return f"element {e}"
    if collective == "alltoall":
        return f"element {e} of rank {logical // p}'s chunk for rank {logical % p}"
    return f"element {e} of chunk {logical}"


def _ranks(mask: int) -> str:
    return "{" + ", ".join(str(i) for i in range(64) if (int(mask) >> i) & 1) + "}"


def check(build: BuildFn, collective: str, size: int, layout: tuple, *, root: int = 0,
          seg: int = 1 << 30, symbolic: bool = True,
          built: Sequence[Schedule] | None = None, hosts: tuple = ()) -> Stats:
    """Prove ``build`` right for one call shape, and count its cost.

    Args:
        build: the schedule builder.
        collective: which collective it implements.
        size: world size (at most 62 with ``symbolic``).
        layout: the global layout: as :data:`ringcomm.schedule.BUFFERS` says, except
            alltoall, which takes the matrix ``layout[i][j]`` = elements rank i sends to j.
        root: root rank of rooted collectives.
        seg: elements per pipeline segment.
        symbolic: also track contents (False: structure, matching and counts only).
        built: every rank's schedule, already built with ``build`` for this shape (so
            that what is checked is exactly what will run).
        hosts: the host of every rank (:class:`ringcomm.schedule.Context`); empty: one host.
    Raises:
        ScheduleError: the schedule is malformed, deadlocks, or computes a wrong result;
            the message names the rank, step and element, and the error carries them
            as data (:func:`finding_of`).
    """
    if symbolic and size > MAX_RANKS:
        raise ValueError(f"checker: symbolic runs support at most {MAX_RANKS} ranks")
    scheds = list(built) if built is not None else schedules(build, collective, size, layout,
                                                              root, seg, hosts)
    for s in scheds:
        validate(s)
    rules, state, wants, reduced = _streams(scheds, collective, layout, root, symbolic)
    try:
        _drain(rules)
    except ScheduleError as e:
        raise _refusal(f"{collective} on {size} ranks, layout {_short(layout)}: {e}",
                       finding_of(e)) from None
    if symbolic and collective == "barrier":
        _check_barrier(state, size)
    if symbolic:
        _check_results(state, wants, collective, size, layout)
    return Stats(rounds=rules.rounds, busiest=rules.busiest_bytes, sent_max=max(rules.sent),
                 reduced_max=max(reduced), steps_max=max(len(s.steps) for s in scheds),
                 messages=sum(len(st.sends) for s in scheds for st in s.steps))


def _streams(scheds: Sequence[Schedule], collective: str, layout: tuple, root: int,
             symbolic: bool) -> tuple[Rules, list, list, list[int]]:
    """NCCL's rules loaded with every rank's steps: per step a group of its messages,
    then its local work (run on the symbolic contents when ``symbolic``). Gives the
    rules, every rank's contents (per buffer: ids, masks), the contents expected at
    the end (None: not checked), and the elements each rank reduces."""
    size = len(scheds)
    rules = Rules(size)
    reduced = [0] * size
    state: list[list] = []
    wants: list[list] = []
    for r, s in enumerate(scheds):
        lens = buffer_lengths(s.ctx)
        if symbolic:
            init, want = _initial(collective, size, layout, r, root, lens)
            for n in s.scratch:
                init.append((np.full(n, _UNDEF, np.int64), np.zeros(n, np.int64)))
            state.append(init)
            wants.append(want)
        for i, st in enumerate(s.steps):
            label = _StepLabel(i)
            ops = []
            for x in st.sends:
                ops.append(("send", x.peer, x.region.n, _reader(state, r, x.region, symbolic)))
            for x in st.recvs:
                ops.append(("recv", x.peer, x.region.n, _writer(state, r, x.region, symbolic)))
            try:
                rules.add_group(r, ops, label)
            except ScheduleError as e:  # a peer that is no other rank
                e.finding = Finding("peer", rank=r, step=i, peer=next(
                    o[1] for o in ops if not 0 <= o[1] < size or o[1] == r))
                raise
            for op in st.local:
                if isinstance(op, Reduce):
                    reduced[r] += op.dst.n
                if symbolic:
                    rules.add_local(r, _local_fn(state, r, op, collective, size, i), label)
    return rules, state, wants, reduced


def _drain(rules: Rules) -> None:
    """:meth:`Rules.drain`, its refusals with their :class:`Finding`: a size mismatch
    (raised in a round) or, when nothing can move, the rules' report of the messages
    without partners or the wait cycle."""
    while any(rules.queues):
        try:
            moved = rules.step_round()
        except ScheduleError as e:
            if finding_of(e) is None:  # the rules' own: a size mismatch
                e.finding = _mismatch_finding(e)
            raise
        if not moved:
            raise _refusal(rules.stuck_report(), _stall_finding(rules))


def _mismatch_finding(err: ScheduleError) -> Finding | None:
    """The size mismatch a round of the rules stopped at, from the send the rules
    attached to their error."""
    where = getattr(err, "mismatch", None)
    if where is None:
        return None
    label, op, peer_label = where
    return Finding("size mismatch", rank=op.rank, step=label.step, peer=op.peer,
                   peer_step=peer_label.step)


def _stall_finding(rules: Rules) -> Finding:
    """What :meth:`Rules.stuck` found when nothing can move, as a finding: its
    messages without partners (at most 4), or else its cycle of waiting ranks."""
    orphans, cycle = rules.stuck()
    entries = ([Finding("unmatched", rank=op.rank, step=label.step, peer=op.peer)
                for label, op in orphans[:4]]
               or [Finding("deadlock", rank=op.rank, step=label.step, peer=op.peer,
                           peer_step=where.step) for label, op, where in cycle])
    return dataclasses.replace(entries[0], more=tuple(entries[1:])) if entries else \
        Finding("deadlock")


def _check_barrier(state: list, size: int) -> None:
    """A rank may leave only once it holds data (so: causally after) every rank's
    entry token; only data dependencies order the steps on every executor."""
    for r in range(size):
        know = 0
        for _, masks in state[r]:
            know |= int(np.bitwise_or.reduce(masks)) if masks.size else 0
        if know != (1 << size) - 1:
            missing = sorted(i for i in range(size) if not know >> i & 1)
            raise _refusal(f"barrier on {size} ranks: rank {r} leaves without having heard "
                           f"(directly or not) from ranks {missing}", Finding("barrier", rank=r))


def _check_results(state: list, wants: list, collective: str, size: int,
                   layout: tuple) -> None:
    """Every checked buffer ends as expected, or the first wrong element is named."""
    for r in range(size):
        for b, want in enumerate(wants[r]):
            if want is None:
                continue
            ids, masks = state[r][b]
            bad = np.nonzero((ids != want[0]) | (masks != want[1]))[0]
            if bad.size:
                e = int(bad[0])
                found = Finding("wrong result", rank=r, buffer=b, element=e)
                raise _refusal(
                    f"{collective} on {size} ranks, layout {_short(layout)}: "
                    f"{found.element_words()} ends as {_describe_id(collective, size, ids[e])}"
                    f" from ranks {_ranks(masks[e])}, expected "
                    f"{_describe_id(collective, size, want[0][e])} from ranks "
                    f"{_ranks(want[1][e])} ({bad.size} wrong elements)", found)


def _short(layout) -> str:
    text = str(layout)
    return text if len(text) <= 60 else text[:57] + "..."


def _reader(state, r: int, rg: Region, symbolic: bool):
    if not symbolic:
        return lambda: None
    ids, masks = state[r][rg.buf]
    a, b = rg.off, rg.off + rg.n
    return lambda: (ids[a:b].copy(), masks[a:b].copy())


def _writer(state, r: int, rg: Region, symbolic: bool):
    if not symbolic:
        return lambda data: None
    ids, masks = state[r][rg.buf]
    a, b = rg.off, rg.off + rg.n

    def put(data):
        ids[a:b], masks[a:b] = data
    return put


def _local_fn(state, r: int, op, collective: str, p: int, step: int):
    dids, dmasks = state[r][op.dst.buf]
    sids, smasks = state[r][op.src.buf]
    da, db = op.dst.off, op.dst.off + op.dst.n
    sa, sb = op.src.off, op.src.off + op.src.n
    where = f"{collective} rank {r} step {step}"

    if isinstance(op, Copy):
        def copy():
            src = (sids[sa:sb].copy(), smasks[sa:sb].copy())
            dids[da:db], dmasks[da:db] = src
        return copy

    def refuse(e: int, what: str) -> ScheduleError:
        return _refusal(f"{where}: {what}", Finding("reduce", rank=r, step=step,
                                                    buffer=op.dst.buf, element=da + e))

    def reduce():
        di, dm, si, sm = dids[da:db], dmasks[da:db], sids[sa:sb], smasks[sa:sb]
        undef = np.nonzero((di == _UNDEF) | (si == _UNDEF))[0]
        if undef.size:
            e = int(undef[0])
            raise refuse(e, f"reduces undefined data (buffer {op.dst.buf} element {da + e} "
                            f"with buffer {op.src.buf} element {sa + e})")
        mixed = np.nonzero(di != si)[0]
        if mixed.size:
            e = int(mixed[0])
            raise refuse(e, f"reduces {_describe_id(collective, p, di[e])} with "
                            f"{_describe_id(collective, p, si[e])}")
        twice = np.nonzero(dm & sm)[0]
        if twice.size:
            e = int(twice[0])
            raise refuse(e, f"{_describe_id(collective, p, di[e])} would count ranks "
                            f"{_ranks(dm[e] & sm[e])} twice")
        dmasks[da:db] = dm | sm
    return reduce


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


# -- a user's builder, checked before its first use --------------------------------
#: a user's schedule is checked symbolically at its real shape up to this many
#: elements over all ranks, at a proportionally smaller shape above it
CHECK_ELEMENTS = 1 << 18


class AlgorithmFailed(RuntimeError):
    """A user's schedule builder raised (not a wrong schedule: an exception)."""


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
        if len(set(sends) | set(recvs)) == 1:  # even splits: every rank's are (all_to_all_single)
            layout = tuple((sends[0],) * p for _ in range(p))
        else:
            layout = tuple(tuple(sends[j] if i == r else recvs[i] if j == r else 1
                                 for j in range(p)) for i in range(p))
    else:
        layout = lay
    total = sum(_leaves(layout)) * max(p, 1)
    small = total <= CHECK_ELEMENTS and p <= MAX_RANKS
    try:
        scheds = schedules(build, coll, p, layout, ctx.root, ctx.seg, ctx.hosts)
        check(build, coll, p, layout, root=ctx.root, seg=ctx.seg, symbolic=small,
                      built=scheds, hosts=ctx.hosts)
        if not small and p <= MAX_RANKS:  # same segments per chunk, fewer elements
            f = -(-total // CHECK_ELEMENTS)
            check(build, coll, p, _scaled(layout, f), root=ctx.root,
                          seg=max(1, ctx.seg // f), hosts=ctx.hosts)
    except ShapeNotServed as e:
        raise ShapeNotServed(f"ringcomm: algorithm {name!r} does not serve this call "
                             f"({coll} on {p} ranks, layout {_short(layout)}): {e}") from None
    except ScheduleError as e:
        raise _refusal(f"ringcomm: algorithm {name!r} is wrong: {e}", finding_of(e)) from None
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
