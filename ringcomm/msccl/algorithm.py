"""An MSCCL algorithm as a ringcomm algorithm: :class:`Algorithm` (the XML read,
translated per call shape and proven), :func:`load`, :func:`register` (for
``ringcomm.register_msccl``) and :func:`to_xml` (any registered schedule as MSCCL XML).

The stages underneath: :mod:`ringcomm.msccl.xmlformat` reads and writes the XML,
:mod:`ringcomm.msccl.translate` turns a program into every rank's steps,
:mod:`ringcomm.msccl.export` turns schedules into a program; the checker
(:mod:`ringcomm.execution.checker`) proves what runs.
"""
from __future__ import annotations

import collections
import os
import re
import threading

from ringcomm.schedule import Context, Schedule, ScheduleError, ShapeNotServed
from ringcomm.msccl import export as _export
from ringcomm.msccl import translate as _tr
from ringcomm.msccl.xmlformat import WHOLE, Program, parse, write

__all__ = ["Algorithm", "load", "register", "to_xml"]

#: translations an algorithm keeps (one per call shape), least recent dropped
CACHE = 16
_NAME = re.compile(r"[A-Za-z0-9_.\-]+$")


class Algorithm:
    """An MSCCL algorithm, read and proven; :meth:`build` is its schedule builder.

    Attributes:
        program: the XML as data (:class:`ringcomm.msccl.xmlformat.Program`).
        name: the XML's ``name``.
        collective: ringcomm's collective (``allreduce``, ``allgather``,
            ``reduce_scatter``, ``alltoall``, ``broadcast``, ``reduce``).
        root: a broadcast's or reduce's root (the XML does not state it: the one rank
            that receives, or sends, nothing); None for the others.
        ranks: the world size it is written for (``ngpus``).
        chunks: ``nchunksperloop``.
    """

    def __init__(self, program: Program):
        self.program = program
        self.name = program.name
        self.collective = program.collective
        self.ranks = program.ngpus
        self.chunks = program.nchunksperloop
        self.root = program.root
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._build = _Builder(self)

    def __repr__(self) -> str:
        return (f"<MSCCL {self.collective} {self.name!r}: {self.ranks} ranks, {self.chunks} "
                f"chunks>")

    def translation(self, ctx: Context) -> _tr.Translation:
        """Every rank's steps for ``ctx``'s call shape (made once per shape).

        Raises:
            ShapeNotServed: another world size, unequal blocks, or a count the chunks do
                not divide.
            ValueError: the program cannot finish (naming the XML's steps).
        """
        n = _tr.served_count(self.program, ctx)
        key = (n, ctx.seg)
        with self._lock:
            tr = self._cache.get(key)
            if tr is not None:
                self._cache.move_to_end(key)
                return tr
        tr = _tr.translate(self.program, n, ctx.seg)
        with self._lock:
            self._cache[key] = tr
            while len(self._cache) > CACHE:
                self._cache.popitem(last=False)
        return tr

    @property
    def build(self):
        """The schedule builder (``register_algorithm`` takes it); its
        ``fixed_world_size`` tells the cost model it serves one world size only."""
        return self._build

    def shape(self, multiple: int = 1) -> tuple:
        """The smallest global layout it serves (one element per chunk), times
        ``multiple``, as the checker takes it."""
        return _export.layout(self.collective, self.ranks, self.chunks * multiple)

    def prove(self, multiple: int = 1, seg: int = 1 << 30):
        """Prove it with ringcomm's checker at :meth:`shape` (``multiple`` elements per
        chunk, cut in slices of ``seg``) and return the checker's counts.

        Raises:
            ValueError: it is wrong, naming the rank's step and the XML's gpu, tb and
                step it carries (a size mismatch, a deadlock, a wrong result).
        """
        from ringcomm.execution import checker

        lay, root = self.shape(multiple), self.program.root or 0
        try:
            return checker.check(self.build, self.collective, self.ranks, lay, root=root,
                                 seg=seg)
        except ScheduleError as e:
            ctx = Context(self.collective, self.ranks, 0,
                          checker.local_layout(self.collective, lay, 0, root), root, seg)
            why = _tr.explain(str(e), checker.finding_of(e), self.translation(ctx),
                              self.program)
            raise ValueError(f"MSCCL algorithm {self.name!r} is wrong: {why}") from None


class _Builder:
    """An algorithm's builder: a callable that says which world size it serves."""

    def __init__(self, alg: Algorithm):
        self.alg = alg
        self.fixed_world_size = alg.ranks

    def __call__(self, ctx: Context) -> Schedule:
        alg = self.alg
        if ctx.collective != alg.collective:
            raise ShapeNotServed(f"MSCCL algorithm {alg.name!r} is a {alg.collective}, "
                                 f"not a {ctx.collective}")
        return _tr.schedule_of(alg.translation(ctx), ctx)

    def __repr__(self) -> str:
        return f"<builder of {self.alg!r}>"


def load(source: str | os.PathLike) -> Algorithm:
    """Read an MSCCL algorithm from a path or from XML text, translate it and prove it
    (at one element per chunk, and at two per chunk cut into slices of one, so the
    pipelined form is proven too).

    Raises:
        ValueError: the XML is malformed or wrong, naming its gpu, tb and step.
    """
    alg = Algorithm(parse(source))
    if alg.ranks > 1:
        alg.prove()
        alg.prove(multiple=2, seg=1)
    return alg


def register(source: str | os.PathLike, name: str | None = None, *,
             replace: bool = False, auto: bool = False) -> str:
    """Load an MSCCL algorithm (:func:`load`) and register it for its collective as
    ``name`` (default: the XML's ``name``); return the name. Then ``set_algorithm``,
    ``Options(algorithms=...)``, ``RINGCOMM_ALGO`` and the benchmark's ``--algos``
    take it. Each call shape is proven again before its first run.

    ``auto=True`` also gives it the calls of its ``minBytes``..``maxBytes`` (0: no
    upper bound) on its world size when a group's choice is ``auto``, as MSCCL's
    runtime picks a file; a call in that range it does not serve (a count its chunks
    do not divide) runs auto's usual choice.

    Raises:
        ValueError: the XML is wrong; the name is empty, not a plain word (letters,
            digits, ``_ . -``) or taken (without ``replace``); ``auto`` for an
            alltoall (auto does not see all-to-all sizes).
    """
    from ringcomm.algorithms import REGISTRY, register_algorithm, select

    alg = load(source)
    name = alg.name if name is None else name
    if not name or not _NAME.match(name):
        raise ValueError(f"ringcomm.register_msccl: the algorithm name {name!r} must be "
                         "letters, digits, '_', '.' or '-'; pass name=")
    if auto and alg.collective == "alltoall":
        raise ValueError("ringcomm.register_msccl: auto=True for an alltoall: auto chooses "
                         "all-to-all algorithms without their sizes")
    if name in REGISTRY[alg.collective] and not replace:
        raise ValueError(f"ringcomm.register_msccl: {alg.collective} algorithm {name!r} "
                         "exists; pass replace=True to override it")
    select.remove_bands(alg.collective, name)  # a replaced registration's
    if auto:
        prog = alg.program
        # auto counts one rank's block for allgather and reduce-scatter, MSCCL the whole
        per = 1 if alg.collective in WHOLE else alg.ranks
        select.add_band(alg.collective, alg.ranks, -(-prog.min_bytes // per),
                        prog.max_bytes // per if prog.max_bytes else None, name)
    # registering last: it renews every group's prepared calls, auto's band included
    register_algorithm(alg.collective, name, alg.build, replace=replace)
    return name


def to_xml(collective: str, algorithm: str, world_size: int, chunks: int | None = None,
           name: str | None = None) -> str:
    """MSCCL XML of the registered ``algorithm`` of ``collective`` on ``world_size``
    ranks, with ``chunks`` chunks (``nchunksperloop``; default ``world_size``; a
    multiple of it for allgather, reduce-scatter and alltoall). The schedule is
    built with one element per chunk; the XML reads back (:func:`load`) to the
    same results, and follows msccl-tools' layout for MSCCL's runtime.

    Raises:
        ValueError: an unknown collective or algorithm, ``native``, a world size below
            2 or a chunk count that does not fit.
    """
    from ringcomm.algorithms import REGISTRY, is_schedule

    if collective not in _export.COLL_NAMES:
        raise ValueError(f"ringcomm.msccl.to_xml: {collective!r} has no MSCCL form; "
                         f"exported: {sorted(_export.COLL_NAMES)}")
    build = REGISTRY[collective].get(algorithm)
    if build is None or not is_schedule(build):
        raise ValueError(f"ringcomm.msccl.to_xml: no {collective} schedule named "
                         f"{algorithm!r} (available: "
                         f"{sorted(k for k, v in REGISTRY[collective].items() if is_schedule(v))})")
    if world_size < 2:
        raise ValueError(f"ringcomm.msccl.to_xml: world_size must be at least 2, got "
                         f"{world_size}")
    chunks = world_size if chunks is None else chunks
    if chunks < 1 or (collective not in WHOLE and chunks % world_size):
        raise ValueError(f"ringcomm.msccl.to_xml: chunks={chunks} must be at least 1"
                         + ("" if collective in WHOLE else
                            f" and a multiple of world_size={world_size}"))
    program = _export.export(collective, name or f"{algorithm}_{collective}_{world_size}",
                             build, world_size, chunks)
    return write(program)
