"""Jobs started by Slurm's ``srun`` without an MPI plugin: every process is an
MPI singleton and only ``SLURM_*`` variables describe the job. Read them as
torchrun's are read, so ``init_process_group("ringcomm")`` needs no arguments:

* RANK = ``SLURM_PROCID``, WORLD_SIZE = the step's tasks (``SLURM_STEP_NUM_TASKS``,
  else ``SLURM_NTASKS``), LOCAL_RANK = ``SLURM_LOCALID``, LOCAL_WORLD_SIZE = the
  tasks on this node (``SLURM_STEP_TASKS_PER_NODE`` at ``SLURM_NODEID``);
* MASTER_ADDR = the step's first host (``SLURM_STEP_NODELIST``, else
  ``SLURM_JOB_NODELIST``), MASTER_PORT = a port every rank derives from the job
  and step ids; either is kept if the user set it.

``srun --mpi=pmi2`` gives MPI the whole job: then MPI's world is used
(:func:`ringcomm.launch.launchers.launched_by_mpi`), and under ``srun torchrun``
torchrun's variables are. A batch script itself (no step) is not a launch.

``srun --mpi=pmix`` (many clusters' default) gives MPI the job only if the MPI
library speaks PMIx: Open MPI does, MPICH only when configured with PMIx, and the
``mpich`` wheel is not, so its ``MPI_Init`` fails under PMIx ("launcher not
compatible with PMI1 client"). :func:`leave_pmix_if_unusable` finds that out
before MPI starts; then ringcomm hides the ``PMIX_*`` variables from MPI (each
task becomes a singleton) and reads the job from Slurm's variables, as under
plain ``srun``.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from typing import Mapping

from ringcomm.launch.launchers import launched_by_mpi

log = logging.getLogger("ringcomm")

#: the base of the port derived from the job (MASTER_PORT unset): ports from here up
PORT_BASE = 20000
PORT_SPAN = 20000


def launched_by_slurm(environ: Mapping[str, str] | None = None) -> bool:
    """True in a task of an ``srun`` step (not in the batch script, which has no
    step, and not under torchrun or an MPI plugin, whose variables win)."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env:
        return False
    if launched_by_mpi(env):
        return False
    return "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and (
        "SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env)


#: variables of launchers whose MPI world is the job whatever PMIx says
_NOT_PMIX_ONLY = ("PMI_RANK", "PMI_FD", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                  "MV2_COMM_WORLD_SIZE")
#: the PMIx variables hidden from an MPI library that cannot use them (name -> value)
hidden_pmix: dict[str, str] = {}


def pmix_only(environ: Mapping[str, str] | None = None) -> bool:
    """True in a task of an ``srun --mpi=pmix`` step: PMIx describes the job and no
    other MPI launcher does."""
    env = os.environ if environ is None else environ
    return ("PMIX_RANK" in env and "SLURM_STEP_ID" in env and "TORCHELASTIC_RUN_ID" not in env
            and not any(v in env for v in _NOT_PMIX_ONLY))


def speaks_pmix(library_version: str) -> bool:
    """Whether an MPI library (``MPI.Get_library_version()``'s text) joins a PMIx
    job: MPICH only when configured with PMIx, others (Open MPI) always."""
    if "MPICH" not in library_version:
        return True
    configure = next((line for line in library_version.splitlines()
                      if "configure" in line.lower()), "")
    return "pmix" in configure.lower()


def leave_pmix_if_unusable() -> bool:
    """Under ``srun --mpi=pmix`` with an MPI library that cannot use PMIx: hide the
    ``PMIX_*`` variables (kept in :data:`hidden_pmix`) so that MPI starts as a
    singleton, and return True (the task is then a plain Slurm launch).

    The library is asked before MPI starts: mpi4py is imported without initializing
    MPI (its finalizer stays on), and :func:`ringcomm.launch.bootstrap.mpi` starts it
    when ringcomm first needs it, after choosing the network path.
    """
    if not pmix_only() or "mpi4py.MPI" in sys.modules:
        return False
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = True
    from mpi4py import MPI

    version = MPI.Get_library_version()
    if speaks_pmix(version):
        MPI.Init_thread(MPI.THREAD_MULTIPLE)  # as mpi4py would have, at import
        return False
    for key in [k for k in os.environ if k.startswith("PMIX_")]:
        hidden_pmix[key] = os.environ.pop(key)
    log.info("ringcomm: srun --mpi=pmix, but %s cannot use PMIx: reading the job from "
             "Slurm's variables", version.splitlines()[0].strip())
    return True


def expand_nodelist(text: str) -> list[str]:
    """Slurm's host list syntax, expanded: ``node[01-03,07],gpu5`` -> ``node01 node02
    node03 node07 gpu5`` (zero padding kept; several bracket groups in one name
    give every combination, in order).

    Raises:
        ValueError: unbalanced brackets or a range that is not ``a`` or ``a-b``.
    """
    out: list[str] = []
    for item in _split_top(text.strip()):
        out.extend(_expand_one(item))
    return out


def _split_top(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"ringcomm: Slurm host list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"ringcomm: Slurm host list {text!r}: unbalanced '['")
    items.append(text[start:])
    return [x for x in items if x]


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        return [item]
    head, tail = item[:m.start()], item[m.end():]
    names = []
    for part in m.group(1).split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"ringcomm: Slurm host list range {part!r} in {item!r}: "
                             "expected a number or a-b")
        width = len(lo)
        for n in range(int(lo), int(hi if dash else lo) + 1):
            names.append(f"{head}{n:0{width}d}")
    return [name + rest for name in names for rest in _expand_one(tail)]


def tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE``'s form expanded: ``2(x3),1`` -> ``[2, 2, 2, 1]``.

    Raises:
        ValueError: an entry that is not ``n`` or ``n(xk)``.
    """
    out: list[int] = []
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"ringcomm: Slurm tasks per node {text!r}: bad entry {part!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def torch_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables torch's env:// rendezvous reads, from a Slurm task's.

    Raises:
        ValueError: a Slurm variable does not parse, naming it.
    """
    env = environ

    def number(name: str) -> int:
        try:
            return int(env[name])
        except (KeyError, ValueError):
            raise ValueError(f"ringcomm: under srun, {name}={env.get(name)!r} is not a "
                             "number") from None

    rank = number("SLURM_PROCID")
    size = number("SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS")
    out = {"RANK": str(rank), "WORLD_SIZE": str(size),
           "LOCAL_RANK": str(number("SLURM_LOCALID")) if "SLURM_LOCALID" in env else "0"}
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node and "SLURM_NODEID" in env:
        counts, node = tasks_per_node(per_node), number("SLURM_NODEID")
        if node < len(counts):
            out["LOCAL_WORLD_SIZE"] = str(counts[node])
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    hosts = expand_nodelist(nodes) if nodes else []
    out["MASTER_ADDR"] = env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1")
    if env.get("MASTER_PORT"):
        out["MASTER_PORT"] = env["MASTER_PORT"]
    else:
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
        step = int(env.get("SLURM_STEP_ID", "0") or 0)
        out["MASTER_PORT"] = str(PORT_BASE + (job * 7 + step) % PORT_SPAN)
    return out


def setup_env() -> None:
    """In an ``srun`` task: export :func:`torch_env`'s variables (RANK and WORLD_SIZE
    replace any set by hand, with a warning, as under mpiexec; MASTER_ADDR and
    MASTER_PORT set by hand are kept)."""
    for key, value in torch_env(os.environ).items():
        old = os.environ.get(key)
        if key in ("RANK", "WORLD_SIZE") and old is not None and old != value:
            log.warning("ringcomm: replacing %s=%s with the Slurm value %s", key, old, value)
        os.environ[key] = value


def node_id(environ: Mapping[str, str] | None = None) -> str | None:
    """This task's node number in the step (``SLURM_NODEID``), if Slurm launched it."""
    env = os.environ if environ is None else environ
    return env.get("SLURM_NODEID") if launched_by_slurm(env) else None
