"""The backend creator torch calls for each ringcomm group: connects the group's
ranks (a fresh store namespace, MPI's network path, one MPI communicator per
channel) and makes the :class:`ProcessGroupRingcomm` over them."""
from __future__ import annotations

import logging
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ringcomm import mpi_serial
from ringcomm.algorithms import expand_choices
from ringcomm.front.contract import never_a_split_source, options_from_torch
from ringcomm.front import watch
from ringcomm.front.process_group import ProcessGroupRingcomm
from ringcomm.launch import bootstrap
from ringcomm.settings import Options

__all__ = ["create_group", "connect_group", "register", "GROUPS"]

log = logging.getLogger("ringcomm")

#: every ringcomm group alive in this process (their threads stop at exit)
GROUPS: "weakref.WeakSet[ProcessGroupRingcomm]" = weakref.WeakSet()


def create_group(dist_opts: Any, pg_options: Any) -> ProcessGroupRingcomm:
    """Backend creator torch calls (extended API) for each ringcomm group.

    Args:
        dist_opts: torch's ``_DistributedBackendOptions`` (store, group rank and size,
            timeout, group id, the members' global ranks; from torch 2.15 also the
            ``ProcessGroup`` torch made, whose ``bound_device_id`` is the
            ``device_id`` of ``init_process_group``/``new_group``).
        pg_options: :class:`ringcomm.Options`, None, or another backend's options
            (ignored with a warning).
    """
    options = _options(pg_options)  # checked before anything is read or connected
    pg = _connect(dist_opts.store, dist_opts.group_rank, dist_opts.group_size,
                  dist_opts.timeout, options, str(dist_opts.group_id),
                  list(dist_opts.global_ranks_in_group), standalone=False)
    # torch >= 2.15 binds the device on the group it made before asking for ours
    bound = getattr(getattr(dist_opts, "process_group", None), "bound_device_id", None)
    if bound is not None:
        pg.eager_connect_single_device(bound)
    return pg


def connect_group(store: dist.Store, rank: int, size: int,
                  timeout: timedelta = timedelta(minutes=30), options: Any = None,
                  name: str | None = None) -> ProcessGroupRingcomm:
    """A ringcomm group of the ``size`` processes that call this with ``store``, each
    with its own ``rank``, outside torch's registry of groups (as torchft makes its
    replica groups, through :mod:`ringcomm.torchft`).

    The group is connected afresh every time: it neither uses nor becomes the world
    group, so a process may make any number of them, one after another or side by
    side, with other members each time, beside a ringcomm world group or without one.
    Release one with ``shutdown()`` or ``abort()``. It may be made on any thread while
    other groups' collectives run; every MPI step of its set-up after the members meet
    at ``store`` is bounded by ``RINGCOMM_CONNECT_TIMEOUT``. Its ranks' hosts are told
    apart by host name and boot id (``RINGCOMM_LOCAL_SIZE``, which numbers one
    launch's world ranks, does not apply).

    Args:
        store: a c10d store every member reaches (a ``PrefixStore`` of its own for
            each group: the members meet under ``ringcomm/`` in it).
        rank, size: this process's rank in the group, and the group's size.
        timeout: the limit of set-up and of every collective of the group.
        options: :class:`ringcomm.Options` or None.
        name: the group's name in errors and traces.
    Raises:
        ValueError: ``rank`` or ``size`` out of range, or ``timeout`` not positive.
        DistBackendError: members did not arrive within ``timeout``.
    """
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"ringcomm.connect_group: size {size!r} must be a positive int")
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"ringcomm.connect_group: rank {rank!r} must be an int in "
                         f"[0, {size})")
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"ringcomm.connect_group: timeout {timeout!r} must be a positive "
                         "timedelta")
    resolved = _options(options)
    global _standalone
    _standalone += 1
    return _connect(store, rank, size, timeout, resolved,
                    name or f"standalone-{_standalone}", [], standalone=True)


#: how many standalone groups this process made (their default names)
_standalone = 0


def _options(pg_options: Any) -> Options:
    """The group's options, resolved, their algorithm names checked."""
    options = (options_from_torch(pg_options) or Options()).resolve()
    options.algorithms = expand_choices(options.algorithms)
    return options


def _connect(store: Any, rank: int, size: int, timeout: timedelta, options: Options,
             group_id: str, members: list[int], standalone: bool) -> ProcessGroupRingcomm:
    """Connect a group's ranks (a fresh store namespace, MPI's network path, one MPI
    communicator per channel, shared memory on each host) and make its group."""
    transports, cpu_error, hosts = None, None, ()
    torch_store, store = store, bootstrap.fresh_store(store, rank, size, timeout)
    # before MPI starts (importing the MPI transport starts it): its network path
    bootstrap.prepare_network(store, rank, size, timeout, standalone)
    bootstrap.start_world(store, rank, size, timeout, members, standalone)
    try:
        from ringcomm.transport.mpi import MPITransport
    except (ImportError, RuntimeError, OSError) as e:
        # A GPU-only machine may lack the MPI library: CUDA tensors still run over
        # NCCL, CPU tensors get this reason.
        if not torch.cuda.is_available():
            raise
        cpu_error = f"{type(e).__name__}: {e}"
        log.warning("ringcomm: MPI is not available (%s); only CUDA tensors can be used",
                    cpu_error)
    else:
        transports, hosts = _transports(store, rank, size, timeout, options, members,
                                        standalone, MPITransport)
    pg = ProcessGroupRingcomm(rank, size, transports, timeout, options, group_id,
                              store=store, cpu_error=cpu_error, hosts=hosts,
                              torch_store=torch_store, global_ranks=members)
    GROUPS.add(pg)
    if size > 1:
        watch.watch(pg)
    return pg


def _transports(store: Any, rank: int, size: int, timeout: timedelta, options: Options,
                members: list[int], standalone: bool, MPITransport: type) -> tuple[list, tuple]:
    """The group's transports, one per channel, and its host layout. Each MPI step may
    take :func:`ringcomm.launch.bootstrap.setup_limit`; on failure, what was made is
    released (a communicator still used by a blocked MPI call is left to it)."""
    from ringcomm.transport import shm

    limit = bootstrap.setup_limit(timeout)
    comm = bootstrap.group_comm(store, rank, size, members, timeout, standalone)
    comms, transports = [comm], []
    try:
        world_rank = members[rank] if members else rank
        hosts = bootstrap.host_layout(comm, world_rank, options.local_size, standalone, limit)
        # one communicator per channel: messages of different channels never match
        for k in range(1, options.num_channels):
            comms.append(mpi_serial.dup(comm, f"channel {k}'s communicator", limit))
        # ranks sharing a host exchange a schedule's messages through shared memory
        for k, c in enumerate(comms):
            transports.append(MPITransport(c, limit))  # owns c from here
            transports[k] = shm.connect(transports[k], c, hosts, k, options.shared_memory,
                                        limit)
        return transports, hosts
    except BaseException:
        for tp in transports:
            tp.close()
        for c in comms[len(transports):]:
            mpi_serial.locked(c.Free)
        raise


def register() -> None:
    """Register the ``"ringcomm"`` backend with torch (again: nothing happens).

    torch >= 2.15 attaches its flight recorder to a new group unless the group's
    backend records itself; its hooks fire only for collectives torch dispatches in
    C++, which a Python group's are not, so ringcomm counts as recording itself (its
    own timeline: ``RINGCOMM_TRACE``). A bound ringcomm group is never offered as
    the split source of another backend's group
    (:func:`ringcomm.front.contract.never_a_split_source`).
    """
    never_a_split_source()
    if "RINGCOMM" not in dist.Backend._plugins:
        dist.Backend.register_backend("ringcomm", create_group, extended_api=True,
                                      devices=["cpu", "cuda"])
    self_recording = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if self_recording is not None:
        self_recording.add("ringcomm")
