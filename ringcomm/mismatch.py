"""The error of ranks that run different calls, in the user's words, on every
transport.

Without ``RINGCOMM_DEBUG=DETAIL`` a mismatch is found from what a peer's messages
carry: a schedule's tags hold part of the call's signature (a hash of collective,
algorithm, sizes, dtype, reduce op and root), a shared-memory window all of it. A rank
names the peer's call when one of its own recent calls has that signature; else it
says that the messages do not tell, and names the setting that does (DETAIL compares
every call across ranks before it runs, :mod:`ringcomm.front.cross_rank_checks`).
"""
from __future__ import annotations

__all__ = ["CollectiveMismatch", "mismatch", "UNNAMED"]

#: a peer's call that this rank cannot name from what the peer's messages carry
UNNAMED = ("another call, which its messages do not identify (RINGCOMM_DEBUG=DETAIL "
           "compares every call across ranks and names both)")


class CollectiveMismatch(RuntimeError):
    """This rank and a peer run different calls."""


def mismatch(me: int, mine: str, peer: int, theirs: str | None) -> CollectiveMismatch:
    """``rank {me} runs {mine}, but rank {peer} runs {theirs}`` (None: :data:`UNNAMED`),
    with what every rank must agree on."""
    return CollectiveMismatch(
        f"collective mismatch: rank {me} runs {mine}, but rank {peer} runs "
        f"{theirs or UNNAMED}. Every rank must make the same calls in the same order, "
        "with the same reduce op, dtype, sizes and root")
