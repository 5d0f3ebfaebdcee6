"""ringcomm: a torch.distributed backend whose collectives are written in Python.

``import ringcomm`` registers the ``"ringcomm"`` backend; under ``mpiexec`` it
also fills in the rendezvous variables, so ``dist.init_process_group("ringcomm")``
works unchanged under ``mpiexec`` and ``torchrun``. It also registers the
algorithms of :mod:`ringcomm.library` (written, like a user's, with the public API).
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import weakref
from typing import Iterator

import torch
import torch.distributed as dist

from ringcomm import schedule, settings, trace
from ringcomm.algorithms import REGISTRY, expand_choices, register_algorithm, unregister_algorithm
from ringcomm.front.process_group import ProcessGroupRingcomm
from ringcomm.launch import bootstrap, slurm
from ringcomm.schedules import checker
from ringcomm.settings import Options

__version__ = "0.1.0"
__all__ = ["Options", "ProcessGroupRingcomm", "register_algorithm", "unregister_algorithm",
           "register_msccl", "set_algorithm", "algorithm", "get_group", "REGISTRY", "checker", "schedule",
           "__version__"]

log = logging.getLogger("ringcomm")
_level = settings.get("RINGCOMM_DEBUG")
if _level in ("INFO", "DETAIL"):
    log.setLevel(logging.DEBUG if _level == "DETAIL" else logging.INFO)
    if not log.handlers:
        _h = logging.StreamHandler()
        _h.setFormatter(logging.Formatter("[%(name)s %(levelname)s] %(message)s"))
        log.addHandler(_h)

_groups: "weakref.WeakSet[ProcessGroupRingcomm]" = weakref.WeakSet()


def _create(dist_opts, pg_options) -> ProcessGroupRingcomm:
    """Backend creator torch calls (extended API) for each ringcomm group."""
    if pg_options is not None and not isinstance(pg_options, Options):
        raise TypeError(f"ringcomm: pg_options must be ringcomm.Options, got "
                        f"{type(pg_options).__name__}")
    options = (pg_options or Options()).resolve()
    # names checked before any connection is made
    options.algorithms = expand_choices(options.algorithms)
    transports, cpu_error, hosts = None, None, ()
    store = bootstrap.fresh_store(dist_opts.store, dist_opts.group_rank, dist_opts.group_size,
                                  dist_opts.timeout)
    # before MPI starts (importing the MPI transport starts it): its network path
    bootstrap.prepare_network(store, dist_opts.group_rank, dist_opts.group_size,
                              dist_opts.timeout)
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
        members = list(dist_opts.global_ranks_in_group)
        comm = bootstrap.group_comm(store, dist_opts.group_rank, dist_opts.group_size,
                                    members, dist_opts.timeout)
        world_rank = members[dist_opts.group_rank] if members else dist_opts.group_rank
        hosts = bootstrap.host_layout(comm, world_rank, options.local_size)
        # one communicator per channel: messages of different channels never match
        comms = [comm, *(comm.Dup() for _ in range(options.num_channels - 1))]
        transports = [MPITransport(c) for c in comms]
    pg = ProcessGroupRingcomm(dist_opts.group_rank, dist_opts.group_size, transports,
                              dist_opts.timeout, options, str(dist_opts.group_id),
                              store=store, cpu_error=cpu_error, hosts=hosts)
    _groups.add(pg)
    return pg


def _shutdown_all() -> None:
    # Before mpi4py finalizes MPI: no progress thread may be inside MPI then.
    for pg in list(_groups):
        pg._stop_threads(wait_s=1.0)


def get_group(group=None) -> ProcessGroupRingcomm:
    """The ringcomm ProcessGroup behind ``group`` (default: the world group).

    Raises:
        ValueError: the group is not a ringcomm group.
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupRingcomm):
        raise ValueError(f"ringcomm: {pg!r} is not a ringcomm process group")
    return pg


def set_algorithm(collective: str, name: str, group=None) -> None:
    """Run ``collective`` with algorithm ``name`` (``"auto"`` restores the automatic choice).

    Every rank of the group must make the same call before its next collective.

    Raises:
        ValueError: unknown collective or algorithm, or not a ringcomm group.
    """
    get_group(group).set_algorithm(collective, name)


@contextlib.contextmanager
def algorithm(name: str, collective: str = "allreduce", group=None) -> Iterator[None]:
    """Context manager: ``with ringcomm.algorithm("ring"): dist.all_reduce(t)``."""
    pg = get_group(group)
    old = pg.get_algorithm(collective)
    pg.set_algorithm(collective, name)
    try:
        yield
    finally:
        pg.set_algorithm(collective, old)


if slurm.leave_pmix_if_unusable():  # srun --mpi=pmix, an MPI library without PMIx
    slurm.setup_env()
elif bootstrap.launched_by_mpi():
    bootstrap.setup_env_from_mpi()
elif slurm.launched_by_slurm():  # srun without an MPI plugin: read as torchrun's
    slurm.setup_env()

dist.Backend.register_backend("ringcomm", _create, extended_api=True, devices=["cpu", "cuda"])
trace.start_from_environment()
atexit.register(_shutdown_all)

# The algorithm library registers itself through the public register_algorithm
# (defined above), as a user's code would; last, so it sees a complete package.
from ringcomm import library  # noqa: E402,F401
from ringcomm import msccl  # noqa: E402

register_msccl = msccl.register
