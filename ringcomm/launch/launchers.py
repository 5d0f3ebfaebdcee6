"""Which launcher started this process, from what each leaves in the environment:
MPI's launchers (:data:`MPI_LAUNCHER_VARS`) and torchrun (``TORCHELASTIC_RUN_ID``,
which wins: torchrun run inside an MPI job starts its own workers). Slurm's
variables are :mod:`ringcomm.launch.slurm`'s; both it and
:mod:`ringcomm.launch.bootstrap` ask here."""
from __future__ import annotations

import os
from typing import Mapping

#: variables set by MPI launchers (MPICH/Hydra, Open MPI, PMIx, MVAPICH); public so
#: that other code (the benchmark) asks the same question with the same list
MPI_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK",
                     "MV2_COMM_WORLD_SIZE")


def launched_by_mpi(environ: Mapping[str, str] | None = None) -> bool:
    """True under mpiexec/mpirun (and not under torchrun run inside one)."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env:
        return False
    return any(v in env for v in MPI_LAUNCHER_VARS)
