"""The symbolic run of a checked call (:class:`Contents`): every element carries
the identity of the input element it came from and the set of ranks that
contributed to it (:class:`RankSets`), moved through the world's messages and
local steps in order; a reduction that mixes different elements, counts a rank
twice or misses one, or a copy from the wrong place, is refused naming rank,
buffer, element and step."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ringcomm.execution.findings import Finding, refusal, short_layout
from ringcomm.execution.plan import COPY
from ringcomm.execution.world import Batch, Memory, World

_UNDEF = -1
#: the most elements the contents move in one array operation
SLICE_ELEMENTS = 1 << 20
_MAX_SETS = (1 << 31) - 1
_BIG = 1 << 32  # element ids: logical part * _BIG + element index


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


class Contents:
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
                raise refusal(f"checker: no symbolic model for {c!r}", Finding("model"))

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
            what = f"reduces {describe_id(c, p, di[e])} with {describe_id(c, p, si[e])}"
        else:
            both = self.sets.of(self.sets.masks[self.set_of[dst[e]]] &
                                self.sets.masks[self.set_of[src[e]]])
            what = (f"{describe_id(c, p, di[e])} would count ranks {self.sets.words(both)} "
                    "twice")
        raise refusal(f"{c} rank {r} step {step}: {what}", where)

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
                raise refusal(f"barrier on {self.size} ranks: rank {r} leaves without having "
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
        raise refusal(
            f"{c} on {p} ranks, layout {short_layout(self.layout)}: "
            f"{found.element_words()} ends as "
            f"{describe_id(c, p, ids[e])} from ranks {w(sets[e])}, expected "
            f"{describe_id(c, p, want[0][e])} from ranks {w(want[1][e])} "
            f"({count} wrong elements)", found)


def describe_id(collective: str, p: int, ident: int) -> str:
    if ident == _UNDEF:
        return "undefined data"
    logical, e = divmod(int(ident), _BIG)
    if collective in ("allreduce", "broadcast", "reduce"):
        return f"element {e}"
    if collective == "alltoall":
        return f"element {e} of rank {logical // p}'s chunk for rank {logical % p}"
    return f"element {e} of chunk {logical}"
