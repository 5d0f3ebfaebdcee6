"""ringcomm as torchft's replica-group process group (``pip install torchft``).

torchft (fault-tolerant training: a replica group that loses a member goes on without
a restart, and a restarted one heals from a live peer) takes a process group object,
not a backend name, and calls its ``configure()`` at every quorum change, with a new
store prefix and new ranks::

    from torchft import Manager
    from ringcomm.torchft import ProcessGroupRingcommFT

    manager = Manager(pg=ProcessGroupRingcommFT(timeout=timedelta(seconds=10)), ...)

Each ``configure()`` aborts the previous group (its MPI communicators and shared-memory
segments released at once, even with a dead peer in it) and connects the quorum's
members afresh over the store torchft hands over (:func:`ringcomm.connect_group`): no
MPI world is kept from one quorum to the next, and a ringcomm world group in the same
process (the replica's own group) is neither used nor disturbed.

What a dead peer does: on one host the shared-memory transport sees a peer's process
end at once, so the survivor's collective fails with ``TransportPeerFailed`` within
milliseconds; across hosts (MPI) it fails at the group's timeout. Either way the
error reaches torchft through the Work and through :meth:`errored`, torchft does not
commit the step, and the next quorum makes a new group. docs/integrations.md has the
recipe and what torchft itself gets wrong on that path.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from torchft.process_group import ProcessGroupWrapper

from ringcomm.front.create import connect_group

__all__ = ["ProcessGroupRingcommFT"]


class ProcessGroupRingcommFT(ProcessGroupWrapper):
    """A torchft ``ProcessGroupWrapper`` whose group is ringcomm's, made anew at every
    ``configure()``.

    Args:
        timeout: the limit of each group's set-up and of every collective in it.
        options: :class:`ringcomm.Options` for every group it makes (None: defaults).
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60),
                 options: Any = None) -> None:
        super().__init__(timeout=timeout)
        self._options = options
        self._made = 0

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        self._made += 1
        return connect_group(store, rank, world_size, self._timeout, self._options,
                             name=f"torchft-{self._replica_id}-q{self._quorum_id}"
                                  f"-{self._made}")

    def getBackendName(self) -> str:
        return "torchft-ringcomm"

    def errored(self) -> Exception | None:
        """The failure that made the current group unusable (a dead peer, a timeout),
        or None; torchft asks before it commits a step."""
        pg = self._pg
        if pg is None:
            return None
        err = pg.lanes.error()
        return err if isinstance(err, Exception) or err is None else RuntimeError(str(err))

    def shutdown(self) -> None:
        """Release the current group (torchft's own wrapper only forgets it)."""
        pg, self._pg = self._pg, None
        if pg is not None:
            pg.shutdown()
