"""Which ranks share a host: a name for this process's host (:func:`host_key`, from
the launcher where it says), and every group rank's host number, agreed over MPI
(:func:`host_layout`) or through the group's store (:func:`store_host_layout`)."""
from __future__ import annotations

import json
import os
import socket
from datetime import timedelta

from ringcomm import machine, mpi_serial
from ringcomm.launch import slurm
from ringcomm.launch.group_store import get_all, store_wait, unset

#: under mpiexec: the world rank of the first rank on this host (set when ringcomm
#: reads MPI's layout, ringcomm.launch.bootstrap.setup_env_from_mpi)
mpi_node: int | None = None


def host_key(world_rank: int, local_size: int = 0, standalone: bool = False) -> str:
    """A name of this process's host, the same for every rank on it.

    ``local_size`` > 0 (``RINGCOMM_LOCAL_SIZE``) puts consecutive blocks of that many
    world ranks on one host. Otherwise the launcher says: MPI's shared-memory split
    under mpiexec, the node (agent) rank under torchrun, ``SLURM_NODEID`` under
    srun; else the host name. A standalone group's ranks come from different
    launches, whose launchers each number their own nodes (and ``local_size`` numbers
    a launch's world ranks): its key is the machine's host name and boot id.
    """
    if standalone:
        return f"machine-{machine.identity()}"
    if local_size > 0:
        return f"block-{world_rank // local_size}"
    if mpi_node is not None:
        return f"mpi-node-{mpi_node}"
    if "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("GROUP_RANK"):
        return f"torchrun-node-{os.environ['GROUP_RANK']}"
    node = slurm.node_id()
    if node is not None:
        return f"slurm-node-{node}"
    return f"host-{socket.gethostname()}"


def host_numbers(keys: list[str]) -> tuple[int, ...]:
    """Host numbers (0, 1, ... in order of each host's first rank) of ranks whose hosts
    are named ``keys``; empty when they are all on one host."""
    if len(set(keys)) <= 1:
        return ()
    first: dict[str, int] = {}
    return tuple(first.setdefault(k, len(first)) for k in keys)


def host_layout(comm, world_rank: int, local_size: int = 0, standalone: bool = False,
                limit_s: float | None = None) -> tuple[int, ...]:
    """Every group rank's host number (:func:`host_numbers`), agreed over ``comm``
    within ``limit_s`` (None: ``RINGCOMM_CONNECT_TIMEOUT``)."""
    return host_numbers(mpi_serial.allgather(comm, host_key(world_rank, local_size, standalone),
                                             "the group's host layout",
                                             mpi_serial.limit(limit_s)))


def store_host_layout(store, rank: int, size: int, world_rank: int, local_size: int = 0,
                      standalone: bool = False,
                      timeout: timedelta = timedelta(seconds=60)) -> tuple[int, ...]:
    """Every group rank's host number (:func:`host_numbers`), agreed through ``store``
    (a group's fresh store, :func:`ringcomm.launch.group_store.fresh_store`) for a
    transport without MPI: each rank writes its :func:`host_key`; rank 0 reads them
    all in one request and publishes the list under one key, which every other rank
    reads. So the store answers about 3 requests a rank, where reading every rank's
    key on every rank took ``size`` (a million at 1,024 ranks, all on rank 0's store).

    Raises:
        DistBackendError: ranks missing after ``timeout`` (names them).
    """
    import torch.distributed as dist

    store.set(f"hosts/{rank}", host_key(world_rank, local_size, standalone))
    keys = [f"hosts/{r}" for r in range(size)]
    try:
        if rank == 0:
            store.wait(keys, timeout)
            names = [v.decode() for v in get_all(store, keys)]
            store.set("hosts/all", json.dumps(names))
        else:
            names = json.loads(store_wait(store, "hosts/all", timeout))
    except (RuntimeError, dist.DistStoreError) as e:
        try:
            missing = [int(k.split("/")[1]) for k in unset(store, keys)]
        except (RuntimeError, dist.DistStoreError):  # the store itself is gone
            raise dist.DistBackendError(f"ringcomm: the group's host layout was not agreed "
                                        f"within {timeout.total_seconds():g} s ({e})") from None
        many = len(missing) > 1
        who = (f"rank{'s' if many else ''} {_listed(missing)} of {size} did not record "
               f"{'their hosts' if many else 'its host'}" if missing else
               f"rank 0 of {size} did not publish the hosts it read")
        raise dist.DistBackendError(
            f"ringcomm: {who} within {timeout.total_seconds():g} s ({e})") from None
    return host_numbers(names)


def _listed(ranks: list[int], most: int = 8) -> str:
    """``0, 3, 5`` (and how many more past ``most``)."""
    more = len(ranks) - most
    return ", ".join(map(str, ranks[:most])) + (f" and {more} more" if more > 0 else "")
