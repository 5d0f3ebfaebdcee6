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

import bisect
import contextlib
import dataclasses
import gc
import logging
import time
from typing import Callable, Sequence

import numpy as np

from ringcomm import settings
from ringcomm.execution.plan import COPY, compile_steps
from ringcomm.execution.world import SEND, Batch, Memory, World
from ringcomm.schedule import (REDUCING, BuildFn, Context, Copy, Reduce, Region, Schedule,
                               ScheduleError, ShapeNotServed, buffer_lengths)

_LOCAL_OPS = (Reduce, Copy)

_UNDEF = -1
#: the most elements the contents move in one array operation
SLICE_ELEMENTS = 1 << 20
_MAX_SETS = (1 << 31) - 1
_BIG = 1 << 32  # element ids: logical part * _BIG + element index


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
    return [_built(build, Context(collective, size, r, local_layout(collective, layout, r, root),
                                  root, seg, tuple(hosts))) for r in range(size)]


def _built(build: BuildFn, ctx: Context) -> Schedule:
    s = build(ctx)
    if not isinstance(s, Schedule):
        raise _refusal(f"{ctx.collective} builder returned {type(s).__name__} on rank "
                       f"{ctx.rank}, expected a ringcomm.schedule.Schedule",
                       Finding("builder", rank=ctx.rank))
    return s


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

    # every region is checked, so the words of a refusal are made only for one:
    # formatting them for each of a 1,024-rank ring's 4 million regions took seconds
    sizes = [s.buffer_len(b, lens) for b in range(nb)]

    def fits(rg: Region) -> bool:
        ln = sizes[rg.buf] if 0 <= rg.buf < nb else None
        return ln is not None and 0 <= rg.off and 0 <= rg.n and rg.off + rg.n <= ln

    def outside(i: int, rg: Region, what: str, peer: int | None = None) -> ScheduleError:
        if not 0 <= rg.buf < nb:
            return refuse(i, f"{what} uses buffer {rg.buf}, which does not exist "
                             f"(buffers 0..{nb - 1})", peer)
        if sizes[rg.buf] is None:
            return refuse(i, f"{what} uses buffer {rg.buf}, which rank {ctx.rank} does not "
                             "have", peer)
        return refuse(i, f"{what} region {tuple(rg)} is outside buffer {rg.buf} of "
                         f"{sizes[rg.buf]} elements", peer)

    for i, st in enumerate(s.steps):
        for x in st.sends:
            if not fits(x.region):
                raise outside(i, x.region, f"send to rank {x.peer}", x.peer)
        for x in st.recvs:
            if not fits(x.region):
                raise outside(i, x.region, f"receive from rank {x.peer}", x.peer)
        for op in st.local:
            if type(op) not in _LOCAL_OPS and not isinstance(op, _LOCAL_OPS):
                raise refuse(i, f"unknown local op {op!r}")
            if not reducing and isinstance(op, Reduce):
                raise refuse(i, f"{ctx.collective} does not reduce, but the step has a reduce")
            if not fits(op.dst):
                raise outside(i, op.dst, f"{type(op).__name__.lower()} destination")
            if not fits(op.src):
                raise outside(i, op.src, f"{type(op).__name__.lower()} source")
            name = type(op).__name__.lower
            if op.dst.n != op.src.n:
                raise refuse(i, f"{name()} of {op.src.n} elements into {op.dst.n}")
            if _overlap(op.dst, op.src):  # torch refuses or is undefined for these
                raise refuse(i, f"{name()} destination {tuple(op.dst)} overlaps its source "
                                f"{tuple(op.src)}")
        if st.recvs:
            _disjoint_writes(st, lambda what: refuse(i, what))


def _disjoint_writes(st, refuse) -> None:
    """A step's receives write disjoint memory, none of which its sends read: the
    regions sorted once, each checked against its neighbours (a step of one_shot on
    1,024 ranks has 1,023 receives)."""
    written = sorted((x.region for x in st.recvs if x.region.n > 0),
                     key=lambda rg: (rg.buf, rg.off))
    for a, b in zip(written, written[1:]):
        if _overlap(a, b):
            raise refuse(f"two receives write region {tuple(a)} and {tuple(b)}")
    keys = [(rg.buf, rg.off) for rg in written]
    for x in st.sends:
        rg = x.region
        if rg.n <= 0:
            continue
        # the last write starting before the send's end is the only one that can
        # overlap it (the writes are disjoint and sorted)
        k = bisect.bisect_left(keys, (rg.buf, rg.off + rg.n)) - 1
        if k >= 0 and _overlap(rg, written[k]):
            raise refuse(f"sends region {tuple(rg)} while receiving into "
                         f"{tuple(written[k])} in the same step")


def _overlap(a: Region, b: Region) -> bool:
    return a.buf == b.buf and a.n > 0 and b.n > 0 and a.off < b.off + b.n and b.off < a.off + a.n


# -- symbolic contents --------------------------------------------------------------
class RankSets:
    """Sets of ranks, each stored once and named by a number (0: the empty set), so
    that an element's contributors cost one integer at any world size: a set is a
    Python integer's bits; unions are computed once per distinct pair of operands."""

    def __init__(self) -> None:
        self.masks: list[int] = [0]
        # keyed by the mask's bytes: Python hashes an int modulo 2**61 - 1, so runs
        # of ranks 61 apart (a ring's partial sums) share a hash, and a dict keyed
        # by the ints themselves slowed a 1,024-rank ring's proof tenfold
        self._index: dict[bytes, int] = {b"": 0}
        self._unions: dict[int, int] = {}

    def of(self, mask: int) -> int:
        """The number of the set whose bits are ``mask``."""
        key = mask.to_bytes((mask.bit_length() + 7) // 8, "little")
        i = self._index.get(key)
        if i is None:
            if len(self.masks) >= _MAX_SETS:  # numbers are kept in int32 and paired in int64
                raise ValueError(f"checker: more than {_MAX_SETS} distinct sets of ranks; "
                                 "prove this at fewer ranks or elements")
            i = self._index[key] = len(self.masks)
            self.masks.append(mask)
        return i

    def single(self, rank: int) -> int:
        return self.of(1 << rank)

    def union(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Elementwise union of sets ``a`` and ``b`` (numbers), and where they share a
        rank (bool)."""
        if not len(a):
            return a.copy(), np.zeros(0, bool)
        # a region's elements mostly carry the same pair of sets: runs of one pair are
        # found in one pass and only their heads sorted (recursive doubling on 4,096
        # ranks had spent most of its proof sorting every element's pair)
        code = a.astype(np.int64) << 32 | b
        change = np.empty(len(code), bool)
        change[0] = True
        np.not_equal(code[1:], code[:-1], out=change[1:])
        run = np.cumsum(change) - 1
        pairs, inverse = np.unique(code[change], return_inverse=True)
        inverse = inverse.reshape(-1)[run]
        out = np.empty(len(pairs), np.int64)
        shared = np.zeros(len(pairs), bool)
        for k, code in enumerate(pairs.tolist()):
            u = self._unions.get(code)
            if u is None:
                x, y = self.masks[code >> 32], self.masks[code & 0xFFFFFFFF]
                u = self._unions[code] = -1 if x & y else self.of(x | y)
            shared[k] = u < 0
            out[k] = u
        return out[inverse], shared[inverse]

    def words(self, i: int) -> str:
        """``{0, 1, 2}``; above 16 ranks, runs of consecutive ranks as ``0..1023``."""
        mask = self.masks[int(i)]
        ranks = [r for r in range(mask.bit_length()) if mask >> r & 1]
        if len(ranks) <= 16:
            return "{" + ", ".join(map(str, ranks)) + "}"
        runs: list[list[int]] = []
        for r in ranks:
            if runs and runs[-1][1] == r - 1:
                runs[-1][1] = r
            else:
                runs.append([r, r])
        return "{" + ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs) + "}"


class _Contents:
    """Every rank's buffers as one array of element identities and one of contributor
    sets (:class:`RankSets` numbers), moved by the world's rounds
    (:meth:`ringcomm.execution.world.World.run`)."""

    def __init__(self, world: World, shapes: Sequence[tuple[list, list]], collective: str,
                 layout: tuple, root: int):
        self.world, self.collective, self.size = world, collective, len(shapes)
        self.shapes, self.root, self.layout = shapes, root, layout
        self.sets = RankSets()
        self.memory = Memory(world, [[*lens, *scratch] for lens, scratch in shapes])
        # 12 bytes an element (a 4,096-rank tree of 12,288 elements a rank holds 100
        # million); what each should end as is made per rank at the end
        self.ids = np.full(self.memory.total, _UNDEF, np.int64)
        self.set_of = np.zeros(self.memory.total, np.int32)
        for r, (lens, _) in enumerate(shapes):
            for b, ((ids, sets), _) in enumerate(self._initial(r, lens, root, layout)):
                at = self.memory.base[r][b]
                self.ids[at:at + lens[b]] = ids
                self.set_of[at:at + lens[b]] = sets

    def _initial(self, r: int, lens: list[int], root: int, layout: tuple):
        """Per caller buffer of rank ``r``: ((ids, sets) before the call, (ids, sets)
        expected after it, None: not checked)."""
        c, p, one = self.collective, self.size, self.sets.single
        everyone = self.sets.of((1 << p) - 1)

        def val(logical: int, n: int, s: int) -> tuple:
            return (np.arange(n, dtype=np.int64) + logical * _BIG, np.full(n, s, np.int64))

        def undef(n: int) -> tuple:
            return (np.full(n, _UNDEF, np.int64), np.zeros(n, np.int64))

        for b, n in enumerate(lens):
            if c == "allreduce":
                yield val(0, n, one(r)), val(0, n, everyone)
            elif c == "broadcast":
                yield (val(0, n, one(r)) if r == root else undef(n)), val(0, n, one(root))
            elif c == "reduce":
                yield val(0, n, one(r)), (val(0, n, everyone) if r == root else None)
            elif c == "allgather":
                yield ((undef(n), val(b, n, one(b))) if b < p  # the caller's input: read only
                       else (val(r, n, one(r)), val(r, n, one(r))))
            elif c == "reduce_scatter":
                yield ((val(b, n, one(r)), None) if b < p
                       else (undef(n), val(r, n, everyone)))
            elif c == "gather":
                yield ((undef(n), val(b, n, one(b)) if r == root else None) if b < p
                       else (val(r, n, one(r)), val(r, n, one(r))))
            elif c == "scatter":  # the root's inputs are read only
                yield ((val(b, n, one(root)), val(b, n, one(root))) if b < p
                       else (undef(n), val(r, n, one(root))))
            elif c == "barrier":
                yield val(0, n, one(r)), None
            elif c == "alltoall":
                if b < p:  # send chunk for rank b: read only
                    yield val(r * p + b, n, one(r)), val(r * p + b, n, one(r))
                else:  # receive chunk from rank b - p
                    yield undef(n), val((b - p) * p + r, n, one(b - p))
            else:
                raise _refusal(f"checker: no symbolic model for {c!r}", Finding("model"))

    def _sliced(self, batch: Batch, fn) -> None:
        """``fn`` over ``batch`` in parts of at most :data:`SLICE_ELEMENTS` elements (one
        message or local operation at least), so that its temporary arrays stay
        bounded whatever the round moves; a round's entries touch disjoint memory, so
        the parts may run one after another."""
        sizes = np.cumsum(self.memory.sizes(batch.dst))
        if not len(sizes) or sizes[-1] <= SLICE_ELEMENTS:
            return fn(batch)
        cuts = np.searchsorted(sizes, np.arange(SLICE_ELEMENTS, sizes[-1], SLICE_ELEMENTS),
                               "right")
        for part in np.split(np.arange(len(sizes)), np.unique(np.maximum(cuts, 1))):
            if len(part):
                fn(Batch(**{k: None if getattr(batch, k) is None else getattr(batch, k)[part]
                            for k in Batch.__slots__}))

    def messages(self, batch: Batch) -> None:
        self._sliced(batch, self._messages)

    def _messages(self, batch: Batch) -> None:
        src, dst = self.memory.elements(batch.src), self.memory.elements(batch.dst)
        self.ids[dst] = self.ids[src]
        self.set_of[dst] = self.set_of[src]

    def local(self, batch: Batch) -> None:
        self._sliced(batch, self._local)

    def _local(self, batch: Batch) -> None:
        copy = batch.kind == COPY
        if copy.any():
            self._messages(Batch(src=batch.src[copy], dst=batch.dst[copy]))
        red = ~copy
        if not red.any():
            return
        dreg, sreg = batch.dst[red], batch.src[red]
        dst, src = self.memory.elements(dreg), self.memory.elements(sreg)
        di, si = self.ids[dst], self.ids[src]
        union, shared = self.sets.union(self.set_of[dst], self.set_of[src])
        bad = (di == _UNDEF) | (si == _UNDEF) | (di != si) | shared
        if bad.any():
            self._refuse_reduce(int(np.argmax(bad)), dreg, sreg, batch.rank[red],
                                batch.step[red], di, si, dst, src)
        self.set_of[dst] = union

    def _refuse_reduce(self, e: int, dreg, sreg, ranks, steps, di, si, dst, src) -> None:
        """The first wrong element ``e`` of a batch of reductions, named."""
        k = int(np.searchsorted(np.cumsum(self.memory.sizes(dreg)), e, side="right"))
        r, step = int(ranks[k]), int(steps[k])
        (_, dbuf, da, _), (_, sbuf, sa, _) = self.world.regions[dreg[k]], \
            self.world.regions[sreg[k]]
        first = int(self.memory.elements(dreg[k:k + 1])[0])
        off = int(dst[e]) - first
        where = Finding("reduce", rank=r, step=step, buffer=int(dbuf), element=int(da) + off)
        c, p = self.collective, self.size
        if di[e] == _UNDEF or si[e] == _UNDEF:
            what = (f"reduces undefined data (buffer {dbuf} element {da + off} with buffer "
                    f"{sbuf} element {sa + off})")
        elif di[e] != si[e]:
            what = f"reduces {_describe_id(c, p, di[e])} with {_describe_id(c, p, si[e])}"
        else:
            both = self.sets.of(self.sets.masks[self.set_of[dst[e]]] &
                                self.sets.masks[self.set_of[src[e]]])
            what = (f"{_describe_id(c, p, di[e])} would count ranks {self.sets.words(both)} "
                    "twice")
        raise _refusal(f"{c} rank {r} step {step}: {what}", where)

    def check_barrier(self) -> None:
        """A rank may leave only once it holds data (so: causally after) every rank's
        entry token; only data dependencies order the steps on every executor."""
        base = self.memory.base
        for r in range(self.size):
            end = base[r + 1][0] if r + 1 < self.size else len(self.ids)
            know = 0
            for s in np.unique(self.set_of[base[r][0]:end]).tolist() if base[r] else []:
                know |= self.sets.masks[s]
            if know != (1 << self.size) - 1:
                missing = [i for i in range(self.size) if not know >> i & 1]
                raise _refusal(f"barrier on {self.size} ranks: rank {r} leaves without having "
                               f"heard (directly or not) from ranks {missing}",
                               Finding("barrier", rank=r))

    def check_results(self, layout: tuple) -> None:
        """Every checked buffer ends as expected, or the first wrong element is named."""
        for r, (lens, _) in enumerate(self.shapes):
            for b, (_, want) in enumerate(self._initial(r, lens, self.root, self.layout)):
                if want is None:
                    continue
                at = self.memory.base[r][b]
                ids, sets = self.ids[at:at + lens[b]], self.set_of[at:at + lens[b]]
                bad = np.nonzero((ids != want[0]) | (sets != want[1]))[0]
                if bad.size:
                    self._refuse_result(r, b, int(bad[0]), bad.size, ids, sets, want)

    def _refuse_result(self, r: int, b: int, e: int, count: int, ids, sets, want) -> None:
        c, p, w = self.collective, self.size, self.sets.words
        found = Finding("wrong result", rank=r, buffer=b, element=e)
        raise _refusal(
            f"{c} on {p} ranks, layout {_short(self.layout)}: {found.element_words()} ends as "
            f"{_describe_id(c, p, ids[e])} from ranks {w(sets[e])}, expected "
            f"{_describe_id(c, p, want[0][e])} from ranks {w(want[1][e])} "
            f"({count} wrong elements)", found)


def _describe_id(collective: str, p: int, ident: int) -> str:
    if ident == _UNDEF:
        return "undefined data"
    logical, e = divmod(int(ident), _BIG)
    if collective in ("allreduce", "broadcast", "reduce"):
        return f"element {e}"
    if collective == "alltoall":
        return f"element {e} of rank {logical // p}'s chunk for rank {logical % p}"
    return f"element {e} of chunk {logical}"


def check(build: BuildFn, collective: str, size: int, layout: tuple, *, root: int = 0,
          seg: int = 1 << 30, symbolic: bool = True,
          on_built: Callable[[Schedule], None] | None = None, hosts: tuple = ()) -> Stats:
    """Prove ``build`` right for one call shape, and count its cost.

    Every rank's schedule is built, checked and compiled in turn, then dropped, so
    memory holds arrays of every rank's steps, not their Python objects.

    Args:
        build: the schedule builder.
        collective: which collective it implements.
        size: world size (any: contributions are sets of ranks of any size).
        layout: the global layout: as :data:`ringcomm.schedule.BUFFERS` says, except
            alltoall, which takes the matrix ``layout[i][j]`` = elements rank i sends to j.
        root: root rank of rooted collectives.
        seg: elements per pipeline segment.
        symbolic: also track contents (False: structure, matching and counts only).
        on_built: called with each rank's schedule as it is built (so that a caller
            keeps exactly what was checked).
        hosts: the host of every rank (:class:`ringcomm.schedule.Context`); empty: one host.
    Raises:
        ScheduleError: the schedule is malformed, deadlocks, or computes a wrong result;
            the message names the rank, step and element, and the error carries them
            as data (:func:`finding_of`).
    """
    with _paused_gc():
        return _check(build, collective, size, layout, root, seg, symbolic, on_built, hosts)


@contextlib.contextmanager
def _paused_gc():
    """Python's cycle collector paused: a proof allocates millions of small tuples
    that reference counting frees, and each collection rescans them all (it tripled
    a 512-rank ring's build time)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _check(build, collective, size, layout, root, seg, symbolic, on_built, hosts) -> Stats:
    shapes: list[tuple[list, list]] = []  # per rank: caller buffer lengths, scratch

    def compiled():
        for r in range(size):
            s = _built(build, Context(collective, size, r,
                                      local_layout(collective, layout, r, root), root, seg,
                                      tuple(hosts)))
            validate(s)
            if on_built is not None:
                on_built(s)
            lens = buffer_lengths(s.ctx)
            shapes.append(([n or 0 for n in lens], list(s.scratch)))
            yield compile_steps(s, [*lens, *s.scratch])

    try:
        world = World(compiled(), size)
    except ScheduleError as e:
        if not hasattr(e, "bad_peer"):  # the builder's or validate's own
            raise
        r, i, peer = e.bad_peer  # a peer that is no other rank
        raise _refusal(str(e), Finding("peer", rank=r, step=i, peer=peer)) from None
    contents = _Contents(world, shapes, collective, layout, root) if symbolic else None
    try:
        counts = world.run(contents and contents.local, contents and contents.messages)
    except ScheduleError as e:  # the world's refusal, or the contents' (with its finding)
        raise _refusal(f"{collective} on {size} ranks, layout {_short(layout)}: {e}",
                       finding_of(e) or _world_finding(e)) from None
    if symbolic and collective == "barrier":
        contents.check_barrier()
    if symbolic:
        contents.check_results(layout)
    return Stats(rounds=counts.rounds, busiest=counts.busiest, sent_max=int(counts.sent.max()),
                 reduced_max=int(world.reduced.max()), steps_max=int(world.steps.max()),
                 messages=int((world.m_kind == SEND).sum()))


def _world_finding(err: ScheduleError) -> Finding | None:
    """The finding of the world's refusal: a size mismatch, or, when nothing can
    move, its messages without partners (at most 4) or else its cycle of waits."""
    if getattr(err, "mismatch", None) is not None:
        rank, step, peer, peer_step = err.mismatch
        return Finding("size mismatch", rank=rank, step=step, peer=peer, peer_step=peer_step)
    orphans, cycle = getattr(err, "stuck", ([], []))
    entries = ([Finding("unmatched", rank=r, step=i, peer=q) for r, i, _, _, q in orphans[:4]]
               or [Finding("deadlock", rank=r, step=i, peer=q, peer_step=j)
                   for r, i, _, _, q, j in cycle])
    return dataclasses.replace(entries[0], more=tuple(entries[1:])) if entries else \
        Finding("deadlock")


def _short(layout) -> str:
    text = str(layout)
    return text if len(text) <= 60 else text[:57] + "..."


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
#: up to this many ranks the first-use check is one proof, structure and contents
#: together; above, the structure first, which also times what a proof costs
ONE_PASS_RANKS = 64
#: a proof of the contents costs about this many times the structural check of the
#: same size (it builds every rank's schedule again, then moves contents)
CONTENTS_COST = 1.5
#: the smallest size a budget's fallback proves, whatever its cost
LADDER_FLOOR = 8

log = logging.getLogger("ringcomm")


class AlgorithmFailed(RuntimeError):
    """A user's schedule builder raised (not a wrong schedule: an exception)."""


@dataclasses.dataclass(frozen=True)
class Proof:
    """What a first-use check proved: the structure at the group's ``size``, the
    contents at ``proven`` ranks (``size`` unless the budget ran out; 0: at none)."""
    size: int
    proven: int
    seconds: float


def check_user_schedule(build: Callable, ctx: Context, name: str,
                        budget_s: float | None = None) -> Schedule:
    """Check a user's builder for this call shape and return this rank's schedule,
    the very one that was checked (every rank checks the same, so every rank
    refuses a wrong schedule alike).

    At the group's size: bounds, matching and freedom from deadlock always; the
    contents too when the proof fits ``budget_s`` (``RINGCOMM_CHECK_BUDGET_S``), up to
    ``CHECK_ELEMENTS`` elements over all ranks at the real shape, at a proportionally
    smaller shape with the same number of segments per chunk above it. When it does
    not fit (a 4,096-rank ring's would take minutes), the contents are proven at the
    largest of ``p/2, p/4, ...`` down to 8 ranks whose estimated cost fits (the
    smallest, 8 to 15 ranks, whatever its cost), and rank 0 warns naming that size.
    :data:`LAST_PROOF` keeps what was proven.

    Raises:
        ScheduleError: (a ValueError) naming the algorithm, step and element at fault.
        AlgorithmFailed: the builder raised, for some rank's view of this call (every
            rank builds every rank's schedule, so every rank raises alike).
    """
    budget = settings.get("RINGCOMM_CHECK_BUDGET_S") if budget_s is None else budget_s
    start = time.monotonic()
    coll, p, r = ctx.collective, ctx.size, ctx.rank
    layout = _global_layout(ctx)
    mine: list[Schedule] = []
    keep = (lambda s: mine.append(s) if s.ctx.rank == r else None)
    with _named(name, coll, p, layout):
        if p <= ONE_PASS_RANKS:
            _prove(build, ctx, layout, p, keep, structure=True)
            proven = p
        else:
            check(build, coll, p, layout, root=ctx.root, seg=ctx.seg, symbolic=False,
                  on_built=keep, hosts=ctx.hosts)
            structure_s = time.monotonic() - start
            proven = _prove_within(build, ctx, layout, structure_s,
                                   budget - structure_s)
    LAST_PROOF[(name, coll, p)] = proof = Proof(p, proven, time.monotonic() - start)
    if proven < p and r == 0:
        log.warning("ringcomm: algorithm %r (%s on %d ranks): its contents were proven %s, "
                    "not at %d: a proof at %d ranks would not fit "
                    "RINGCOMM_CHECK_BUDGET_S=%g s; its structure (sizes, matching, no "
                    "deadlock) was checked at %d ranks (%.1f s in all)", name, coll, p,
                    f"at {proven} ranks" if proven else "at no size (it serves no smaller "
                    "one)", p, p, budget, p, proof.seconds)
    return mine[0]


#: (algorithm, collective, size) -> the :class:`Proof` of its latest first-use check
LAST_PROOF: dict[tuple[str, str, int], Proof] = {}


def _global_layout(ctx: Context) -> tuple:
    """The global layout the checker needs: every rank's view. Where a rank knows only
    its own sizes (gather/scatter non-roots, alltoall) a consistent global layout
    stands in; this rank's part of it is exactly its own layout."""
    coll, p, r, lay = ctx.collective, ctx.size, ctx.rank, ctx.layout
    if coll in ("gather", "scatter"):
        own = lay[r]
        return tuple(own if c is None else c for c in lay)
    if coll == "alltoall":
        sends, recvs = lay
        if len(set(sends) | set(recvs)) == 1:  # even splits: every rank's are (all_to_all_single)
            return tuple((sends[0],) * p for _ in range(p))
        return tuple(tuple(sends[j] if i == r else recvs[i] if j == r else 1
                           for j in range(p)) for i in range(p))
    return lay


def _prove(build: Callable, ctx: Context, layout: tuple, q: int,
           on_built: Callable | None = None, structure: bool = False) -> None:
    """The contents proof at ``q`` ranks (fewer than ``ctx.size``: the call shape cut
    down to ``q`` ranks), at the real shape up to ``CHECK_ELEMENTS`` elements, scaled
    down above; with ``structure``, also the structure at the real shape."""
    coll, p = ctx.collective, ctx.size
    if q < p:
        layout = _cut(coll, layout, q, p)
    root, hosts = (ctx.root if ctx.root < q else q - 1), tuple(ctx.hosts[:q])
    total = sum(_leaves(layout)) * max(q, 1)
    small = total <= CHECK_ELEMENTS
    if structure or small:
        check(build, coll, q, layout, root=root, seg=ctx.seg, symbolic=small,
              on_built=on_built, hosts=hosts)
    if not small:  # same segments per chunk, fewer elements
        f = -(-total // CHECK_ELEMENTS)
        check(build, coll, q, _scaled(layout, f), root=root, seg=max(1, ctx.seg // f),
              hosts=hosts)


def _prove_within(build: Callable, ctx: Context, layout: tuple, structure_s: float,
                  left_s: float) -> int:
    """Prove the contents at the group's size if its estimated cost fits ``left_s``,
    else at the largest of p/2, p/4, ... that fits (cost taken as linear in the
    ranks, which over-estimates the smaller sizes of algorithms whose steps grow
    with p); returns the size proven (0: none served)."""
    p = ctx.size
    sizes = [p]
    while sizes[-1] // 2 >= LADDER_FLOOR:
        sizes.append(sizes[-1] // 2)
    for q in sizes:
        if q != sizes[-1] and CONTENTS_COST * structure_s * q / p > left_s:
            continue  # the last rung (8 to 15 ranks) is proven whatever the budget
        try:
            _prove(build, ctx, layout, q)
        except ShapeNotServed:
            if q == p:
                raise
            continue  # the builder serves some sizes only: try a smaller one
        return q
    return 0


def _cut(collective: str, layout: tuple, q: int, p: int) -> tuple:
    """A ``p``-rank call shape cut down to ``q`` ranks: per-rank sizes of the first
    ``q`` ranks; a whole-buffer size scaled to keep the elements per rank."""
    if collective == "alltoall":
        return tuple(tuple(row[:q]) for row in layout[:q])
    if collective in ("allreduce", "broadcast", "reduce", "barrier"):
        return (max(1, -(-layout[0] * q // p)),) if layout[0] else layout
    return tuple(layout[:q])


@contextlib.contextmanager
def _named(name: str, coll: str, p: int, layout: tuple):
    """A refusal or a builder's error, named with the algorithm and the call."""
    try:
        yield
    except ShapeNotServed as e:
        raise ShapeNotServed(f"ringcomm: algorithm {name!r} does not serve this call "
                             f"({coll} on {p} ranks, layout {_short(layout)}): {e}") from None
    except ScheduleError as e:
        raise _refusal(f"ringcomm: algorithm {name!r} is wrong: {e}", finding_of(e)) from None
    except Exception as e:  # noqa: BLE001 - a user's code may raise anything
        raise AlgorithmFailed(f"algorithm {name!r} raised {type(e).__name__}: {e} while "
                              f"building its {coll} schedule for {p} ranks, layout "
                              f"{layout}") from e


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
