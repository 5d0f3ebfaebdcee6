"""The ringcomm backend under real launchers: every algorithm x op x dtype against an
independent computation and gloo, on 1, 2, 3 and 5 ranks (mpiexec) and 2 ranks
(torchrun; 3 hosts under torchrun in tests/test_multinode.py)."""
from __future__ import annotations

import time

import pytest

from conftest import assert_checks, covered_pairs, mpirun, torchrun


def _every_pair() -> set[str]:
    """What collectives_check must have run, from the registry of this process (not
    from the program's own loops): every built-in allreduce (the library's have
    library_check.py) and every broadcast algorithm, auto included."""
    from ringcomm.algorithms import BUILTIN, REGISTRY

    return ({f"allreduce[{a}]" for a in REGISTRY["allreduce"] if ("allreduce", a) in BUILTIN}
            | {f"broadcast[{a}]" for a in ("auto", *REGISTRY["broadcast"])})


def _collectives(launch, n: int, key: str, where) -> None:
    """collectives_check on ``n`` ranks: the recorded count of checks, and every
    algorithm _every_pair names covered on every rank."""
    out = launch(n, "collectives_check.py", timeout=240,
                 env={"CHECKS_COVERED_DIR": str(where)}).stdout
    assert_checks(out, key, n)
    want = _every_pair()
    for rank, pairs in enumerate(covered_pairs(where, n)):
        assert pairs == want, (rank, sorted(want - pairs), sorted(pairs - want))


# 4: test_properties; 1 (one rank), 3 (15 s; 3 ranks: test_contract, test_library_launch,
# test_ddp) and 5 (oversubscribed, 25 s here): make test-wide
@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.wide), 2,
                               pytest.param(3, marks=[pytest.mark.compat, pytest.mark.wide]),
                               pytest.param(5, marks=pytest.mark.wide)])
def test_collectives_mpiexec(n, tmp_path):
    _collectives(mpirun, n, f"collectives_check mpiexec n={n}", tmp_path)


@pytest.mark.compat
@pytest.mark.wide  # torchrun's launch: test_contract, test_library_launch, test_ddp, ...
@pytest.mark.parametrize("n", [2])  # 3 ranks: mpiexec above; torchrun on 3 hosts: test_multinode
def test_collectives_torchrun(n, tmp_path):
    _collectives(torchrun, n, f"collectives_check torchrun n={n}", tmp_path)


# 4: test_properties; 5: collectives_check; 1 (one rank: collectives_check's): test-wide
@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.wide),
                               pytest.param(2, marks=pytest.mark.compat),
                               pytest.param(3, marks=pytest.mark.wide)])
def test_more_collectives_mpiexec(n):
    extra = ["--compile"] if n == 2 else []  # torch.compile costs ~10 s a launch: once
    out = mpirun(n, "more_collectives_check.py", *extra, timeout=240).stdout
    assert_checks(out, f"more_collectives_check mpiexec n={n}", n)


@pytest.mark.wide  # torchrun's launch: test_collectives_torchrun; the program: mpiexec above
@pytest.mark.parametrize("n", [2])
def test_more_collectives_torchrun(n):
    out = torchrun(n, "more_collectives_check.py", timeout=240).stdout
    assert_checks(out, f"more_collectives_check torchrun n={n}", n)


@pytest.mark.compat
@pytest.mark.parametrize("launch", [mpirun, pytest.param(torchrun, marks=pytest.mark.wide)],
                         ids=["mpiexec", "torchrun"])
def test_torch_ddp_matches_gloo(launch):
    out = launch(2, "torch_ddp_check.py", timeout=180).stdout
    assert_checks(out, f"torch_ddp_check {launch.__name__} n=2", 2)


# mpiexec on 3 ranks in make test; the other three in make test-wide
@pytest.mark.parametrize("launch,n", [
    (mpirun, 3), pytest.param(torchrun, 2, marks=pytest.mark.wide),
    pytest.param(mpirun, 2, marks=pytest.mark.wide),
    pytest.param(torchrun, 3, marks=pytest.mark.wide)],
    ids=["mpiexec-3", "torchrun-2", "mpiexec-2", "torchrun-3"])
def test_comm_hooks_that_wait_in_callbacks_match_gloo(launch, n):
    """torch's PowerSGD hooks, and a hook whose callback issues an allreduce and waits
    for it: the callbacks' collectives run, DDP trains as on gloo, nothing hangs."""
    out = launch(n, "comm_hooks_check.py", timeout=180).stdout
    assert_checks(out, f"comm_hooks_check {launch.__name__} n={n}", n)


#: failures and lifecycle, under mpiexec: the case -> (program and arguments, ranks,
#: extra environment). Each rank must report exactly its recorded number of checks.
FAILURE_CASES = {
    "a timeout raises instead of hanging": ("failure_check.py timeout", 3, None),
    "a late rank's call fails as the others' timed out": ("failure_check.py late", 3, None),
    "abort and shutdown end a running collective at once": ("failure_check.py abort", 3, None),
    "a short message is an error, not stale data": ("failure_check.py short", 3, None),
    "input refused on one rank ends in errors everywhere": ("failure_check.py refused", 3, None),
    "a size mismatch is named in debug mode": ("failure_check.py mismatch", 3,
                                               {"RINGCOMM_DEBUG": "DETAIL"}),
    "an op mismatch is named in debug mode": ("failure_check.py mismatch_op", 3,
                                              {"RINGCOMM_DEBUG": "DETAIL"}),
    "torch's DETAIL turns on the cross-rank checks": ("failure_check.py mismatch", 3,
                                                     {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
    "mismatches are named from the message tags without debug mode": (
        "failure_check.py tags", 3, None),
    # 40 groups after the warm-up (scripts/reliability_report.py runs 100)
    "groups created, broken and destroyed leak nothing": ("lifecycle_check.py 50", 3, None),
    "a soak of mixed async collectives on two groups": ("soak_check.py 3000", 2, None),
    "standalone groups (connect_group) beside the world group, released": (
        "standalone_check.py", 3, None),
    "WORLD_SIZE disagreeing with mpiexec is replaced, with a warning": (
        "world_check.py env", 2, {"WORLD_SIZE": "3"}),
    "init_process_group(world_size=3) on two processes is an error, not a hang": (
        "world_check.py explicit", 2, None),
}


#: cases make test leaves to test-wide: the same program under torch's variable, a
#: refusal at set-up, a timeout on the progress thread, and a late rank (its timeout
#: path is the timeout case's)
WIDE_FAILURE_CASES = {"torch's DETAIL turns on the cross-rank checks",
                      "a late rank's call fails as the others' timed out",
                      "init_process_group(world_size=3) on two processes is an error, not a hang",
                      # the late rank's case times out in a collective too
                      "a timeout raises instead of hanging",
                      # the size mismatch's case runs the same comparison
                      "an op mismatch is named in debug mode",
                      # soaks (9 and 5 s): make test's time; the others break groups too
                      "groups created, broken and destroyed leak nothing",
                      "a soak of mixed async collectives on two groups"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.wide)
                                  if c in WIDE_FAILURE_CASES else c for c in FAILURE_CASES])
def test_failures_and_lifecycle(case):
    command, n, env = FAILURE_CASES[case]
    program, *args = command.split()
    proc = mpirun(n, program, *args, timeout=240, env=env)
    assert_checks(proc.stdout, f"{program.removesuffix('.py')} {' '.join(args)} n={n}", n)
    if env and "WORLD_SIZE" in env:
        assert "replacing WORLD_SIZE=3 with the MPI value 2" in proc.stderr


@pytest.mark.wide  # standalone_check's stopping member covers a one-round tree
@pytest.mark.parametrize("missing", [3, 0, 4])
def test_a_member_missing_from_the_tree_of_merges_is_named_whatever_the_round(missing):
    """5 ranks form a standalone group without rank ``missing`` (found in the first
    round, missed by every round, found in the last): every other rank names it within
    a few connect limits. A rank left in an MPI accept that cannot be cancelled ends
    without MPI_Finalize, so mpiexec ends the job with a signal's code once every rank
    has printed its checks; the test asserts that, not a hang."""
    proc = mpirun(5, "merge_fault_check.py", str(missing), timeout=120, check=False)
    assert_checks(proc.stdout, f"merge_fault_check {missing} n=5", 5)


@pytest.mark.wide
def test_two_jobs_forming_worlds_on_one_host_at_once_do_not_join():
    """Two torchrun jobs of 3 ranks started together on one host, one whose MPI starts
    with the world whole (launch/pmi.py), one joined from singletons in two rounds of
    merges (``RINGCOMM_PMI=0``): each world holds its own job's ranks only."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(torchrun, 3, "world_check.py", "twin", str(tag), timeout=180,
                            env={"RINGCOMM_PMI": pmi})
                for tag, pmi in ((1, "1"), (2, "0"))]
        outs = [j.result().stdout for j in jobs]
    for out in outs:
        assert_checks(out, "world_check twin torchrun n=3", 3)


def test_torchrun_starts_mpi_with_the_world_whole():
    """Under torchrun ringcomm answers MPI's process-manager requests from the store:
    COMM_WORLD is torch's world, MPI knows which ranks share a host, a standalone
    group forms inside it, and the script's MPI.Finalize() ends it."""
    out = torchrun(3, "pmi_check.py", "world", timeout=120).stdout
    assert_checks(out, "pmi_check world torchrun n=3", 3)


@pytest.mark.wide
def test_a_rank_stalled_before_mpi_starts_is_named_by_every_other_rank():
    """Rank 1 of 3 meets the others at the store, then never starts MPI: ranks 0 and 2
    name it once MPI_Init's first barrier has waited RINGCOMM_CONNECT_TIMEOUT, and MPI
    ends them (a start-up failure is fatal to MPI); the job ends, it does not hang."""
    began = time.monotonic()
    proc = torchrun(3, "pmi_check.py", "lost", timeout=120, check=False,
                    env={"RINGCOMM_CONNECT_TIMEOUT": "3"})
    assert proc.returncode != 0
    for rank in (0, 2):
        assert (f"rank {rank}: ringcomm bootstrap: the world of 3 ranks: rank 1 did not "
                "reach MPI_Init's barrier 1 within 3 s") in proc.stderr, proc.stderr[-4000:]
    assert "a world formed without rank 1" not in proc.stdout
    assert time.monotonic() - began < 60


@pytest.mark.wide  # make test runs them under mpiexec
def test_standalone_groups_under_torchrun():
    """The standalone-group checks where MPICH lost messages to concurrent threads
    (singletons joined through ports, UCX): groups set up on a second thread while the
    world group's collectives run, and a set-up with a member missing bounded."""
    out = torchrun(2, "standalone_check.py", timeout=180).stdout
    assert_checks(out, "standalone_check torchrun n=2", 2)


def test_the_demo_checks_its_results():
    # the README's demo, as `make demo` runs it (mpiexec); the same scripts under
    # torchrun are the collectives checks above
    out = mpirun(2, "examples/allreduce_demo.py", "--quick", timeout=120).stdout
    assert "all results correct" in out, out


@pytest.mark.parametrize("launch,n", [(mpirun, 3), pytest.param(torchrun, 2, marks=pytest.mark.wide)],
                         ids=["mpiexec3", "torchrun2"])
def test_user_registered_schedule_under_torch_and_ddp(launch, n):
    out = launch(n, "user_algorithm_check.py", timeout=180).stdout
    assert_checks(out, f"user_algorithm_check {launch.__name__} n={n}", n)
