"""The ringcomm backend under real launchers: every algorithm x op x dtype against an
independent computation and gloo, on 1-5 ranks (mpiexec) and 2-3 ranks (torchrun)."""
from __future__ import annotations

import re

import pytest

from conftest import mpirun, torchrun


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_collectives_mpiexec(n):
    out = mpirun(n, "collectives_check.py", timeout=240).stdout
    assert out.count("checks passed") == n


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_torchrun(n):
    out = torchrun(n, "collectives_check.py", timeout=240).stdout
    assert out.count("checks passed") == n


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_more_collectives_mpiexec(n):
    extra = ["--compile"] if n == 2 else []  # torch.compile costs ~10 s a launch: once
    out = mpirun(n, "more_collectives_check.py", *extra, timeout=240).stdout
    assert out.count("checks passed") == n


@pytest.mark.parametrize("n", [2, 3])
def test_more_collectives_torchrun(n):
    out = torchrun(n, "more_collectives_check.py", timeout=240).stdout
    assert out.count("checks passed") == n


@pytest.mark.parametrize("launch", [mpirun, torchrun], ids=["mpiexec", "torchrun"])
def test_torch_ddp_matches_gloo(launch):
    out = launch(2, "torch_ddp_check.py", timeout=180).stdout
    assert out.count("checks passed") == 2


def test_timeout_raises_instead_of_hanging():
    out = mpirun(3, "failure_check.py", "timeout", timeout=120).stdout
    assert out.count("checks passed") == 3


def test_short_message_is_an_error_not_stale_data():
    out = mpirun(3, "failure_check.py", "short", timeout=120).stdout
    assert out.count("checks passed") == 3


def test_input_refused_on_one_rank_ends_in_errors_everywhere():
    out = mpirun(3, "failure_check.py", "refused", timeout=120).stdout
    assert out.count("checks passed") == 3


@pytest.mark.parametrize("mode", ["mismatch", "mismatch_op"])
def test_mismatch_detected_in_debug_mode(mode):
    out = mpirun(3, "failure_check.py", mode, timeout=120,
                 env={"RINGCOMM_DEBUG": "DETAIL"}).stdout
    assert out.count("checks passed") == 3


def test_same_script_runs_under_both_launchers():
    for launch in (mpirun, torchrun):
        out = launch(2, "examples/allreduce_demo.py", "--quick", timeout=120).stdout
        assert "all results correct" in out, out


@pytest.mark.parametrize("launch,n", [(mpirun, 3), (torchrun, 2)], ids=["mpiexec3", "torchrun2"])
def test_user_registered_schedule_under_torch_and_ddp(launch, n):
    out = launch(n, "user_algorithm_check.py", timeout=180).stdout
    counts = re.findall(r"rank \d+: (\d+) checks passed", out)
    assert counts == ["21"] * n, out  # 15 allreduces, 2 trainings, 4 more
