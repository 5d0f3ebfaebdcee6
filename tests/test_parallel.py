"""Parallel styles beyond data parallel, on ringcomm (``make test-parallel``): DTensor,
tensor and pipeline parallel, 2-D meshes, and training that survives torchrun's
restarts and an elastic rendezvous losing a node (tests/ranks/elastic_check.py).
The recipes are in docs/integrations.md."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from conftest import RANKS, _env, assert_checks, mpirun, torchrun

pytestmark = pytest.mark.parallel

RUN = [sys.executable, "-m", "torch.distributed.run"]
ELASTIC = str(RANKS / "elastic_check.py")


@pytest.mark.parametrize("launch,n", [(mpirun, 4), (torchrun, 3)],
                         ids=["mpiexec-4", "torchrun-3"])
def test_dtensor_redistributions(launch, n):
    """Every redistribution between Shard, Replicate and Partial on a 1-D mesh (uneven
    and empty shards) and, at 4 ranks, a 2x2 mesh; ops that need collectives; against
    gloo meshes and a single-process oracle (tests/ranks/styles_dtensor.py)."""
    out = launch(n, "styles_dtensor.py", timeout=300).stdout
    assert_checks(out, f"styles_dtensor {launch.__name__} n={n}", n)


@pytest.mark.parametrize("launch", [mpirun, torchrun], ids=["mpiexec", "torchrun"])
def test_tensor_parallel_and_fsdp2_tp(launch):
    """Colwise/Rowwise/SequenceParallel and loss parallel on 4 ranks, FSDP2 x TP on a 2x2
    mesh, and torch.compile of a TP block: forward, gradients and three optimizer
    steps against gloo and one process (tests/ranks/styles_tp.py)."""
    out = launch(4, "styles_tp.py", timeout=300).stdout
    assert_checks(out, f"styles_tp {launch.__name__} n=4", 4)


@pytest.mark.parametrize("launch,n", [(mpirun, 2), (mpirun, 3), (torchrun, 2)],
                         ids=["mpiexec-2", "mpiexec-3", "torchrun-2"])
def test_pipeline_schedules(launch, n):
    """torch.distributed.pipelining over a ringcomm group: GPipe, 1F1B (also with static
    shapes), Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble and
    DualPipeV; losses, outputs, gradients and three optimizer steps bit-identical to
    gloo and equal to one process (tests/ranks/styles_pipeline.py)."""
    out = launch(n, "styles_pipeline.py", timeout=300).stdout
    assert_checks(out, f"styles_pipeline {launch.__name__} n={n}", n)


@pytest.mark.parametrize("n", [2, 3])
def test_pipeline_schedules_over_the_nccl_path(n, monkeypatch):
    """The same schedules with the stage-to-stage traffic on the CUDA path: send/recv
    on NCCL communicators (one per direction of each pair of ranks), over the NCCL
    stand-in, whose groups run later on their streams (ringcomm.testing.nccl_world:
    torch's default group per thread). Every step of every schedule is a symmetric
    exchange that a single communicator per pair would hang on. Against one process
    on the whole batch (tests/ranks/styles_pipeline.py's oracle)."""
    import copy

    sys.path.insert(0, str(RANKS))
    import styles_pipeline as sp
    from _common import Checker
    from ringcomm.testing import nccl_world

    # torch's random generator is one per process: the threads' ranks would draw
    # their initial weights from it in turn, and differ from the oracle's
    built = sp.full_model()
    monkeypatch.setattr(sp, "full_model", lambda: copy.deepcopy(built))
    n_mb = max(4, 2 * n)

    def body(rank: int) -> list[str]:
        c = Checker(rank)
        for spec in sp.SPECS:
            ours = c.run(f"{spec[0]} over the NCCL path", sp.run_pipeline, spec, None, n_mb)
            sp.check_results(c, spec, ours, None, n_mb)
        assert c.count > 10 * len(sp.SPECS), c.count
        return c.failures

    failures = nccl_world(n, body, timeout_s=120)
    assert failures == [[]] * n, failures


@pytest.mark.parametrize("launch,n", [(mpirun, 3), (torchrun, 2)],
                         ids=["mpiexec-3", "torchrun-2"])
def test_context_parallel(launch, n):
    """context_parallel over a ringcomm mesh, in the form torch runs on CPU (SDPA on
    the math backend, not ring attention): outputs and q/k/v gradients against gloo
    and one process's SDPA on the whole sequence (tests/ranks/styles_context.py)."""
    out = launch(n, "styles_context.py", timeout=300).stdout
    assert_checks(out, f"styles_context {launch.__name__} n={n}", n)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(agents: list[list[str]], timeout: float, lost: int | None = None) -> list[str]:
    """Start every torchrun agent at once; wait for all (bounded); their outputs.
    Fails when one exits non-zero (agent ``lost`` must die of SIGKILL instead) or
    the time runs out (every agent is killed)."""
    procs = [subprocess.Popen(cmd, env=_env(None), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for cmd in agents]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"timed out after {timeout}s: " + "\n".join(" ".join(a) for a in agents))
    for i, (cmd, p, out) in enumerate(zip(agents, procs, outs)):
        if p.returncode != (-9 if i == lost else 0):
            pytest.fail(f"exit code {p.returncode}: {' '.join(cmd)}\n{out[-6000:]}")
    return outs


def _final(directory) -> list[torch.Tensor]:
    return torch.load(directory / "final.pt")


def test_restart_resumes_from_checkpoint(tmp_path):
    """torchrun --max-restarts 1: rank 1 dies in step 3; the agent starts both ranks
    again, the group forms over the store the dead ranks wrote to, training resumes
    from step 2's DCP checkpoint and ends bit-identical to a run never interrupted."""
    crashed, plain = tmp_path / "crashed", tmp_path / "plain"
    crashed.mkdir(), plain.mkdir()
    standalone = [*RUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1", ELASTIC]
    out, = _launch([[*standalone, str(crashed), "--crash-at", "3", "--expect-restarts", "1",
                     "--expect-resume", "2", "--timeout", "30"]], timeout=180)
    assert "killing myself in step 3" in out, out[-3000:]
    assert_checks(out, "elastic_check restart n=2", 2)
    out, = _launch([[*standalone, str(plain), "--expect-restarts", "0"]], timeout=120)
    assert_checks(out, "elastic_check restart n=2", 2)
    for a, b in zip(_final(crashed), _final(plain)):
        assert torch.equal(a, b), "the resumed run's parameters differ from the plain run's"


def _agents(directory, port: int, crashing: list[str], common: list[str]) -> list[list[str]]:
    """Two torchrun agents (one process each) meeting in a c10d rendezvous that takes
    one or two nodes; the first hosts the rendezvous store."""
    def agent(host: bool, extra: list[str]) -> list[str]:
        return [*RUN, "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic",
                f"--rdzv-conf=is_host={int(host)},last_call_timeout=10",
                "--max-restarts=1", ELASTIC, str(directory), *common, *extra]
    return [agent(True, []), agent(False, crashing)]


def test_elastic_rendezvous_restart(tmp_path):
    """--rdzv-backend c10d --nnodes 1:2: the second node's process dies in step 3; its
    agent restarts it, the first agent restarts its own for the new rendezvous round
    (torchrun counts restarts per agent: 1 and 0), and both resume from step 2."""
    outs = _launch(_agents(tmp_path, _port(), ["--crash-at", "3", "--crash-rank", "-1"],
                           ["--expect-resume", "2", "--expect-world", "2", "--timeout", "30"]),
                   timeout=240)
    out = "\n".join(outs)
    assert "killing myself in step 3" in out, out[-3000:]
    assert_checks(out, "elastic_check rendezvous n=2", 2)


def test_elastic_rendezvous_loses_a_node(tmp_path):
    """--nnodes 1:2: the second node is lost in step 3 (its agent and process killed).
    The survivor's allreduce times out with ringcomm's error, its agent forms a
    one-node group, and training resumes from step 2 at world size 1 to the same
    parameters as one process (the global batch does not depend on the world size)."""
    outs = _launch(_agents(tmp_path, _port(), ["--crash-at", "3", "--crash-rank", "-1",
                                               "--lose-node"],
                           ["--expect-resume", "2", "--expect-world", "1", "--timeout", "10"]),
                   timeout=240, lost=1)
    survivor, lost = outs
    assert "killing my agent and myself in step 3" in lost, lost[-3000:]
    assert "timed out after 10s" in survivor, survivor[-3000:]
    assert "resume from step 2 world 1" in survivor, survivor[-3000:]
    assert_checks(survivor, "elastic_check lose a node n=1", 1)
