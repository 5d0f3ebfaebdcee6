"""ringcomm.trace: a real 2-rank DDP run's trace keeps its invariants, the merged
file is a Chrome trace, and merging refuses what it cannot merge."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import assert_checks, mpirun
from ringcomm import trace


def _chrome_events(doc: dict) -> list[dict]:
    """The events, after checking the Chrome trace format's required fields."""
    assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "i", "M"), e
        assert isinstance(e["pid"], int) and isinstance(e["name"], str), e
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["tid"], int), e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
    return doc["traceEvents"]


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("trace")
    proc = mpirun(2, "trace_check.py", timeout=120, env={"RINGCOMM_TRACE": str(out / "run.json")})
    assert_checks(proc.stdout, "trace_check n=2", 2)
    files = sorted(str(p) for p in out.glob("run.rank*.json"))
    assert [p.rsplit("/", 1)[1] for p in files] == ["run.rank0.json", "run.rank1.json"]
    cmd = [sys.executable, "-m", "ringcomm.trace", "merge", str(out / "run.json"), *files]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads((out / "run.json").read_text())


def _per_rank(doc: dict) -> dict[int, list[dict]]:
    by: dict[int, list[dict]] = {}
    for e in _chrome_events(doc):
        if e["ph"] != "M":
            by.setdefault(e["pid"], []).append(e)
    assert sorted(by) == [0, 1]
    return by


def test_every_collective_is_enqueued_then_started_then_ended(merged):
    for rank, events in _per_rank(merged).items():
        colls = [e for e in events if e["cat"] == "collective"]
        assert len(colls) >= 8, (rank, len(colls))
        for e in colls:
            a = e["args"]
            assert a["enqueued_us"] <= e["ts"] <= e["ts"] + e["dur"], e
            # a transport's own collective (MPI's native, shm_direct: auto's measured rows
            # choose them) sends no point-to-point messages of ringcomm's to annotate
            assert "[native]" in e["name"] or "[shm_direct]" in e["name"] \
                or a["peers"] == [1 - rank], e
            assert a["group"] and a["seq"] > 0, e
            assert "[" in e["name"], e  # the algorithm: "allreduce[ring]"
        enq = [e for e in events if e["cat"] == "enqueue"]
        assert len(enq) == len(colls)


def _inside(s: dict, c: dict) -> bool:
    """Whether event ``s`` lies within event ``c`` on its thread (1 us of rounding)."""
    return (c["tid"] == s["tid"] and c["ts"] <= s["ts"]
            and s["ts"] + s["dur"] <= c["ts"] + c["dur"] + 1)


def test_steps_lie_inside_their_collective(merged):
    """Every step lies inside a collective, and every collective that ran a schedule
    (not MPI's own, not shm_direct's round) holds at least one step: a trace that
    records no steps fails."""
    for events in _per_rank(merged).values():
        colls = [e for e in events if e["cat"] == "collective"]
        steps = [e for e in events if e["cat"] == "step"]
        for s in steps:
            assert any(_inside(s, c) for c in colls), s
        scheduled = [c for c in colls
                     if "[native]" not in c["name"] and "[shm_direct]" not in c["name"]]
        assert scheduled, [c["name"] for c in colls]
        for c in scheduled:
            assert any(_inside(s, c) for s in steps), c


def _iterations(events: list[dict]) -> list[tuple[dict, dict, list[dict]]]:
    """(backward span, the optimizer step after it, the events between their starts)."""
    backs = sorted((e for e in events if e["name"] == "backward"), key=lambda e: e["ts"])
    steps = sorted((e for e in events if e["name"] == "optimizer step"), key=lambda e: e["ts"])
    assert len(backs) == len(steps) == 4
    out = []
    for b, s in zip(backs, steps):
        assert b["ts"] + b["dur"] <= s["ts"]
        out.append((b, s, [e for e in events if b["ts"] <= e["ts"] <= s["ts"]]))
    return out


def test_with_overlap_a_bucket_allreduce_starts_before_backward_ends(merged):
    for rank, events in _per_rank(merged).items():
        overlapped = 0
        for back, _, inside in _iterations(events):
            end = back["ts"] + back["dur"]
            overlapped += any(e["cat"] == "collective" and e["name"].startswith("allreduce")
                              and e["ts"] < end for e in inside)
        assert overlapped >= 1, f"rank {rank}: no bucket's allreduce started during backward"


def test_every_launched_bucket_is_waited_on_before_the_optimizer_step(merged):
    for events in _per_rank(merged).values():
        for back, step, inside in _iterations(events):
            launched = {e["args"]["bucket"] for e in inside if e["name"].endswith(" launch")}
            waited = {e["args"]["bucket"]: e for e in inside if e["name"].startswith("wait bucket")}
            assert launched and launched == set(waited), (launched, sorted(waited))
            for e in waited.values():
                assert e["ts"] + e["dur"] <= step["ts"], e
            copy = [e for e in inside if e["name"] == "copy-back"]
            assert len(copy) == 1 and copy[0]["ts"] >= max(w["ts"] for w in waited.values())


# -- without ranks --------------------------------------------------------------------
def test_off_records_nothing(monkeypatch):
    # a recording made and stopped: the hooks called after it must reach no recorder,
    # neither the stopped one nor any other (every recorder's add is watched)
    added = []
    real_add = trace.Recorder.add
    monkeypatch.setattr(trace.Recorder, "add", lambda self, e: (added.append(e),
                                                                 real_add(self, e)))
    rec = trace.start(rank=0)
    trace.instant("while on", "test")
    assert trace.stop() is rec and len(added) == 1
    before = len(rec.events)
    assert not trace.active()
    with trace.span("x", "test") as args:
        args["k"] = 1
    trace.instant("y", "test")
    trace.annotate(z=2)
    trace.complete("w", "test", 0.0, 1.0)
    assert trace.now() == 0.0
    assert len(added) == 1 and len(rec.events) == before


def test_recording_in_process_and_rank_paths(tmp_path):
    with trace.recording(tmp_path / "part.json", rank=3) as rec:
        with trace.span("outer", "test", a=1):
            trace.annotate(b=2)
            trace.instant("mark", "test")
    assert not trace.active()
    names = [e["name"] for e in rec.events if e["ph"] != "M"]
    assert names == ["mark", "outer"]
    outer = next(e for e in rec.events if e["name"] == "outer")
    assert outer["args"] == {"a": 1, "b": 2} and outer["pid"] == 3
    doc = json.loads((tmp_path / "part.rank3.json").read_text())
    assert doc["otherData"]["rank"] == 3 and _chrome_events(doc)
    assert str(trace.rank_path("t/{rank}/x.json", 5)) == "t/5/x.json"
    assert str(trace.rank_path("run", 2)) == "run.rank2.json"


def _doc(rank: int, host: str, barrier_end: float) -> dict:
    return {"traceEvents": [{"ph": "X", "name": "barrier[dissemination]", "cat": "collective",
                             "ts": barrier_end - 10, "dur": 10, "pid": rank, "tid": 0}],
            "otherData": {"schema": "ringcomm.trace/1", "rank": rank, "host": host}}


def test_a_collectives_bytes_are_counted_once_as_nccl_tests_counts_them(merged):
    # the run's all_reduce(torch.ones(100)): 400 bytes (the buffer, not twice)
    for rank, events in _per_rank(merged).items():
        sizes = {e["args"]["bytes"] for e in events
                 if e["cat"] == "collective" and e["name"].startswith("allreduce")}
        assert 400 in sizes and 800 not in sizes, (rank, sorted(sizes))


def test_traced_bytes_takes_the_larger_side_each_byte_once():
    from ringcomm.front.process_group import traced_bytes

    t = torch.ones(1000)
    assert traced_bytes(([t],)) == 4000  # allreduce, broadcast, reduce
    assert traced_bytes(([t, t[:10]],)) == 4000  # a view of the same memory: once
    outs = [torch.empty(1000) for _ in range(4)]
    assert traced_bytes(([outs], [t])) == 16000  # allgather: its output
    flat = torch.empty(4000)
    assert traced_bytes((flat, flat[1000:2000])) == 16000  # in place: the output
    assert traced_bytes(([t[:250]], [outs])) == 16000  # reduce_scatter: its input
    assert traced_bytes((dist.BarrierOptions(),)) == 0


def test_merge_aligns_clocks_across_hosts_only():
    same = trace.merge([_doc(0, "a", 100.0), _doc(1, "a", 250.0)])
    assert same["otherData"]["clock_shift_us"] == {"0": 0.0, "1": 0.0}
    apart = trace.merge([_doc(1, "b", 250.0), _doc(0, "a", 100.0)])
    assert apart["otherData"]["clock_shift_us"] == {"0": 0.0, "1": -150.0}
    ends = {e["pid"]: e["ts"] + e["dur"] for e in apart["traceEvents"]}
    assert ends == {0: 100.0, 1: 100.0}
    forced = trace.merge([_doc(0, "a", 100.0), _doc(1, "a", 250.0)], align=True)
    assert forced["otherData"]["clock_shift_us"]["1"] == -150.0


def test_merge_refuses_what_it_cannot_merge(tmp_path, capsys):
    from ringcomm.trace.merging import main

    with pytest.raises(ValueError, match="not a ringcomm trace"):
        trace.merge([{"traceEvents": []}])
    with pytest.raises(ValueError, match="document 0 and document 1 are both traces of rank 0"):
        trace.merge([_doc(0, "a", 1.0), _doc(0, "a", 2.0)])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    # the command as a user runs it, in its own process once; then its main() here
    proc = subprocess.run([sys.executable, "-m", "ringcomm.trace", "merge",
                           str(tmp_path / "o.json"), str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cannot read" in proc.stderr and "bad.json" in proc.stderr
    # the file that is not a trace is the one named
    good, other = tmp_path / "r0.json", tmp_path / "other.json"
    good.write_text(json.dumps(_doc(0, "a", 1.0)))
    other.write_text(json.dumps({"traceEvents": []}))
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "o.json"), str(good), str(other)]) == 2
    err = capsys.readouterr().err
    assert f"{other} is not a ringcomm trace" in err, err
    # the output name forgotten: the first input would be overwritten
    before = good.read_text()
    assert main(["merge", str(good), str(good)]) == 2
    err = capsys.readouterr().err
    assert "is also an input" in err, err
    assert good.read_text() == before
    assert not (tmp_path / "o.json").exists()


def test_one_iteration_is_drawn(merged, tmp_path):
    pytest.importorskip("matplotlib")
    from ringcomm.trace import timeline

    start, end = timeline.iteration_window(merged, 2)
    assert start < end
    out = tmp_path / "iteration.png"
    timeline.draw(merged, str(out), (start, end), "iteration 2")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    with pytest.raises(ValueError, match="has 4 optimizer steps; iteration 9 needs 10"):
        timeline.iteration_window(merged, 9)


def test_each_iteration_is_forward_then_backward_then_optimizer_step(merged):
    for events in _per_rank(merged).values():
        forwards = sorted((e for e in events if e["name"] == "forward"), key=lambda e: e["ts"])
        assert len(forwards) == 4
        for fwd, (back, step, _) in zip(forwards, _iterations(events)):
            assert fwd["ts"] + fwd["dur"] <= back["ts"] + back["dur"] <= step["ts"]
