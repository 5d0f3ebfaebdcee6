"""A message size as nccl-tests counts it, as the layout a schedule builder gets.

Pure Python (nothing heavier is imported), so the cost model
(:mod:`ringcomm.bench.cost_model`) and the simulator share it.
"""
from __future__ import annotations

#: collectives with a message size
SIZED = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "gather",
         "scatter", "alltoall")


def _split(n: int, p: int) -> tuple[int, ...]:
    """``n`` as ``p`` counts that differ by at most one (the larger ones first)."""
    base, extra = divmod(int(n), p)
    return tuple(base + (1 if i < extra else 0) for i in range(p))


def layout_for(collective: str, p: int, n: int) -> tuple:
    """The global layout (for :func:`ringcomm.execution.checker.check`) of a message of
    ``n`` elements as nccl-tests counts it: the buffer for allreduce, broadcast and
    reduce; the whole gathered buffer for allgather and gather, the whole input for
    reduce_scatter and scatter (p chunks of n/p); one rank's send buffer for alltoall
    (n/p to each peer).

    Raises:
        ValueError: a collective without a message size.
    """
    if collective in ("allreduce", "broadcast", "reduce"):
        return (int(n),)
    if collective in ("allgather", "reduce_scatter", "gather", "scatter"):
        return _split(n, p)
    if collective == "alltoall":
        row = _split(n, p)
        return tuple(row for _ in range(p))
    raise ValueError(f"no layout for collective {collective!r}; known: {', '.join(SIZED)}")
