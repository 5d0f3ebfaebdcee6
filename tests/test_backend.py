"""The ringcomm backend under real launchers: every algorithm x op x dtype against an
independent computation and gloo, on 1-5 ranks (mpiexec) and 2-3 ranks (torchrun)."""
from __future__ import annotations

import pytest

from conftest import assert_checks, mpirun, torchrun


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_collectives_mpiexec(n):
    out = mpirun(n, "collectives_check.py", timeout=240).stdout
    assert_checks(out, f"collectives_check mpiexec n={n}", n)


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_torchrun(n):
    out = torchrun(n, "collectives_check.py", timeout=240).stdout
    assert_checks(out, f"collectives_check torchrun n={n}", n)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_more_collectives_mpiexec(n):
    extra = ["--compile"] if n == 2 else []  # torch.compile costs ~10 s a launch: once
    out = mpirun(n, "more_collectives_check.py", *extra, timeout=240).stdout
    assert_checks(out, f"more_collectives_check mpiexec n={n}", n)


@pytest.mark.parametrize("n", [2, 3])
def test_more_collectives_torchrun(n):
    out = torchrun(n, "more_collectives_check.py", timeout=240).stdout
    assert_checks(out, f"more_collectives_check torchrun n={n}", n)


@pytest.mark.parametrize("launch", [mpirun, torchrun], ids=["mpiexec", "torchrun"])
def test_torch_ddp_matches_gloo(launch):
    out = launch(2, "torch_ddp_check.py", timeout=180).stdout
    assert_checks(out, f"torch_ddp_check {launch.__name__} n=2", 2)


def test_timeout_raises_instead_of_hanging():
    out = mpirun(3, "failure_check.py", "timeout", timeout=120).stdout
    assert_checks(out, "failure_check timeout n=3", 3)


def test_abort_and_shutdown_end_a_running_collective_at_once():
    out = mpirun(3, "failure_check.py", "abort", timeout=120).stdout
    assert_checks(out, "failure_check abort n=3", 3)


def test_groups_created_broken_and_destroyed_leak_nothing():
    out = mpirun(3, "lifecycle_check.py", "100", timeout=180).stdout
    assert_checks(out, "lifecycle_check 100 n=3", 3)


def test_soak_of_mixed_async_collectives_on_two_groups():
    out = mpirun(2, "soak_check.py", "3000", timeout=240).stdout
    assert_checks(out, "soak_check 3000 n=2", 2)


@pytest.mark.parametrize("mode", ["env", "explicit"])
def test_a_world_that_disagrees_with_the_launcher_is_an_error_not_a_hang(mode):
    env = {"WORLD_SIZE": "3"} if mode == "env" else None
    proc = mpirun(2, "world_check.py", mode, timeout=120, env=env)
    assert_checks(proc.stdout, f"world_check {mode} n=2", 2)
    if mode == "env":
        assert "replacing WORLD_SIZE=3 with the MPI value 2" in proc.stderr


def test_short_message_is_an_error_not_stale_data():
    out = mpirun(3, "failure_check.py", "short", timeout=120).stdout
    assert_checks(out, "failure_check short n=3", 3)


def test_input_refused_on_one_rank_ends_in_errors_everywhere():
    out = mpirun(3, "failure_check.py", "refused", timeout=120).stdout
    assert_checks(out, "failure_check refused n=3", 3)


@pytest.mark.parametrize("mode", ["mismatch", "mismatch_op"])
def test_mismatch_detected_in_debug_mode(mode):
    out = mpirun(3, "failure_check.py", mode, timeout=120,
                 env={"RINGCOMM_DEBUG": "DETAIL"}).stdout
    assert_checks(out, f"failure_check {mode} n=3", 3)


def test_same_script_runs_under_both_launchers():
    for launch in (mpirun, torchrun):
        out = launch(2, "examples/allreduce_demo.py", "--quick", timeout=120).stdout
        assert "all results correct" in out, out


@pytest.mark.parametrize("launch,n", [(mpirun, 3), (torchrun, 2)], ids=["mpiexec3", "torchrun2"])
def test_user_registered_schedule_under_torch_and_ddp(launch, n):
    out = launch(n, "user_algorithm_check.py", timeout=180).stdout
    assert_checks(out, f"user_algorithm_check {launch.__name__} n={n}", n)
