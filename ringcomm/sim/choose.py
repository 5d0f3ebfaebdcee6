"""``auto`` by simulated time, where nothing was measured.

With ``RINGCOMM_TOPOLOGY=FILE`` (or ``Options(topology=...)``) the planner asks
:class:`Chooser` for the calls its measured tables do not cover: every registered
schedule algorithm of the collective is simulated on the topology for the call's
size band (:func:`band`: sizes are rounded up to a power of two) and the fastest
that the checker accepts runs. Every rank computes the same choice from the same
file and code; times are compared at three significant digits, ties going to the
first name in registry order, so that last-bit differences between machines
cannot make ranks choose differently.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from ringcomm.sim.cell import Result, simulate
from ringcomm.sim.topology import Topology, load

log = logging.getLogger("ringcomm")

#: seconds one simulated cell may take inside a training job
CELL_BUDGET_S = 20.0
#: collectives whose size auto knows (the others are chosen without one)
SIZED = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter")


def band(nbytes: int) -> int:
    """The size a call of ``nbytes`` is simulated at: the next power of two."""
    return 1 << max(int(nbytes) - 1, 0).bit_length()


class Chooser:
    """Simulated choices for a group of ``size`` ranks on the topology at ``path``.

    Raises:
        ValueError: the topology file cannot be read (the message names it and the
            key at fault).
    """

    def __init__(self, path: str, size: int, segment_bytes: int):
        try:
            self.topo: Topology | None = load(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"ringcomm: RINGCOMM_TOPOLOGY / Options.topology: {e}") from None
        self.path = path
        self.size = size
        self.segment_bytes = segment_bytes
        self.why_not = None
        if self.topo.size != size:
            self.why_not = (f"{path} describes {self.topo.size} ranks, this group has {size}")
            self.topo = None
        self._cache: dict[tuple[str, int], tuple[str, list[Result]] | None] = {}

    def choose(self, collective: str, nbytes: int,
               candidates: dict[str, Callable]) -> tuple[str, list[Result]] | None:
        """The fastest of ``candidates`` (name -> builder) for a ``collective`` of
        ``nbytes`` as auto counts them (one rank's chunk for allgather and
        reduce_scatter), and every candidate's result; None where the topology
        cannot say (another group size, a collective without a size, nothing
        timed)."""
        if self.topo is None or collective not in SIZED or nbytes <= 0:
            return None
        total = nbytes * self.size if collective in ("allgather", "reduce_scatter") else nbytes
        key = (collective, band(total))
        if key not in self._cache:
            began = time.monotonic()
            results = [simulate(collective, name, build, self.topo, key[1],
                                segment_bytes=self.segment_bytes, budget_s=CELL_BUDGET_S)
                       for name, build in candidates.items()]
            timed = [r for r in results if r.seconds is not None]
            best = min(timed, key=lambda r: float(f"{r.seconds:.3g}")) if timed else None
            self._cache[key] = (best.algorithm, results) if best else None
            log.info("ringcomm auto: simulated %s of %d B on %s in %.1f s: %s", collective,
                     key[1], self.path, time.monotonic() - began,
                     ", ".join(f"{r.algorithm} {r.seconds * 1e6:.1f} us" if r.seconds
                               is not None else f"{r.algorithm} ({r.refused})"
                               for r in results))
        return self._cache[key]
