"""A rank that leaves, under mpiexec, is known to the ranks waiting on it
(ringcomm.front.departure): an uncaught exception, sys.exit(n) or the end of the
script while a peer waits on it in a collective. Before, the leaving process sat in
MPI_Finalize and its peers waited out the group timeout (30 minutes by default).
And a job whose ranks all end normally, in any order, still exits 0.
(tests/ranks/leave_check.py)"""
from __future__ import annotations

import itertools
import json
import time

import pytest

from conftest import mpirun


def _left(out: str) -> list[dict]:
    return [json.loads(line[len("left: "):]) for line in out.splitlines()
            if line.startswith("left: ")]


# make test runs one of each kind at 2 ranks; test-wide the rest
_WIDE = pytest.mark.wide


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=_WIDE)])
@pytest.mark.parametrize("how,code,words", [
    ("raise", 1, ["raised ValueError: bad batch at leave_check.py:41", "exit code 1"]),
    pytest.param("exit", 3, ["called sys.exit(3)", "exit code 3"], marks=_WIDE),
    ("end", 1, ["ended its script, while rank"]),
])
def test_peers_learn_how_a_rank_left_and_the_job_ends(n, how, code, words):
    start = time.monotonic()
    proc = mpirun(n, "leave_check.py", how, timeout=60, check=False)
    took = time.monotonic() - start
    # the leaving rank's code ends the job; for "end" the waiting ranks' own errors do
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    left = _left(proc.stdout)
    assert sorted(x["rank"] for x in left) == list(range(n - 1)), proc.stdout[-2000:]
    for x in left:
        assert x["error"] is not None, x
        assert f"rank {n - 1}" in x["error"], x
        for w in words:
            assert w in x["error"], (w, x)
        # within a second of the allreduce's call (a loaded 2-core machine gets slack)
        assert x["seconds"] < 2.0, x
    assert took < 30, took  # not the group's 30-minute timeout


@pytest.mark.parametrize("delays", [pytest.param("0,0", marks=_WIDE), "0,1",
                                    pytest.param("1,0", marks=_WIDE)])
def test_ranks_that_all_end_normally_exit_zero_in_any_order(delays):
    proc = mpirun(2, "leave_check.py", "normal", delays, timeout=60)
    ended = sorted(line for line in proc.stdout.splitlines() if line.startswith("ended: "))
    assert ended == ["ended: 0", "ended: 1"], proc.stdout
    assert "TransportPeerFailed" not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.wide
@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_three_ranks_that_end_normally_exit_zero_in_every_order(order):
    delays = ",".join(str(0.4 * order.index(r)) for r in range(3))
    proc = mpirun(3, "leave_check.py", "normal", delays, timeout=60)
    ended = sorted(line for line in proc.stdout.splitlines() if line.startswith("ended: "))
    assert ended == [f"ended: {r}" for r in range(3)] and "Traceback" not in proc.stderr


@pytest.mark.wide
def test_under_torchrun_peers_get_the_cause_not_only_the_exit():
    from conftest import torchrun

    proc = torchrun(2, "leave_check.py", "raise", timeout=60, check=False)
    assert proc.returncode != 0
    left = _left(proc.stdout)
    assert [x["rank"] for x in left] == [0], proc.stdout[-2000:]
    assert "raised ValueError: bad batch at leave_check.py:41" in left[0]["error"], left
    assert left[0]["seconds"] < 2.0, left
