"""Collective algorithms as schedule builders (see :mod:`ringcomm.schedule`).

``REGISTRY[collective][name]`` is a builder ``build(ctx) -> Schedule``, or a
:class:`TransportCollective`: a collective a transport runs itself, not as a
schedule, declared by :func:`register_transport_collective`: :data:`NATIVE` (the
transport library's own, MPI's on CPU) and :data:`SHM_DIRECT` (the shared-memory
transport's, every rank on one host).
The caller's buffers and the layout each collective's builders get are listed
in :data:`ringcomm.schedule.BUFFERS`.

A new algorithm is a builder plus :func:`register_algorithm`; the checker
proves a user's builder right on the first use of each call shape.
"""
from __future__ import annotations

from typing import Callable, Mapping

from ringcomm.algorithms import barrier, linear, recursive_doubling, ring, tree
from ringcomm.schedule import BUFFERS


class TransportCollective:
    """Marker: the algorithm named ``name`` is a collective the group's transport runs
    itself (:meth:`ringcomm.transport.Transport.check_own`, ``own_init``), not a
    schedule; a transport that has none of that name refuses the call, saying that
    the algorithm needs ``where``."""

    __slots__ = ("name", "collectives", "where")

    def __init__(self, name: str, collectives: tuple[str, ...], where: str):
        self.name, self.collectives, self.where = name, tuple(collectives), where

    def __repr__(self) -> str:
        return self.name.upper()


def is_schedule(build) -> bool:
    """Whether a registry entry is a schedule builder (not a transport's collective)."""
    return not isinstance(build, TransportCollective)

REGISTRY: dict[str, dict[str, Callable]] = {
    "allreduce": {"ring": ring.allreduce, "tree": tree.allreduce,
                  "recursive_doubling": recursive_doubling.allreduce},
    "broadcast": {"tree": tree.broadcast, "ring": ring.broadcast},
    "reduce": {"tree": tree.reduce},
    "allgather": {"ring": ring.allgather},
    "reduce_scatter": {"ring": ring.reduce_scatter},
    "barrier": {"dissemination": barrier.dissemination},
    "gather": {"linear": linear.gather},
    "scatter": {"linear": linear.scatter},
    "alltoall": {"linear": linear.alltoall},
}
#: names no schedule may take: ``auto`` and every transport's own collective
RESERVED = {"auto"}


def register_transport_collective(name: str, collectives: tuple[str, ...],
                                  where: str) -> TransportCollective:
    """Declare ``name`` as a collective that a transport runs itself for each of
    ``collectives``: it becomes selectable like an algorithm, and a group whose
    transport's ``check_own`` does not know it refuses the call with ``where`` (what
    it needs). The transport implements ``check_own`` and ``own_init`` for it (see
    docs/architecture.md, "Writing a transport"). Declaring the same name again with
    the same collectives returns the declaration made first.

    Raises:
        ValueError: an unknown collective, or ``name`` taken by a schedule or declared
            with other collectives.
    """
    unknown = [c for c in collectives if c not in REGISTRY]
    if unknown or not collectives:
        raise ValueError(f"ringcomm.register_transport_collective: unknown collective(s) "
                         f"{unknown or list(collectives)}; known: {sorted(REGISTRY)}")
    for c in collectives:
        had = REGISTRY[c].get(name)
        if had is not None and not (isinstance(had, TransportCollective)
                                    and had.collectives == tuple(collectives)):
            raise ValueError(f"ringcomm.register_transport_collective: {c} algorithm "
                             f"{name!r} exists")
    first = REGISTRY[collectives[0]].get(name)
    if first is not None:
        return first
    own = TransportCollective(name, collectives, where)
    for c in collectives:
        REGISTRY[c][name] = own
    RESERVED.add(name)
    return own


#: the transport library's own collective, for every collective (MPI's, NCCL's)
NATIVE = register_transport_collective(
    "native", tuple(REGISTRY), "a transport with collectives of its own (MPI's on CPU, "
    "NCCL's on CUDA)")
#: the shared-memory transport's one-round collectives: every rank copies its part
#: into its segment once and reads the peers' parts from theirs
#: (:mod:`ringcomm.transport.shm.direct`); only where every rank shares one host
SHM_DIRECT = register_transport_collective(
    "shm_direct", ("allreduce", "broadcast", "allgather", "reduce_scatter", "barrier"),
    "the shared-memory transport with every rank of the group on one host")

#: builders that ship with ringcomm's own algorithms (proved by the test suite)
BUILTIN = {(c, n) for c, algos in REGISTRY.items() for n in algos}
#: builders run without a check: the built-ins and any registered with
#: ``verify=False``; others are checked on first use of each call shape
TRUSTED = set(BUILTIN)


#: called in order as ``fn(collective, name)`` before an algorithm is removed: each
#: forgets what it holds of the algorithm, or refuses (ValueError) before it forgets
#: anything; the ones before it have forgotten theirs by then. The one registered is
#: :mod:`ringcomm.algorithms.select`'s (its tuning), so this package need not import
#: the module that imports it
ON_UNREGISTER: list[Callable[[str, str], None]] = []

#: bumped whenever a registration changes, so caches of built schedules drop
#: entries made by a replaced builder
generation = 0


def register_algorithm(collective: str, name: str, build: Callable, *,
                       replace: bool = False, verify: bool = True) -> None:
    """Make schedule builder ``build`` selectable as algorithm ``name`` for ``collective``.

    Args:
        collective: one of ``REGISTRY``'s keys.
        name: the name used in ``RINGCOMM_ALGO``, ``Options`` and ``set_algorithm``;
            ``"auto"`` and the transports' own collectives (``"native"``,
            ``"shm_direct"``: :data:`RESERVED`) are reserved.
        build: ``build(ctx: ringcomm.schedule.Context) -> ringcomm.schedule.Schedule``.
            It is checked (:func:`ringcomm.execution.checker.check`) on the first use of each
            call shape, and refused with the step and element at fault if wrong.
        replace: allow replacing an existing algorithm of that name.
        verify: check ``build`` on the first use of each call shape (the default).
            ``False`` trusts it as ringcomm trusts its built-ins: for a builder whose
            own tests prove it (``ringcomm.execution.checker.check`` over the shapes it will
            meet), where the check's cost matters (it grows with the world size; an
            all-to-all whose splits change every call is checked at every call).
    Raises:
        ValueError: unknown collective, reserved or taken name, or ``build`` not callable.

    Example::

        def swap_sum(ctx):                 # two ranks: exchange and add
            b = Builder(ctx); n = ctx.layout[0]; tmp = b.scratch(n)
            b.step(sends=[(1 - ctx.rank, (0, 0, n))], recvs=[(1 - ctx.rank, (tmp, 0, n))],
                   local=[Reduce((0, 0, n), (tmp, 0, n))])
            return b.build()
        ringcomm.register_algorithm("allreduce", "swap_sum", swap_sum)
    """
    global generation
    if collective not in REGISTRY:
        raise ValueError(f"ringcomm.register_algorithm: unknown collective {collective!r}; "
                         f"known: {sorted(REGISTRY)}")
    if name in RESERVED:
        raise ValueError(f"ringcomm.register_algorithm: {name!r} is reserved")
    if name in REGISTRY[collective] and not replace:
        raise ValueError(f"ringcomm.register_algorithm: {collective} algorithm {name!r} "
                         "exists; pass replace=True to override it")
    if not callable(build):
        raise ValueError(f"ringcomm.register_algorithm: {build!r} is not callable")
    REGISTRY[collective][name] = build
    BUILTIN.discard((collective, name))
    if verify:
        TRUSTED.discard((collective, name))
    else:
        TRUSTED.add((collective, name))
    generation += 1


def unregister_algorithm(collective: str, name: str) -> None:
    """Remove algorithm ``name`` that :func:`register_algorithm` added for
    ``collective``; calls prepared with it are never found again (a group whose
    choice it still is must choose again before its next call of ``collective``).

    Raises:
        ValueError: unknown collective or name, or a built-in algorithm.
    """
    global generation
    if collective not in REGISTRY or name not in REGISTRY[collective]:
        raise ValueError(f"ringcomm.unregister_algorithm: no {collective} algorithm {name!r}")
    if (collective, name) in BUILTIN:
        raise ValueError(f"ringcomm.unregister_algorithm: {collective} algorithm {name!r} "
                         "is built in")
    if not is_schedule(REGISTRY[collective][name]):
        raise ValueError(f"ringcomm.unregister_algorithm: {collective} algorithm {name!r} "
                         "is a transport's own collective")
    for forget in ON_UNREGISTER:
        forget(collective, name)
    del REGISTRY[collective][name]
    TRUSTED.discard((collective, name))
    generation += 1


def names(collective: str) -> list[str]:
    """Algorithms available for ``collective`` (``auto`` included)."""
    return ["auto", *REGISTRY[collective]]


def check_choice(collective: str, name: str) -> None:
    """Raise ``ValueError`` unless ``name`` (or ``"auto"``) is an algorithm of ``collective``."""
    if collective not in REGISTRY:
        raise ValueError(f"ringcomm: unknown collective {collective!r}; known: {sorted(REGISTRY)}")
    if name != "auto" and name not in REGISTRY[collective]:
        raise ValueError(f"ringcomm: no {collective} algorithm {name!r}; available: "
                         f"{names(collective)}. {IMPORT_FIRST}")


#: the end of an unknown algorithm's error: a group checks its choices when it is
#: made, and a user's algorithm exists once its module has registered it
IMPORT_FIRST = ("An algorithm of your own is known once the module that calls "
                "register_algorithm for it is imported: import it before "
                "init_process_group or new_group makes the group, or before "
                "ringcomm.set_algorithm names it.")


def expand_choices(choices: Mapping[str, str]) -> dict[str, str]:
    """Algorithm choices as ``RINGCOMM_ALGO`` and :class:`ringcomm.Options` give
    them (key ``"*"``: every collective that has that algorithm; a named collective
    wins over it) -> ``{collective: name}``, every name checked.

    Raises:
        ValueError: an unknown collective or algorithm name.
    """
    out: dict[str, str] = {}
    star = choices.get("*")
    if star is not None:
        if star != "auto" and not any(star in a for a in REGISTRY.values()):
            raise ValueError(f"ringcomm: no collective has an algorithm {star!r} "
                             f"(RINGCOMM_ALGO or Options.algorithms). {IMPORT_FIRST}")
        out.update({c: star for c, algos in REGISTRY.items() if star in algos or star == "auto"})
    for coll, name in choices.items():
        if coll != "*":
            check_choice(coll, name)
            out[coll] = name
    return out


__all__ = ["REGISTRY", "NATIVE", "SHM_DIRECT", "TransportCollective", "is_schedule",
           "BUFFERS", "register_algorithm", "unregister_algorithm",
           "names", "check_choice", "expand_choices"]
