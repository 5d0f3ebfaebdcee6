"""ringcomm on a running Slurm cluster: Debian's slurm-wlm started here by
scripts/localslurm.py on two namespace hosts (node0, node1), each with its own
slurmd, jobs submitted from node0.

* plain ``srun`` (no MPI plugin) across both hosts: collectives on the world, on
  subgroups within and across hosts, torch's DDP and ddp/ against gloo, and the
  host layout from Slurm's node ids;
* ``srun --mpi=pmi2``: MPI's world; ``srun --mpi=pmix`` with the mpich wheel,
  which cannot use PMIx: read as plain ``srun``; ``srun torchrun``: torchrun's;
* the sbatch example (examples/slurm.sbatch) trains to identical replicas;
* a network path that cannot work fails within RINGCOMM_CONNECT_TIMEOUT, naming
  the hosts.

Skipped, with the reason, where Slurm is not installed (``apt-get install
slurm-wlm``; CI installs it) or namespace hosts cannot be made (not root).
"""
from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import BIN, RANKS, ROOT, _env, assert_checks, shm_segments

sys.path.insert(0, str(ROOT / "scripts"))
import localslurm  # noqa: E402
import reliability_report  # noqa: E402

_ports = itertools.count(29700)


# make test-cluster runs these (with tests/test_multinode.py's jobs across hosts)
pytestmark = pytest.mark.cluster

@pytest.fixture(scope="module")
def cluster():
    why = localslurm.unavailable(hosts=2)
    if why:
        pytest.skip(f"no Slurm cluster here: {why}")
    with localslurm.LocalSlurm(hosts=2, cpus=4) as c:
        yield c


def submit(cluster, argv: list[str], timeout: float = 120, env: dict | None = None,
           check: bool = True) -> tuple[int, str]:
    """``argv`` (srun or sbatch ...) run on the login node; (exit code, output)."""
    full = _env({**cluster.env, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                 **(env or {})})
    for k in list(full):  # nothing of an enclosing launch leaks into the job
        if k.startswith(("SLURM_JOB", "SLURM_STEP", "SLURM_PROCID", "PMI_", "PMIX_")):
            full.pop(k)
    full.update(cluster.env)
    p = subprocess.Popen(cluster.command(argv), cwd=ROOT, env=full, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(argv)}\n{out[-6000:]}")
    if check and p.returncode:
        pytest.fail(f"exit code {p.returncode}: {' '.join(argv)}\n{out[-8000:]}")
    return p.returncode, out


def rank_program(name: str, *args: str) -> list[str]:
    return [sys.executable, str(RANKS / name), *args]


def test_srun_across_hosts_collectives_ddp_and_subgroups_against_gloo(cluster):
    # 3 tasks on 2 nodes: Slurm's block distribution puts two on node0
    _, out = submit(cluster, ["srun", "-N", "2", "-n", "3", *rank_program(
        "multinode_check.py", "--hosts", "0,0,1", "--netmod", "ofi")], timeout=240)
    assert_checks(out, "multinode_check under srun, 2 hosts n=3", 3)


def test_srun_with_the_pmi2_plugin_uses_mpis_world(cluster):
    _, out = submit(cluster, ["srun", "-N", "2", "--ntasks-per-node", "1", "--mpi=pmi2",
                              *rank_program("slurm_check.py", "--launch", "mpi")],
                    env={"TEST_SLURM_NODES": "0,1"})
    assert_checks(out, "slurm_check srun --mpi=pmi2, 2 hosts", 2)


def test_srun_with_pmix_and_an_mpi_without_it_reads_slurms_variables(cluster):
    # PMIx keeps per-node files in /tmp, which namespace hosts share: one node
    code, out = submit(cluster, ["srun", "-N", "1", "-n", "1", "--mpi=pmix", "true"],
                       check=False)
    if code:
        pytest.skip(f"Slurm's PMIx plugin does not load here (apt-get install "
                    f"libpmix-dev): {out.strip().splitlines()[-1] if out.strip() else code}")
    _, out = submit(cluster, ["srun", "-N", "1", "-n", "3", "--mpi=pmix", *rank_program(
        "slurm_check.py", "--launch", "slurm", "--pmix")], env={"TEST_SLURM_NODES": "0,0,0"})
    assert_checks(out, "slurm_check srun --mpi=pmix, 1 host n=3", 3)


def test_srun_torchrun_uses_torchruns_variables(cluster):
    port = next(_ports)
    _, out = submit(cluster, [
        "srun", "-N", "2", "--ntasks-per-node", "1", str(BIN / "torchrun"), "--nnodes", "2",
        "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"node0:{port}",
        "--rdzv-id", str(port), *rank_program("slurm_check.py", "--launch", "torchrun")[1:]],
        env={"TEST_SLURM_NODES": "0,0,1,1"}, timeout=180)
    assert_checks(out, "slurm_check under srun torchrun, 2 hosts x 2", 4)


def test_the_sbatch_example_trains_to_identical_replicas(cluster, tmp_path):
    log = tmp_path / "train.out"
    submit(cluster, ["sbatch", "--wait", "--nodes", "2", "--ntasks-per-node", "1",
                     "--output", str(log), str(ROOT / "examples" / "slurm.sbatch"),
                     "--epochs", "2", "--steps", "3"], timeout=180)
    out = log.read_text()
    assert "replicas identical" in out, out[-6000:]
    losses = [float(line.split("loss ")[1].split()[0]) for line in out.splitlines()
              if line.startswith("epoch")]
    assert len(losses) == 2 and losses[1] < losses[0], out[-6000:]


def test_a_rank_that_cannot_reach_the_others_fails_in_time_naming_the_hosts(cluster):
    start = time.monotonic()
    code, out = submit(cluster, ["srun", "-N", "2", "-n", "2", *rank_program(
        "multinode_check.py", "--hosts", "0,1", "--netmod", "ofi")], timeout=90,
        env={"FI_TCP_IFACE": "lo", "RINGCOMM_CONNECT_TIMEOUT": "4"}, check=False)
    assert time.monotonic() - start < 60
    assert code != 0
    assert out.count("did not complete within 4 s") == 2, out[-6000:]
    for fact in ("rank 0 on node0, rank 1 on node1", "MASTER_ADDR=node0",
                 "FI_TCP_IFACE=lo", "RINGCOMM_IFACE=<interface>"):
        assert fact in out, f"the error lacks {fact!r}:\n{out[-6000:]}"


@pytest.mark.parametrize("mpi", ["none", "pmi2"])
def test_a_rank_killed_inside_a_shared_memory_allreduce_ends_the_others_wait(cluster, tmp_path,
                                                                             mpi):
    """Three tasks on one node, the last SIGKILLed at an allreduce over shared memory,
    with srun told not to end the step (--no-kill): the survivors find the dead peer
    themselves, each failing with an error naming rank 2 well inside the group's 60 s
    timeout, and no segment is left in /dev/shm."""
    before = shm_segments()
    start = time.monotonic()
    code, out = submit(cluster, ["srun", "-N", "1", "-n", "3", "--no-kill", f"--mpi={mpi}",
                                 *rank_program("shm_check.py", "kill")],
                       timeout=120, env={"SHM_CHECK_OUT": str(tmp_path)}, check=False)
    elapsed = time.monotonic() - start
    found = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert code != 0 and "killing myself" in out, out[-6000:]
    assert sorted(found) == ["rank0", "rank1"], (found, out[-6000:])
    for name, result in found.items():
        assert result.startswith("survived") and "FAIL" not in result, (name, result)
    assert elapsed < 50, f"the survivors took {elapsed:.0f} s (the group's timeout is 60 s)"
    assert shm_segments() <= before


@pytest.mark.parametrize("mpi,launcher", [("none", "srun"), ("pmi2", "srun --mpi=pmi2"),
                                          ("pmix", "srun --mpi=pmix")])
def test_a_rank_leaves_under_srun(cluster, mpi, launcher):
    """Rows of docs/reliability.md's "a rank leaves": two tasks (on two nodes; one for
    PMIx), the last raising, calling sys.exit(3) or ending its script while the first
    waits on it."""
    from test_departure import assert_row

    if mpi == "pmix" and not reliability_report.pmix_loads(cluster):
        pytest.skip("Slurm's PMIx plugin does not load here (apt-get install libpmix-dev)")

    for how in reliability_report.DEPARTURES[launcher]:
        assert_row(reliability_report.departure(launcher, how,
                                                reliability_report.slurm_runner(cluster, mpi)))


def test_one_host_cluster_from_the_command_line(tmp_path):
    """`localslurm.py up` with this machine as the one node: its last line, evaluated,
    points srun at the cluster; a second `up` is refused; `down` removes it all.
    (ringcomm's steps on one node: the --mpi=pmix test above.)"""
    why = localslurm.unavailable()
    if why:
        pytest.skip(f"no Slurm cluster here: {why}")
    script, where = str(ROOT / "scripts" / "localslurm.py"), str(tmp_path / "cluster")
    up = subprocess.run([sys.executable, script, "--dir", where, "up", "--cpus", "4"],
                        capture_output=True, text=True, timeout=60)
    assert up.returncode == 0, up.stderr
    try:
        last = up.stdout.strip().splitlines()[-1]
        assert last == f"export SLURM_CONF={where}/slurm.conf", up.stdout
        again = subprocess.run([sys.executable, script, "--dir", where, "up"],
                               capture_output=True, text=True, timeout=60)
        assert again.returncode == 1 and "already up" in again.stderr
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI"))}
        p = subprocess.run(["srun", "-n", "3", "sh", "-c", 'echo "task $SLURM_PROCID"'],
                           env={**env, "SLURM_CONF": last.split("=", 1)[1]},
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        assert sorted(p.stdout.split("\n")[:-1]) == ["task 0", "task 1", "task 2"], p.stdout
    finally:
        down = subprocess.run([sys.executable, script, "--dir", where, "down"],
                              capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    assert not os.path.exists(where)
