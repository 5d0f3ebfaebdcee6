"""Shared-memory transport: the ranks of a group that share a host exchange a
schedule's messages through memory they all map, without MPI's request machinery.

Each rank owns one segment (a file in ``RINGCOMM_SHM_DIR``, ``/dev/shm`` by
default) holding, for every other rank on its host, an outbox: a FIFO of
``RINGCOMM_SHM_SLOTS`` slots of ``RINGCOMM_SHM_SLOT_BYTES`` each, and a counter of
the chunks it published there (``head``). A receiver keeps, in its own segment, a
counter of the chunks it consumed from each peer (``tail``). A message is cut into
slot-sized chunks; the sender copies a chunk into the next free slot, writes its
tag and the message's size beside it and advances ``head``; the receiver, seeing
``head`` ahead of ``tail``, checks the tag and size, copies the chunk out and
advances ``tail``, which frees the slot. Messages between a pair therefore match in
the order they were started, as MPI's do; a message of another call shows at once
(its tag), as does one of another size.

Ranks on other hosts (a group over several hosts) are reached through the MPI
transport this one wraps, as are users' ``dist.send``/``dist.recv`` and MPI's own
collectives (``native``): a schedule's messages go over shared memory where the
peer shares the host, over MPI elsewhere, within one step.

Memory ordering (x86 orders plain stores but not non-temporal ones, which large
copies use; ARM orders neither): every publication is *data, fence, counter* and
every consumption *counter, fence, data, fence, counter*. The fence is
``MPI_Win_sync`` on a window of this process, which MPICH implements as a full
memory barrier (``MPL_atomic_read_write_barrier``: ``mfence`` on x86, ``dmb ish``
on ARM). A counter is one aligned 8-byte store or load (numpy's element access),
which neither architecture tears. A sender reads ``tail`` before it overwrites a
slot and only writes once that load has returned a value that frees the slot: a
store that depends on a load through a branch is not made visible before the load
on either architecture (docs/architecture.md, "Shared memory").

Never hang, never leak: every wait honours the collective's deadline and backs off
from spinning to sleeping (:class:`ringcomm.backoff.Backoff`); a long wait looks at
the peers it waits on, and a peer whose process is gone, or that wrote a failure
into its segment, ends the wait with
:class:`~ringcomm.transport.base.TransportPeerFailed` naming its rank and host. Segments are unlinked as soon as every rank has mapped them, so a rank
killed afterwards leaves nothing in the directory; their space is allocated when
they are made (``posix_fallocate``), so a directory too small fails then, naming
what was needed and what was free, and the group runs over MPI instead.

The package, one idea a module:

* :mod:`~ringcomm.transport.shm.segment`: a rank's segment (layout, making,
  mapping, unlinking, the failure text in its header) and the memory fence;
* :mod:`~ringcomm.transport.shm.fifo`: the FIFOs between two ranks and their
  publish and consume protocol;
* :mod:`~ringcomm.transport.shm.liveness`: how a wait paces itself and learns that
  a peer is gone;
* :mod:`~ringcomm.transport.shm.direct`: ``shm_direct``, the one-round collectives
  on every rank's window, with their waits;
* :mod:`~ringcomm.transport.shm.transport`: :class:`ShmTransport`, which routes each
  message to a FIFO or to MPI and waits on both;
* :mod:`~ringcomm.transport.shm.connect`: the collective set-up (:func:`connect`).
"""
from __future__ import annotations

from ringcomm.transport.shm.connect import connect
from ringcomm.transport.shm.liveness import PROBE_S
from ringcomm.transport.shm.segment import Geometry, Window
from ringcomm.transport.shm.transport import ShmTransport

__all__ = ["connect", "ShmTransport", "Geometry", "Window", "PROBE_S"]
