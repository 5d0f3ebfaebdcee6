"""Jobs that plain ``srun`` starts (no MPI plugin): Slurm's variables read as
torchrun's. Parsing against Slurm's documented forms, the precedence of the
launchers, and real multi-process jobs described by SLURM_* variables only."""
from __future__ import annotations

import random
import re
import subprocess
import sys

import pytest

from conftest import RANKS, ROOT, _env, assert_checks
from ringcomm.launch import slurm


@pytest.mark.parametrize("text, hosts", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("a[1-2]-b[08-09]", ["a1-b08", "a1-b09", "a2-b08", "a2-b09"]),
    ("c[9-11]x", ["c9x", "c10x", "c11x"]),
    ("h[1],h[3]", ["h1", "h3"]),
])
def test_host_lists_expand_as_slurm_writes_them(text, hosts):
    assert slurm.expand_nodelist(text) == hosts


@pytest.mark.parametrize("text, needle", [
    ("node[1-3", "unbalanced '['"), ("node1-3]", "unbalanced ']'"),
    ("node[a-b]", "expected a number or a-b"),
])
def test_bad_host_lists_are_named(text, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        slurm.expand_nodelist(text)


def test_tasks_per_node():
    assert slurm.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="bad entry"):
        slurm.tasks_per_node("2(3)")


TASK = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "42",
        "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NODELIST": "n[07-08]"}


def test_a_task_reads_as_torchrun_would():
    env = slurm.torch_env(TASK)
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "1"
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "n07"
    assert env["MASTER_PORT"] == slurm.torch_env({**TASK, "SLURM_PROCID": "0"})["MASTER_PORT"]
    assert env["MASTER_PORT"] != slurm.torch_env({**TASK, "SLURM_JOB_ID": "43"})["MASTER_PORT"]
    kept = slurm.torch_env({**TASK, "MASTER_ADDR": "head", "MASTER_PORT": "29400"})
    assert (kept["MASTER_ADDR"], kept["MASTER_PORT"]) == ("head", "29400")
    # the step's own task count wins over the job's
    assert slurm.torch_env({**TASK, "SLURM_STEP_NUM_TASKS": "2"})["WORLD_SIZE"] == "2"
    with pytest.raises(ValueError, match="SLURM_PROCID='x' is not a number"):
        slurm.torch_env({**TASK, "SLURM_PROCID": "x"})


def test_which_launcher_wins():
    assert slurm.launched_by_slurm(TASK)
    # the batch script itself has no step: not a launch (it would wait for absent ranks)
    assert not slurm.launched_by_slurm({k: v for k, v in TASK.items() if k != "SLURM_STEP_ID"})
    # srun --mpi=pmi2: MPI's world; srun torchrun: torchrun's variables
    assert not slurm.launched_by_slurm({**TASK, "PMI_RANK": "3"})
    assert not slurm.launched_by_slurm({**TASK, "TORCHELASTIC_RUN_ID": "x"})
    assert slurm.node_id(TASK) == "1" and slurm.node_id({}) is None


MPICH_WHEEL = """MPICH Version:      4.3.2
MPICH Device:       ch4:ucx ofi
MPICH configure:    --with-device=ch4:ucx,ofi --with-pm=hydra:gforker
"""


def test_pmix_is_used_only_by_an_mpi_library_that_speaks_it():
    pmix = {**TASK, "PMIX_RANK": "0", "PMIX_NAMESPACE": "slurm.pmix.1.0"}
    assert slurm.pmix_only(pmix)
    # other launchers' variables (pmi2, mpiexec inside a step, torchrun) win
    for extra in ({"PMI_FD": "11"}, {"OMPI_COMM_WORLD_SIZE": "2"}, {"TORCHELASTIC_RUN_ID": "x"}):
        assert not slurm.pmix_only({**pmix, **extra}), extra
    assert not slurm.pmix_only({k: v for k, v in pmix.items() if k != "SLURM_STEP_ID"})
    assert not slurm.speaks_pmix(MPICH_WHEEL)
    assert slurm.speaks_pmix(MPICH_WHEEL.replace("gforker", "gforker --with-pmix=/usr"))
    assert slurm.speaks_pmix("Open MPI v5.0.3, package: Open MPI ...")


def _srun_like(nodes: list[int], timeout: float = 120) -> str:
    """Start one process per task with only SLURM_* variables describing the job."""
    n, job = len(nodes), str(random.randrange(1 << 20))
    per_node = [nodes.count(x) for x in dict.fromkeys(nodes)]
    procs = []
    for rank, node in enumerate(nodes):
        env = _env({"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(n), "SLURM_STEP_ID": "0",
                    "SLURM_JOB_ID": job, "SLURM_LOCALID": str(nodes[:rank].count(node)),
                    "SLURM_NODEID": str(node),
                    "SLURM_STEP_TASKS_PER_NODE": ",".join(map(str, per_node)),
                    "SLURM_STEP_NODELIST": "localhost",
                    "TEST_SLURM_NODES": ",".join(map(str, nodes))})
        for k in list(env):
            if k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA")):
                env.pop(k)
        procs.append(subprocess.Popen([sys.executable, str(RANKS / "slurm_check.py")],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    outs, failed = [], []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"task {rank} did not finish in {timeout}s")
        outs.append(out)
        if proc.returncode:
            failed.append(f"task {rank} exit {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}")
    assert not failed, "\n".join(failed)
    return "".join(outs)


def test_a_job_described_by_slurm_alone_runs():
    """Without a Slurm here too (tests/test_slurm_cluster.py runs real jobs)."""
    nodes = [0, 0, 1]
    out = _srun_like(nodes)
    assert_checks(out, f"slurm_check n={len(nodes)} nodes={len(set(nodes))}", len(nodes))
