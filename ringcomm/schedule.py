"""Schedules: an algorithm's whole description, for one rank, as data.

A schedule builder is a pure function ``build(ctx) -> Schedule``. It never
sends, waits or touches memory; it lists *steps*. Each step is a set of sends
and receives of buffer regions with named peers (all of a step's messages
progress together: on NCCL they are one ``ncclGroupStart``/``ncclGroupEnd``
group), followed by local reductions and copies that run once the step's
messages are complete. Peers' steps match by message order: the k-th send from
rank a to rank b pairs with the k-th receive at b from a.

Buffers are numbered. The caller's buffers come first, in an order fixed per
collective (:data:`BUFFERS`); scratch buffers a schedule asks for
(:meth:`Builder.scratch`) come after them. A region is ``(buffer, offset,
length)`` in elements of the collective's dtype.

The same schedule runs on MPI (``executors.p2p``), on in-process ranks (the
same executor over threads), and under NCCL's group rules (``executors.group``
with the real library or :mod:`ringcomm.execution.simulator`); :mod:`ringcomm.execution.checker`
proves it correct without running it.

Example: a two-rank exchange that sums a buffer::

    def swap_sum(ctx):
        b = Builder(ctx)
        n = ctx.layout[0]
        tmp = b.scratch(n)
        peer = 1 - ctx.rank
        b.step(sends=[(peer, (DATA, 0, n))], recvs=[(peer, (tmp, 0, n))],
               local=[Reduce((DATA, 0, n), (tmp, 0, n))])
        return b.build()

Helpers for writing builders, public so that an algorithm written outside
ringcomm uses the same pieces as the built-in ones: :func:`split_even` (a region
cut into nearly equal chunks), :func:`pieces` (a region cut into pipeline
segments), :func:`binomial_tree` (parent and children in a binomial tree),
:data:`SCRATCH_SLOTS` (scratch slots per receiving peer in pipelined reductions) and
:meth:`Builder.include` (another schedule, of a subgroup, appended to this one:
how hierarchical algorithms compose).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence


class ScheduleError(ValueError):
    """A schedule is malformed, would deadlock, or computes the wrong result."""


class ShapeNotServed(ScheduleError):
    """A builder does not serve this call shape (a world size or element count its
    algorithm is not written for): raised by the builder, it refuses the call on every
    rank, before anything is sent, naming what would be served."""


class Region(NamedTuple):
    """``length`` elements of buffer ``buf`` from element ``off``."""
    buf: int
    off: int
    n: int


class Xfer(NamedTuple):
    """One send (to ``peer``) or receive (from ``peer``) of ``region``."""
    peer: int
    region: Region


class Reduce(NamedTuple):
    """``dst = dst (op) src``, elementwise, with the collective's reduce op; with
    ``src_first``, ``dst = src (op) dst``. The two differ only where an op's operand
    order shows (MIN and MAX of +0 and -0 return one operand's sign; NaN payloads): a
    schedule that combines its parts in a fixed order on every rank says which is
    left without copying the result back (recursive doubling)."""
    dst: Region
    src: Region
    src_first: bool = False


class Copy(NamedTuple):
    """``dst = src``."""
    dst: Region
    src: Region


class Step(NamedTuple):
    """Messages that progress together, then local work once they completed."""
    sends: tuple[Xfer, ...]
    recvs: tuple[Xfer, ...]
    local: tuple  # of Reduce | Copy, run in order


@dataclasses.dataclass(frozen=True)
class Context:
    """What a builder is given.

    Attributes:
        collective: one of :data:`BUFFERS`' keys.
        size, rank: the group's world size and this rank.
        layout: element counts of the caller's buffers (see :data:`BUFFERS`).
        root: the root rank of rooted collectives (0 otherwise).
        seg: elements per pipeline segment (at least 1).
        hosts: the host of every rank, as host numbers 0, 1, ... in order of each
            host's first rank (``hosts[r]`` is rank r's host); empty when every rank
            is on one host. From the launcher (MPI's shared-memory split, torchrun's
            nodes) or ``RINGCOMM_LOCAL_SIZE``.
        itemsize: bytes of one element of the call's dtype (4 where a caller does not
            say): for a builder that chooses by message size in bytes, as measured
            tables are (a schedule's steps are in elements whatever the dtype).
    """
    collective: str
    size: int
    rank: int
    layout: tuple
    root: int = 0
    seg: int = 1 << 30
    hosts: tuple = ()
    itemsize: int = 4

    def host_of(self, rank: int) -> int:
        """The host number of ``rank`` (0 when every rank is on one host)."""
        return self.hosts[rank] if self.hosts else 0

    def host_ranks(self) -> list[list[int]]:
        """The ranks of each host, hosts in order, ranks ascending."""
        if not self.hosts:
            return [list(range(self.size))]
        out: list[list[int]] = [[] for _ in range(max(self.hosts) + 1)]
        for r, h in enumerate(self.hosts):
            out[h].append(r)
        return out


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One rank's steps for one collective call shape."""
    ctx: Context
    nbuffers: int  # caller buffers: ids 0 .. nbuffers-1
    scratch: tuple[int, ...]  # element counts of scratch buffers nbuffers, nbuffers+1, ...
    steps: tuple[Step, ...]

    def buffer_len(self, buf: int, caller_lens: Sequence[int | None]) -> int | None:
        if buf < self.nbuffers:
            return caller_lens[buf]
        return self.scratch[buf - self.nbuffers]


#: scratch slots per receiving peer in pipelined reductions: the MPI executor may
#: post that many receives ahead, so scratch memory stays bounded (``SCRATCH_SLOTS``
#: segments per peer) whatever the message size
SCRATCH_SLOTS = 4
#: SCRATCH_SLOTS's first name, for algorithms written with it (it was no window)
WINDOW = SCRATCH_SLOTS


def split_even(rg: "Region | tuple", parts: int) -> list[Region]:
    """``parts`` consecutive regions covering ``rg`` whose lengths differ by at most
    one (the first ``rg.n % parts`` are the longer ones); some are empty when
    ``rg.n < parts``. Every rank computes the same split from the same length, which
    is what lets ranks agree on chunk boundaries without exchanging them.

    Raises:
        ValueError: ``parts`` < 1.

    Example::

        >>> [r.n for r in split_even((0, 0, 10), 4)]
        [3, 3, 2, 2]
    """
    rg = _region(rg)
    if parts < 1:
        raise ValueError(f"split_even: parts must be at least 1, got {parts}")
    base, extra = divmod(rg.n, parts)
    out, a = [], rg.off
    for i in range(parts):
        ln = base + (1 if i < extra else 0)
        out.append(Region(rg.buf, a, ln))
        a += ln
    return out


def pieces(rg: "Region | tuple", seg: int) -> list[Region]:
    """``rg`` cut into pipeline segments of at most ``seg`` elements, in order (none
    when ``rg`` is empty). Pass ``ctx.seg`` to cut as the group's segment size says.

    Raises:
        ValueError: ``seg`` < 1.
    """
    rg = _region(rg)
    if seg < 1:
        raise ValueError(f"pieces: seg must be at least 1, got {seg}")
    end = rg.off + rg.n
    return [Region(rg.buf, a, min(seg, end - a)) for a in range(rg.off, end, seg)]


def binomial_tree(rank: int, size: int, root: int = 0) -> tuple[int | None, list[int]]:
    """Parent (None at the root) and children of ``rank`` in a binomial tree of
    ``size`` ranks rooted at ``root``: depth ceil(log2 size).

    With the relative rank ``v = rank - root (mod size)``, the parent clears v's
    lowest set bit and the children are ``v + 2**k`` for every ``2**k`` below that
    bit. Children come largest subtree first, the order in which a broadcast
    should feed them.
    """
    if not 0 <= rank < size or not 0 <= root < size:
        raise ValueError(f"binomial_tree: rank {rank} and root {root} must be in "
                         f"0..{size - 1}")
    v = (rank - root) % size
    parent = None if v == 0 else ((v & (v - 1)) + root) % size
    low = v & -v if v else 1 << size.bit_length()
    kids, k = [], 1
    while k < low and v + k < size:
        kids.append((v + k + root) % size)
        k <<= 1
    return parent, kids[::-1]


def _region(r) -> Region:
    if type(r) is Region:
        return r
    buf, off, n = r
    return Region(int(buf), int(off), int(n))


def _placed(op, region):
    """Local op ``op`` with its regions passed through ``region`` (its other fields
    kept); anything else rebuilt as it came, for the checker to refuse by name."""
    if type(op) in _LOCAL_OPS and region is _region and type(op.dst) is Region \
            and type(op.src) is Region:
        return op  # already as built
    if isinstance(op, (Reduce, Copy)):
        return op._replace(dst=region(op.dst), src=region(op.src))
    return type(op)(region(op.dst), region(op.src))


_LOCAL_OPS = (Reduce, Copy)


class Builder:
    """Collects steps for one rank; :meth:`build` returns the :class:`Schedule`.

    Regions may be given as ``Region`` or plain ``(buffer, offset, length)`` tuples.
    """

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self._nbuf = buffer_count(ctx.collective, ctx.size)
        self._scratch: list[int] = []
        self._steps: list[Step] = []

    def scratch(self, n: int) -> int:
        """A private work buffer of ``n`` elements; returns its buffer id."""
        self._scratch.append(int(n))
        return self._nbuf + len(self._scratch) - 1

    def step(self, sends: Iterable = (), recvs: Iterable = (), local: Iterable = ()) -> None:
        """Append a step. ``sends``/``recvs`` hold ``(peer, region)`` pairs; ``local``
        holds :class:`Reduce`/:class:`Copy` ops run after the messages complete.
        A step with nothing in it is dropped."""
        s = tuple([Xfer(int(p), _region(r)) for p, r in sends])
        r = tuple([Xfer(int(p), _region(x)) for p, x in recvs])
        loc = tuple([_placed(op, _region) for op in local])
        if s or r or loc:
            self._steps.append(Step(s, r, loc))

    def local(self, *ops) -> None:
        """Append local work only (no messages), e.g. copying the input into place."""
        self.step(local=ops)

    def include(self, sub: Schedule, ranks: Sequence[int],
                buffers: Sequence["int | Region | tuple"] | Mapping[int, "int | Region | tuple"]
                ) -> None:
        """Append the steps of ``sub``, a schedule built for a subgroup, to this one.

        ``sub`` is this rank's schedule of a collective among ``ranks`` (its rank
        ``i`` is this group's rank ``ranks[i]``), built by any builder from a
        :class:`Context` of the subgroup. Its peers are mapped through ``ranks``, its
        caller buffers onto this builder's regions through ``buffers``, and each of
        its scratch buffers becomes a new scratch buffer here. Every rank of the
        subgroup must include its own schedule at the same point of its steps (the
        others include nothing), so messages still match in order.

        Args:
            sub: the subgroup schedule of this rank (``sub.ctx.rank`` is this rank's
                position in ``ranks``).
            ranks: this group's rank of each subgroup rank.
            buffers: for each of ``sub``'s caller buffers (in the order of
                :data:`BUFFERS`), where it lives here: a buffer id (from offset 0) or a
                region ``(buffer, offset, length)`` whose length is that buffer's.
                A mapping ``{sub buffer: target}`` may leave out buffers ``sub``
                does not use.
        Raises:
            ValueError: ``ranks`` does not fit ``sub`` (size, duplicates, out of range,
                or not placing this rank at ``sub.ctx.rank``), or a buffer is missing or
                has the wrong length.

        Example: an allreduce among the even ranks, by any registered builder::

            evens = list(range(0, ctx.size, 2))
            if ctx.rank in evens:
                sub = ring_allreduce(Context("allreduce", len(evens), evens.index(ctx.rank),
                                             ctx.layout, seg=ctx.seg))
                b.include(sub, ranks=evens, buffers=[0])
        """
        me, sctx = self.ctx, sub.ctx
        ranks = [int(x) for x in ranks]
        where = f"Builder.include ({sctx.collective} of {sctx.size} ranks into rank {me.rank})"
        if len(ranks) != sctx.size:
            raise ValueError(f"{where}: ranks lists {len(ranks)} ranks, the schedule was built "
                             f"for {sctx.size}")
        if len(set(ranks)) != len(ranks) or any(not 0 <= x < me.size for x in ranks):
            raise ValueError(f"{where}: ranks {ranks} must be distinct ranks of this group "
                             f"(0..{me.size - 1})")
        if ranks[sctx.rank] != me.rank:
            raise ValueError(f"{where}: the schedule is subgroup rank {sctx.rank}'s, which "
                             f"ranks maps to rank {ranks[sctx.rank]}, not to this rank")
        targets = dict(buffers) if isinstance(buffers, Mapping) else dict(enumerate(buffers))
        lens = buffer_lengths(sctx)
        base: dict[int, Region] = {}
        for i, t in targets.items():
            if not 0 <= i < sub.nbuffers:
                raise ValueError(f"{where}: buffers names buffer {i}; the schedule has "
                                 f"{sub.nbuffers} caller buffers")
            if isinstance(t, int):
                t = Region(t, 0, lens[i] or 0)
            t = _region(t)
            if lens[i] is not None and t.n != lens[i]:
                raise ValueError(f"{where}: buffer {i} has {lens[i]} elements, but is mapped "
                                 f"onto {tuple(t)} of {t.n}")
            base[i] = t
        fresh = [self.scratch(n) for n in sub.scratch]

        def region(rg: Region) -> Region:
            if rg.buf >= sub.nbuffers:
                return Region(fresh[rg.buf - sub.nbuffers], rg.off, rg.n)
            t = base.get(rg.buf)
            if t is None:
                raise ValueError(f"{where}: the schedule uses its buffer {rg.buf}, which "
                                 "buffers does not map")
            return Region(t.buf, t.off + rg.off, rg.n)

        for st in sub.steps:
            self._steps.append(Step(
                tuple(Xfer(ranks[x.peer], region(x.region)) for x in st.sends),
                tuple(Xfer(ranks[x.peer], region(x.region)) for x in st.recvs),
                tuple(_placed(op, region) for op in st.local)))

    def build(self) -> Schedule:
        return Schedule(self.ctx, self._nbuf, tuple(self._scratch), tuple(self._steps))


# -- the caller's buffers, per collective ------------------------------------------
#: collective -> (description of the caller's buffers, description of ``layout``).
#: ``p`` is the world size; buffer ids are positions in the list the caller binds.
BUFFERS: dict[str, tuple[str, str]] = {
    "allreduce": ("0: data (in place)", "(n,)"),
    "broadcast": ("0: data (the root's is sent, the others' received)", "(n,)"),
    "reduce": ("0: data (the result lands in the root's; others' may be overwritten)", "(n,)"),
    "allgather": ("0..p-1: chunk i (output), p: this rank's input", "(count of chunk 0, ..., p-1)"),
    "reduce_scatter": ("0..p-1: chunk i (input, may be overwritten), p: output",
                       "(count of chunk 0, ..., p-1)"),
    "gather": ("0..p-1: chunk i (root only, output), p: this rank's input",
               "(count 0, ..., p-1); on non-roots only the own count is known, others None"),
    "scatter": ("0..p-1: chunk i (root only, input), p: this rank's output",
                "(count 0, ..., p-1); on non-roots only the own count is known, others None"),
    "alltoall": ("0..p-1: send chunk for rank j, p..2p-1: receive chunk from rank i",
                 "((send counts), (receive counts))"),
    "barrier": ("0: this rank's one-element entry token", "(1,)"),
}

#: collectives whose schedules combine values with the reduce op
REDUCING = frozenset({"allreduce", "reduce", "reduce_scatter"})


def buffer_count(collective: str, size: int) -> int:
    """Number of caller buffers of ``collective`` on ``size`` ranks."""
    if collective in ("allreduce", "broadcast", "reduce"):
        return 1
    if collective in ("allgather", "reduce_scatter", "gather", "scatter"):
        return size + 1
    if collective == "alltoall":
        return 2 * size
    if collective == "barrier":
        return 1
    raise ValueError(f"ringcomm: unknown collective {collective!r}; known: {sorted(BUFFERS)}")


def buffer_lengths(ctx: Context) -> list[int | None]:
    """Element count of each caller buffer on ``ctx.rank`` (None: not bound there)."""
    p, r, lay = ctx.size, ctx.rank, ctx.layout
    c = ctx.collective
    if c in ("allreduce", "broadcast", "reduce"):
        return [lay[0]]
    if c == "allgather":
        return [*lay, lay[r]]
    if c == "reduce_scatter":
        return [*lay, lay[r]]
    if c in ("gather", "scatter"):
        return [*(lay if r == ctx.root else [None] * p), lay[r]]
    if c == "alltoall":
        return [*lay[0], *lay[1]]
    if c == "barrier":
        return [lay[0]]
    raise ValueError(f"ringcomm: unknown collective {c!r}; known: {sorted(BUFFERS)}")


#: a schedule builder
BuildFn = Callable[[Context], Schedule]
