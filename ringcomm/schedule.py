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
with the real library or :mod:`ringcomm.simulator`); :mod:`ringcomm.checker`
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
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, NamedTuple, Sequence


class ScheduleError(ValueError):
    """A schedule is malformed, would deadlock, or computes the wrong result."""


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
    """``dst = dst (op) src``, elementwise, with the collective's reduce op."""
    dst: Region
    src: Region


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
    """
    collective: str
    size: int
    rank: int
    layout: tuple
    root: int = 0
    seg: int = 1 << 30
    hosts: tuple = ()

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

    def segments(self, off: int, n: int) -> list[tuple[int, int]]:
        """``(offset, length)`` pieces of at most ``seg`` elements covering ``n``
        elements from ``off``; none when ``n`` is 0."""
        return [(a, min(self.seg, off + n - a)) for a in range(off, off + n, self.seg)]


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


def _region(r) -> Region:
    if isinstance(r, Region):
        return r
    buf, off, n = r
    return Region(int(buf), int(off), int(n))


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
        s = tuple(Xfer(int(p), _region(r)) for p, r in sends)
        r = tuple(Xfer(int(p), _region(x)) for p, x in recvs)
        loc = tuple(type(op)(_region(op.dst), _region(op.src)) for op in local)
        if s or r or loc:
            self._steps.append(Step(s, r, loc))

    def local(self, *ops) -> None:
        """Append local work only (no messages), e.g. copying the input into place."""
        self.step(local=ops)

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
