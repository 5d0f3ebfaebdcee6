"""ringcomm: a torch.distributed backend whose collectives are written in Python.

``import ringcomm`` registers the ``"ringcomm"`` backend; under ``mpiexec`` it
also fills in the rendezvous variables, so ``dist.init_process_group("ringcomm")``
works unchanged under ``mpiexec`` and ``torchrun``. It also registers the
algorithms of :mod:`ringcomm.library` (written, like a user's, with the public API).
"""
from __future__ import annotations

import atexit
import contextlib
import os
from datetime import timedelta
import logging
from typing import Iterator

import torch

#: the oldest torch ringcomm is tested on (``make test-compat``; docs/integrations.md)
OLDEST_TORCH = "2.7"
if torch.__version__ < OLDEST_TORCH:  # torch.__version__ compares as a version
    raise ImportError(f"ringcomm needs torch >= {OLDEST_TORCH}; this is torch {torch.__version__}")

import torch.distributed as dist  # noqa: E402

from ringcomm import schedule, settings, trace
from ringcomm.algorithms import (REGISTRY, register_algorithm, register_transport_collective,
                                 unregister_algorithm)
from ringcomm.front.create import (GROUPS, GroupSetup, TransportUnavailable, connect_group,
                                   register_transport)
from ringcomm.front.create import register as register_backend
from ringcomm.front import departure
from ringcomm.front.process_group import ProcessGroupRingcomm
from ringcomm.launch import bootstrap, pmi, slurm
from ringcomm.execution import checker
from ringcomm.settings import Options
from ringcomm.trace.flight import dump as dump_flight_recorder

__version__ = "0.1.0"
__all__ = ["Options", "ProcessGroupRingcomm", "register_algorithm", "unregister_algorithm",
           "register_transport", "register_transport_collective", "GroupSetup",
           "TransportUnavailable",
           "register_backend", "register_msccl", "set_algorithm", "algorithm", "set_timeout",
           "get_group", "connect_group", "dump_flight_recorder", "REGISTRY", "checker", "schedule",
           "__version__"]

log = logging.getLogger("ringcomm")


class _RankFilter(logging.Filter):
    """Every line of ringcomm's log says which rank wrote it: the ranks' output is
    interleaved on one terminal (the launcher's RANK, which ringcomm sets under
    mpiexec and srun too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = os.environ.get("RANK")
        if rank is not None and not getattr(record, "ringcomm_rank", None):
            record.ringcomm_rank = rank
            record.msg = f"rank {rank}: {record.msg}"
        return True


log.addFilter(_RankFilter())
_level = settings.get("RINGCOMM_DEBUG")
if _level in ("INFO", "DETAIL"):
    log.setLevel(logging.DEBUG if _level == "DETAIL" else logging.INFO)
    if not log.handlers:
        _h = logging.StreamHandler()
        _h.setFormatter(logging.Formatter("[%(name)s %(levelname)s] %(message)s"))
        log.addHandler(_h)

def _shutdown_all() -> None:
    # Before mpi4py finalizes MPI: no progress thread may be inside MPI then.
    for pg in list(GROUPS):
        pg._stop_threads(wait_s=1.0)
    # a world MPI started whole under torchrun finalizes while Python can still serve
    # its barrier (ringcomm.launch.pmi)
    pmi.finalize()


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


def set_timeout(timeout: timedelta, group=None) -> None:
    """The time limit of every later collective of ``group`` (default: the world),
    on any torch (``dist.set_timeout`` does the same from torch 2.15).

    Raises:
        ValueError: ``timeout`` is not a positive ``timedelta``, or not a ringcomm group.
    """
    get_group(group).set_timeout(timeout)


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

register_backend()
trace.start_from_environment()
atexit.register(_shutdown_all)
# after _shutdown_all, so that it runs first: peers hear how this rank left
departure.install(GROUPS)

# The algorithm library registers itself through the public register_algorithm
# (defined above), as a user's code would; last, so it sees a complete package.
from ringcomm import library  # noqa: E402,F401
from ringcomm import msccl  # noqa: E402

register_msccl = msccl.register
