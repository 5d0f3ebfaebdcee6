"""The backend creator torch calls for each ringcomm group: connects the group's
ranks (a fresh store namespace, MPI's network path, one MPI communicator per
channel) and makes the :class:`ProcessGroupRingcomm` over them."""
from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ringcomm.algorithms import expand_choices
from ringcomm.front.contract import options_from_torch
from ringcomm.front.process_group import ProcessGroupRingcomm
from ringcomm.launch import bootstrap
from ringcomm.settings import Options

__all__ = ["create_group", "register", "GROUPS"]

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
    options = (options_from_torch(pg_options) or Options()).resolve()
    # names checked before any connection is made
    options.algorithms = expand_choices(options.algorithms)
    transports, cpu_error, hosts = None, None, ()
    store = bootstrap.fresh_store(dist_opts.store, dist_opts.group_rank, dist_opts.group_size,
                                  dist_opts.timeout)
    # before MPI starts (importing the MPI transport starts it): its network path
    bootstrap.prepare_network(store, dist_opts.group_rank, dist_opts.group_size,
                              dist_opts.timeout)
    members = list(dist_opts.global_ranks_in_group)
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
        comm = bootstrap.group_comm(store, dist_opts.group_rank, dist_opts.group_size,
                                    members, dist_opts.timeout)
        world_rank = members[dist_opts.group_rank] if members else dist_opts.group_rank
        hosts = bootstrap.host_layout(comm, world_rank, options.local_size)
        # one communicator per channel: messages of different channels never match
        comms = [comm, *(comm.Dup() for _ in range(options.num_channels - 1))]
        # ranks sharing a host exchange a schedule's messages through shared memory
        from ringcomm.transport import shm
        transports = [shm.connect(MPITransport(c), c, hosts, k, options.shared_memory)
                      for k, c in enumerate(comms)]
    pg = ProcessGroupRingcomm(dist_opts.group_rank, dist_opts.group_size, transports,
                              dist_opts.timeout, options, str(dist_opts.group_id),
                              store=store, cpu_error=cpu_error, hosts=hosts,
                              torch_store=dist_opts.store, global_ranks=members)
    # torch >= 2.15 binds the device on the group it made before asking for ours
    bound = getattr(getattr(dist_opts, "process_group", None), "bound_device_id", None)
    if bound is not None:
        pg.eager_connect_single_device(bound)
    GROUPS.add(pg)
    return pg


def register() -> None:
    """Register the ``"ringcomm"`` backend with torch (again: nothing happens).

    torch >= 2.15 attaches its flight recorder to a new group unless the group's
    backend records itself; its hooks fire only for collectives torch dispatches in
    C++, which a Python group's are not, so ringcomm counts as recording itself (its
    own timeline: ``RINGCOMM_TRACE``).
    """
    if "RINGCOMM" not in dist.Backend._plugins:
        dist.Backend.register_backend("ringcomm", create_group, extended_api=True,
                                      devices=["cpu", "cuda"])
    self_recording = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if self_recording is not None:
        self_recording.add("ringcomm")
