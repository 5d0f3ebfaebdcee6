"""Setting up a group's shared memory, collectively over its MPI communicator: who
shares a host, whether every rank wants it, each rank's segment made, mapped by its
peers and unlinked, and the :class:`ShmTransport` over them (or the MPI transport
alone, with a warning that says why)."""
from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import Any, Sequence

import numpy as np

from ringcomm import machine, mpi_serial, settings
from ringcomm.transport.base import Transport
from ringcomm.transport.shm.fifo import Pair
from ringcomm.transport.shm.liveness import alive
from ringcomm.transport.shm.segment import (LINE, MAGIC, Geometry, Window, make_segment,
                                            map_segment, unlink)
from ringcomm.transport.shm.transport import ShmTransport

log = logging.getLogger("ringcomm")


def connect(inner: Transport, comm, hosts: Sequence[int], channel: int = 0,
            enabled: bool | None = None, setup_s: float | None = None) -> Transport:
    """A :class:`ShmTransport` over ``inner`` for the ranks of the group that share a
    host with this one, or ``inner`` itself where none does, shared memory is turned
    off (``enabled`` False, ``RINGCOMM_SHM=0`` where it is None; off on every rank if
    off on any, with a warning) or could not be set up on some rank (then with a
    warning that says why). Collective over ``comm``, the group's MPI communicator,
    whose ranks are ``inner``'s (every rank makes the same collective calls, whatever
    happens to its own segment); ``hosts`` is the group's host layout (empty: one
    host). A rank on a host of its own maps nothing. Each of its collectives may take
    ``setup_s`` (None: ``RINGCOMM_CONNECT_TIMEOUT``), then it raises
    ``DistBackendError`` and leaves nothing in the segments' directory.
    """
    size, rank = inner.size, inner.rank
    if size < 2:
        return inner
    limit = mpi_serial.limit(setup_s)

    def allgather(obj: Any) -> list:
        return mpi_serial.allgather(comm, obj, "shared-memory set-up", limit)

    on = settings.get("RINGCOMM_SHM") if enabled is None else bool(enabled)
    # one exchange: each rank's machine, pid and whether it wants shared memory
    machines = allgather((machine.identity(), os.getpid(), on))
    if not all(m[2] for m in machines):
        if on and channel == 0:
            log.warning("ringcomm: shared memory is off on ranks %s of this group (on "
                        "elsewhere): every rank of the group uses MPI",
                        [r for r, m in enumerate(machines) if not m[2]])
        return inner
    mine = hosts[rank] if hosts else 0
    local = [r for r in range(size)
             if (hosts[r] if hosts else 0) == mine and machines[r][0] == machines[rank][0]]
    if max(allgather(len(local))) < 2:
        return inner
    directory = settings.get("RINGCOMM_SHM_DIR")
    geo = Geometry(len(local) - 1, settings.get("RINGCOMM_SHM_SLOTS"),
                   settings.get("RINGCOMM_SHM_SLOT_BYTES"),
                   settings.get("RINGCOMM_SHM_DIRECT_BYTES") if len(local) == size else 0)
    token = mpi_serial.bcast(comm, uuid.uuid4().hex[:16] if rank == 0 else None, 0,
                             "shared-memory set-up", limit)

    def path(r: int) -> str:
        return os.path.join(directory, f"ringcomm-{token}-c{channel}-r{r}")

    own, why = None, None
    if len(local) > 1:
        own, why = make_segment(path(rank), geo.nbytes, directory, len(local) - 1, rank)
    maps: list = [] if own is None else [own]
    try:
        problems = [p for p in allgather(why) if p]
        if not problems:
            why = None
            try:
                maps += [map_segment(path(r), geo.nbytes) for r in local if r != rank]
            except OSError as e:
                why = f"rank {rank} cannot map a peer's segment: {e}"
            problems = [p for p in allgather(why) if p]
    finally:
        # every rank has mapped, or given up on, every segment (or the set-up failed):
        # unlinked now, and on every rank before any returns, so a rank killed from
        # here on leaves nothing behind
        if own is not None:
            unlink(path(rank))
    mpi_serial.barrier(comm, "shared-memory set-up", limit)
    if problems:
        maps.clear()  # unmapped as they are collected
        log.warning("ringcomm: shared memory is not used for this group, which runs over MPI "
                    "instead: %s. Give the directory more space (docker run --shm-size), "
                    "point RINGCOMM_SHM_DIR at a larger tmpfs, or set RINGCOMM_SHM=0",
                    "; ".join(sorted(set(problems))))
        return inner
    if len(local) < 2:
        return inner
    tp = _assemble(inner, rank, local, machines, geo, maps)
    tp.segments = [path(r) for r in local]
    return tp


def _assemble(inner: Transport, rank: int, local: list[int], machines: list, geo: Geometry,
              maps: list) -> ShmTransport:
    """The transport over mapped segments: ``maps[0]`` this rank's, then its local
    peers' in rank order."""
    others = [r for r in local if r != rank]
    # 8-byte integers through a memoryview: one aligned load or store each, read as a
    # Python int (numpy's element access costs twice as much)
    words = [(mm, memoryview(mm).cast("B").cast("q")) for mm in maps]
    own_mm, own = words[0]
    own[1] = os.getpid()
    own[0] = MAGIC

    def peers_of(r: int) -> list[int]:
        return [q for q in local if q != r]

    def slots(mm, j: int) -> list:
        return [np.frombuffer(mm, dtype=np.uint8, count=geo.slot_bytes,
                              offset=geo.slot_at(j, s)) for s in range(geo.slots)]

    pairs: dict[int, Pair] = {}
    index = {rank: 0}
    for i, q in enumerate(others, 1):
        index[q] = i
        pair = Pair(q)
        j_out = others.index(q)  # q's outbox, and q's tail counter, in this rank's segment
        j_in = peers_of(q).index(rank)  # this rank's, in q's segment
        q_mm, pair.in_ = words[i]
        pair.out = own
        pair.head_out = geo.outbox_at(j_out) // 8
        pair.meta_out = pair.head_out + LINE // 8
        pair.tail_in = geo.tail_at(j_out) // 8
        pair.head_in = geo.outbox_at(j_in) // 8
        pair.meta_in = pair.head_in + LINE // 8
        pair.tail_peer = geo.tail_at(j_in) // 8
        pair.slots_out = slots(own_mm, j_out)
        pair.slots_in = slots(q_mm, j_in)
        pairs[q] = pair
    pids = {q: machines[q][1] for q in others if alive(machines[q][1])}
    tp = ShmTransport(inner, pairs, geo, words, index, pids, socket.gethostname())
    if geo.direct_bytes and len(local) == inner.size:
        tp.direct = Window(geo, [words[index[r]] for r in range(inner.size)])
    return tp
