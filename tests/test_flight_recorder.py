"""The flight recorder (ringcomm.trace.flight) writes torch's dump format, read by
torch's own analyzer and by ``python -m ringcomm.flight_recorder``; every rank of a
group dumps when a collective fails on one of them, the rank stuck outside the
collectives too (tests/ranks/flight_check.py)."""
from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys

import pytest
import torch

from conftest import mpirun
from ringcomm import flight_recorder
from ringcomm.trace import flight


class _Work:
    def __init__(self, done: bool):
        self.done, self._exc = done, None

    def is_completed(self) -> bool:
        return self.done


def _write_dumps(tmp_path, monkeypatch, calls_per_rank: dict[int, list]) -> str:
    """One dump per rank from ``(method, args, done)`` calls on a 2-rank group."""
    prefix = str(tmp_path / "rank_")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", prefix)
    works = []
    for rank, calls in calls_per_rank.items():
        rec = flight.Recorder(100)
        tag = flight.GroupTag("0", "default_pg", [0, 1])
        for seq, (method, args, done) in enumerate(calls, 1):
            meta = flight.call_meta(method, "gloo", args, 2, f"{method}[ring]")
            entry = rec.record(tag, seq, 0, meta, 60.0)
            works.append(_Work(done))
            rec.issued(entry, works[-1], False)
        assert rec.write(rank, "test") == f"{prefix}{rank}"
    return str(tmp_path)


def _steps(n: int, last_done: bool = True) -> list:
    x = torch.ones(4, 3)
    calls = [("allreduce", ([x],), True), ("broadcast", ([x],), True),
             ("allgather", ([[torch.empty(4, 3)] * 2], [x]), True)] * n
    calls.append(("allreduce", ([x],), last_done))
    return calls


@pytest.mark.compat  # torch's analyzer of 2.13 and 2.15 (2.7 has none)
def test_a_rank_missing_from_a_collective_is_named_by_both_analyzers(tmp_path, monkeypatch):
    d = _write_dumps(tmp_path, monkeypatch, {0: _steps(2, last_done=False), 1: _steps(2)[:-1]})
    dumps, bad = flight_recorder.load(d)
    assert sorted(dumps) == [0, 1] and not bad
    assert dumps[0]["version"] == flight.VERSION
    result = flight_recorder.analyze(dumps, bad)
    (group,) = result["groups"]
    nr = group["first_not_reached"]
    assert nr["seq"] == 7 and nr["missing"] == [1] and nr["states"] == {0: "started"}
    assert "first_mismatch" not in group
    assert result["last_doing"][1].startswith("all_gather #6 of [[4, 3]] Float [ring]")
    text, wrong = flight_recorder.report(result)
    assert wrong and "ranks [1] never called it" in text
    lines = flight_recorder.run_torch_analyzer(d, None, False)
    if lines and "not available" in lines[0]:
        pytest.skip(lines[0])  # torch < 2.8 has no analyzer
    # torch's: the allgathers' sizes, names and states all pass its checks
    assert "missing ranks: {1}" in lines and "Not all ranks joining collective, sequence "\
        "number: 7" in lines, lines
    assert not any("mismatch" in line.lower() or "stopped" in line for line in lines), lines


def test_calls_made_differently_are_named_with_each_ranks_call(tmp_path, monkeypatch):
    a, b = torch.ones(4), torch.ones(5)
    d = _write_dumps(tmp_path, monkeypatch, {0: [("allreduce", ([a],), True)],
                                             1: [("allreduce", ([b],), True)]})
    result = flight_recorder.analyze(*flight_recorder.load(d))
    mm = result["groups"][0]["first_mismatch"]
    assert mm == {"seq": 1, "calls": {0: "all_reduce #1 of [[4]] Float [ring]",
                                      1: "all_reduce #1 of [[5]] Float [ring]"}}


def test_a_missing_or_unreadable_dump_is_named_and_the_rest_analysed(tmp_path, monkeypatch, capsys):
    d = _write_dumps(tmp_path, monkeypatch, {0: _steps(1, last_done=False), 1: _steps(1)[:-1]})
    os.remove(tmp_path / "rank_1")
    (tmp_path / "rank_2").write_bytes(b"not a pickle")
    assert flight_recorder.main([d]) == 1
    out = capsys.readouterr().out
    assert "rank 2: unreadable: " + str(tmp_path / "rank_2") in out
    assert "no dump from ranks [1]" in out
    (tmp_path / "other_7").write_bytes(b"")
    assert flight_recorder.main([d]) == 2
    assert "name one with --prefix" in capsys.readouterr().err
    assert flight_recorder.main([d, "--prefix", "rank_"]) == 1


def test_sizes_names_and_a_ring_that_wraps():
    x = torch.ones(2, 3, dtype=torch.bfloat16)
    name, ins, in_dt, outs, out_dt, algo = flight.call_meta(
        "allgather", "nccl", ([[torch.empty(2, 3)] * 4], [x]), 4, "allgather[ring]")
    assert (name, ins, in_dt, outs, algo) == ("nccl:all_gather", [[2, 3]], ["BFloat16"],
                                              [[24]], "ring")
    name, ins, _, outs, _, _ = flight.call_meta(
        "_reduce_scatter_base", "gloo", (torch.empty(3), torch.empty(12)), 4, "x[ring]")
    assert (name, ins, outs) == ("gloo:_reduce_scatter_base", [[12]], [[3]])
    rec = flight.Recorder(3)
    tag = flight.GroupTag("1", "sub", [2, 5])
    for seq in range(1, 6):
        rec.issued(rec.record(tag, seq, 0, flight.call_meta("barrier", "gloo", (), 2, "b"),
                              1.0), None, True)
    snap = rec.snapshot()
    assert [e["collective_seq_id"] for e in snap["entries"]] == [3, 4, 5]
    assert snap["pg_config"] == {"1": {"name": "1", "desc": "sub", "ranks": "[2, 5]"}}
    assert {e["state"] for e in snap["entries"]} == {"completed"}


def test_the_buffer_size_variable(monkeypatch):
    for raw, want in [("0", None), ("7", 7), ("", None)]:
        monkeypatch.setattr(flight, "_made", False)
        monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", raw)
        monkeypatch.setenv("RINGCOMM_FR_SIGNAL", "off")
        rec = flight.recorder()
        assert (rec.capacity if rec else None) == want
    monkeypatch.setattr(flight, "_made", False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "lots")
    with pytest.raises(ValueError, match="TORCH_FR_BUFFER_SIZE='lots'"):
        flight.recorder()
    monkeypatch.setattr(flight, "_made", False)


def test_a_dump_that_cannot_be_written_names_the_path_and_training_goes_on(tmp_path, caplog):
    rec = flight.Recorder(4)
    blocked = tmp_path / "file"
    blocked.write_text("")
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = str(blocked / "rank_")
    try:
        assert rec.write(3, "test") is None
    finally:
        del os.environ["TORCH_FR_DUMP_TEMP_FILE"]
    assert str(blocked / "rank_3") in caplog.text and "could not write" in caplog.text
    # a write that fails part way (a full disk; here a file size limit): the same
    code = ("import os, resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (10, 10)); "
            "from ringcomm.trace import flight; r = flight.Recorder(4); "
            "print(r.write(0, 'test'))")
    env = dict(os.environ, TORCH_FR_DUMP_TEMP_FILE=str(tmp_path / "full_"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.stdout.strip() == "None", proc.stdout + proc.stderr
    assert str(tmp_path / "full_0") in proc.stderr and "could not write" in proc.stderr
    assert not list(tmp_path.glob("full_0*"))  # no half-written dump left


@pytest.mark.wide  # 11 s of launches; the dumps' analysis is tested in-process above
def test_a_stuck_rank_is_named_from_every_ranks_dump(tmp_path):
    """3 ranks, 5 s group timeout; rank 2 stops calling collectives at step 37 (it
    sleeps) while ranks 0 and 1 time out in that step's allreduce: all three dump,
    and the analysis names rank 2 as the one missing from it."""
    prefix = tmp_path / "dump_"
    proc = mpirun(3, "flight_check.py", timeout=120, env={
        "TORCH_FR_BUFFER_SIZE": "200", "TORCH_FR_DUMP_TEMP_FILE": str(prefix)})
    assert "signal dump: True" in proc.stdout, proc.stdout
    # the ranks' lines may merge on mpiexec's shared stdout ("...dump_2dumped: ...")
    dumped = sorted(re.findall(rf"dumped: ({re.escape(str(prefix))}\d|None)", proc.stdout))
    assert dumped == [f"{prefix}{r}" for r in range(3)], proc.stdout + proc.stderr
    result = flight_recorder.analyze(*flight_recorder.load(str(tmp_path)))
    nr = result["groups"][0]["first_not_reached"]
    # 36 steps of one allreduce, a broadcast every 10th: step 37's allreduce is #40
    assert nr["seq"] == 40 and nr["missing"] == [2], result
    assert nr["states"] == {0: "started", 1: "started"}
    # what held them: rank 1 waits for rank 2 (rank 0, in recursive doubling, for 1)
    assert "recv from rank 2" in nr["held"][1], nr
    assert result["last_doing"][2].startswith("all_reduce #39 of [[1024]] Float"), result
    assert result["groups"][0]["unmatched_p2p"] == []
    with open(f"{prefix}2", "rb") as f:
        assert pickle.load(f)["entries"][-1]["state"] == "completed"


def test_a_dump_asks_no_work_that_could_take_a_lock():
    """A dump may run while the interrupted thread holds MPI's lock: it reads the
    Works' state, never ``is_completed()`` (which tests MPI requests)."""
    class Untouchable:
        _done, _exc = False, None

        def is_completed(self):
            raise AssertionError("is_completed() called from a dump")

    class Finished(Untouchable):
        _done = True

    rec = flight.Recorder(4)
    tag = flight.GroupTag("0", "default_pg", [0, 1])
    meta = flight.call_meta("barrier", "gloo", (), 2, "b")
    works = [Untouchable(), Finished()]
    for seq, w in enumerate(works, 1):
        rec.issued(rec.record(tag, seq, 0, meta, 1.0), w, False)
    assert [e["state"] for e in rec.snapshot()["entries"]] == ["started", "completed"]


def test_calls_the_rings_overwrote_are_said_so(tmp_path, monkeypatch):
    """Rank 0 ran 900 allreduces, rank 1 500, each ring keeps 100: the first one rank
    1 missed is gone from rank 0's ring; the analysis names the first kept one, says
    so, and does not crash; a rank that kept none of a group's calls is named."""
    prefix = str(tmp_path / "rank_")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", prefix)
    x = torch.ones(4)
    meta = flight.call_meta("allreduce", "gloo", ([x],), 2, "allreduce[ring]")
    for rank, calls in ((0, 900), (1, 500)):
        rec = flight.Recorder(100)
        tag = flight.GroupTag("1", "d", [0, 1])
        for seq in range(1, calls + 1):
            rec.issued(rec.record(tag, seq, 0, meta, 1.0), None, True)
        rec.write(rank, "test")
    result = flight_recorder.analyze(*flight_recorder.load(str(tmp_path)))
    nr = result["groups"][0]["first_not_reached"]
    assert (nr["seq"], nr["missing"], nr["exact"]) == (801, [1], False)
    text, wrong = flight_recorder.report(result)
    assert wrong and "the rings overwrote the ones before it" in text


def test_the_watch_goes_on_past_a_group_that_fails_to_look(monkeypatch):
    from ringcomm.front import watch

    looked = []

    class Group:
        def __init__(self, fail):
            self.fail, self.lanes = fail, self

        def look_for_news(self):
            looked.append(self.fail)
            if self.fail:
                raise RuntimeError("dictionary changed size during iteration")
            return None

        def _describe(self):
            return "g"

    groups = [Group(True), Group(False)]
    monkeypatch.setattr(watch, "_groups", groups)
    watch._look()
    assert looked == [True, False]


def test_a_dump_another_process_wrote_since_this_one_started_is_named(tmp_path, caplog,
                                                                     monkeypatch):
    """Two jobs sharing a dump prefix: the second's dump replaces the first's, with a
    warning naming the path (its own earlier dump is replaced silently)."""
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "rank_"))
    (tmp_path / "rank_0").write_bytes(b"another job's dump")
    rec = flight.Recorder(4)
    assert rec.write(0, "test") == str(tmp_path / "rank_0")
    assert f"replaces {tmp_path / 'rank_0'}, which another process wrote" in caplog.text
    caplog.clear()
    rec.write(0, "again")
    assert "another process" not in caplog.text
