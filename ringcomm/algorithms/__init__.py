"""Collective algorithms, written once against :class:`ringcomm.transport.Transport`.

``REGISTRY[collective][name]`` is a function; the signature depends on the collective:

=============  ==========================================================
allreduce      ``fn(tp, buf, op, *, segment_bytes)``        in place, 1-D
broadcast      ``fn(tp, buf, root, *, segment_bytes)``      in place, 1-D
reduce         ``fn(tp, buf, op, root, *, segment_bytes)``  result on root
allgather      ``fn(tp, chunks, *, segment_bytes)``         chunks[rank] filled in
reduce_scatter ``fn(tp, chunks, op, *, segment_bytes)``     result in chunks[rank]
barrier        ``fn(tp, *, segment_bytes)``
gather         ``fn(tp, send, chunks, root, *, segment_bytes)`` chunks on root only
scatter        ``fn(tp, chunks, recv, root, *, segment_bytes)`` chunks on root only
alltoall       ``fn(tp, sends, recvs, *, segment_bytes)``   one chunk per rank
=============  ==========================================================

A new algorithm is a function plus :func:`register_algorithm`.
"""
from __future__ import annotations

from typing import Callable

from . import barrier, linear, recursive_doubling, ring, tree

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


def register_algorithm(collective: str, name: str, fn: Callable, *, replace: bool = False) -> None:
    """Make ``fn`` selectable as algorithm ``name`` for ``collective``.

    Args:
        collective: one of ``REGISTRY``'s keys.
        name: the name used in ``RINGCOMM_ALGO``, ``Options`` and ``set_algorithm``;
            ``"auto"`` is reserved.
        fn: the algorithm, with the signature documented in this module.
        replace: allow replacing an existing algorithm of that name.
    Raises:
        ValueError: unknown collective, reserved or taken name.
    """
    if collective not in REGISTRY:
        raise ValueError(f"ringcomm.register_algorithm: unknown collective {collective!r}; "
                         f"known: {sorted(REGISTRY)}")
    if name == "auto":
        raise ValueError("ringcomm.register_algorithm: 'auto' is reserved for the built-in choice")
    if name in REGISTRY[collective] and not replace:
        raise ValueError(f"ringcomm.register_algorithm: {collective} algorithm {name!r} "
                         "exists; pass replace=True to override it")
    if not callable(fn):
        raise ValueError(f"ringcomm.register_algorithm: {fn!r} is not callable")
    REGISTRY[collective][name] = fn


def names(collective: str) -> list[str]:
    """Algorithms available for ``collective`` (``auto`` included)."""
    return ["auto", *REGISTRY[collective]]
