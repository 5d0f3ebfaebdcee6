"""A rank that leaves is known to the ranks waiting on it
(ringcomm.front.departure): an uncaught exception (in the main thread or another),
sys.exit(n), the end of the script, os._exit, SIGTERM or SIGKILL while a peer waits
on it in a collective. Before, under mpiexec, the leaving process sat in
MPI_Finalize and its peers waited out the group timeout (30 minutes by default).
And a job whose ranks all end normally, in any order, still exits 0.
(tests/ranks/leave_check.py; each case is a row of docs/reliability.md's "a rank
leaves", scripts/reliability_report.py; the srun and two-host rows are in
test_slurm_cluster.py and test_multinode.py)"""
from __future__ import annotations

import itertools
import json
import re
import sys
import time

import pytest

from conftest import ROOT, mpirun

sys.path.insert(0, str(ROOT / "scripts"))
import reliability_report  # noqa: E402


def _ended(out: str) -> list[int]:
    """The ranks that said they ended (their lines may merge on the shared stdout)."""
    return sorted(int(r) for r in re.findall(r"ended: (\d+)", out))


def _left(out: str) -> list[dict]:
    return [json.loads(line[len("left: "):]) for line in out.splitlines()
            if line.startswith("left: ")]


# make test runs one of each kind at 2 ranks; test-wide the rest
_WIDE = pytest.mark.wide
#: the job ends this soon after the rank left (the target is 5 s; a loaded 2-core
#: machine gets slack) and the peers' errors come this soon after their call (1 s)
JOB_ENDS_S, PEER_FAILS_S = 8.0, 2.0


def assert_row(row: dict) -> None:
    """A row of docs/reliability.md's "a rank leaves" table (scripts/reliability_report.py):
    the job ends soon with a non-zero code, and the waiting rank's error, where the
    launcher let it print one, names the rank and how it left, within a second."""
    how = row["how"]
    where = f"{row['launcher']}, {how}: {row['tail']}"
    assert row["exit_code"] != 0, where
    assert row["job_ended_after"] is not None and row["job_ended_after"] < JOB_ENDS_S, where
    peers = row["peers"]
    if how not in ("os_exit", "sigterm", "sigkill"):  # there the launcher may end it first
        assert [x["rank"] for x in peers] == [0], where
    for x in peers:
        assert x["error"] is not None and "rank 1" in x["error"], where
        for w in reliability_report.leaving_words(how):
            assert w in x["error"], (w, where)
        assert x["seconds"] < PEER_FAILS_S, where


@pytest.mark.parametrize("launcher,how", [
    pytest.param(launcher, how, marks=() if (launcher, how) in
                 {("mpiexec", "raise"), ("mpiexec", "end")} else _WIDE)
    for launcher in ("mpiexec", "torchrun") for how in reliability_report.DEPARTURES[launcher]])
def test_a_rank_leaves(launcher, how):
    assert_row(reliability_report.departure(launcher, how,
                                            reliability_report.local_runner(launcher)))


@pytest.mark.wide
@pytest.mark.parametrize("how,code", [("raise", 1), ("exit", 3)])
def test_three_ranks_all_learn_how_the_last_left(how, code):
    start = time.monotonic()
    proc = mpirun(3, "leave_check.py", how, timeout=60, check=False)
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    left = _left(proc.stdout)
    assert sorted(x["rank"] for x in left) == [0, 1], proc.stdout[-2000:]
    for x in left:
        assert "rank 2" in x["error"] and x["seconds"] < PEER_FAILS_S, x
        for w in reliability_report.leaving_words(how):
            assert w in x["error"], (w, x)
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("delays", [pytest.param("0,0", marks=_WIDE), "0,1",
                                    pytest.param("1,0", marks=_WIDE)])
def test_ranks_that_all_end_normally_exit_zero_in_any_order(delays):
    proc = mpirun(2, "leave_check.py", "normal", delays, timeout=60)
    assert _ended(proc.stdout) == [0, 1], proc.stdout
    assert "TransportPeer" not in proc.stdout + proc.stderr  # Failed or Lost
    assert "Traceback" not in proc.stderr


@pytest.mark.wide
@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_three_ranks_that_end_normally_exit_zero_in_every_order(order):
    delays = ",".join(str(0.4 * order.index(r)) for r in range(3))
    proc = mpirun(3, "leave_check.py", "normal", delays, timeout=60)
    assert _ended(proc.stdout) == [0, 1, 2] and "Traceback" not in proc.stderr
