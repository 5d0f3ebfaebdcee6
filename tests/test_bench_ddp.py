"""ddp.bench (scripts/bench_ddp.py), the DDP paper's experiments: a quick run on 2 ranks under
mpiexec (every section in the JSON, positive times, the overlap saving, every K
of the round-robin section with its verdicts and traced channel use, the
targets' verdicts, the plots), a run on one process without a launcher, and the
errors for bad flags and a bad targets file. No timing assertions: the numbers
depend on the machine and its load."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, _checked, _env, mpirun

pytestmark = pytest.mark.bench  # make test-bench
from ddp.bench import cli, targets
from ddp.bench.constants import DEFAULT_TARGETS, TARGETS_SCHEMA

SCRIPT = ROOT / "scripts" / "bench_ddp.py"
SECTIONS = ("breakdown", "buckets", "scaling", "nosync", "roundrobin", "hooks", "graph")
#: the sections drawn as plots
PLOTTED = ("breakdown", "buckets", "scaling", "nosync", "roundrobin")
VERDICTS = ("faster", "slower", "no difference beyond noise")


def spans_positive(rec: dict) -> None:
    for span, ms in rec["ms"].items():
        assert ms >= 0, (span, rec)
    assert rec["ms"]["total"] > 0 and rec["ms"]["forward"] > 0 and rec["ms"]["backward"] > 0


def check_document(doc: dict, world: int, sections: tuple[str, ...] = SECTIONS) -> None:
    assert doc["schema"] == "ringcomm.bench_ddp/1"
    meta = doc["meta"]
    assert meta["world_size"] == world and meta["cores"] >= 1
    assert meta["oversubscribed"] == (world > meta["cores"])
    assert meta["configurations"] == ["ours/ringcomm", "torch/ringcomm", "ours/gloo",
                                      "torch/gloo"]
    model = meta["models"]["resnet"]
    assert model["gradient_bytes"] > 0 and model["batch_per_rank"] > 0
    assert "no_sync" in meta["timing"]["exposed_comm"]
    assert all(r["ok"] for r in doc["verification"]["resnet"].values())
    for s in SECTIONS:
        assert set(doc[s]) == {"resnet"} if s in sections else s not in doc, s
    if "breakdown" in sections:
        check_breakdown(doc, world)
    if "buckets" in sections:
        check_buckets(doc["buckets"]["resnet"]["rows"], model["parameter_tensors"])
    if "scaling" in sections:
        check_scaling(doc["scaling"]["resnet"]["rows"], world)
    if "nosync" in sections:
        rows = doc["nosync"]["resnet"]["rows"]
        assert sorted({r["n"] for r in rows}) == [1, 2, 4, 8]
        assert all(r["amortized_ms"] > 0 for r in rows)
    if "hooks" in sections:
        check_hooks(doc["hooks"]["resnet"]["rows"], meta["configurations"])
    if "graph" in sections:
        part = doc["graph"]["resnet"]
        assert {(r["config"], r["variant"]) for r in part["rows"]} == {
            (c, v) for c in meta["configurations"]
            for v in ("default", "find_unused_parameters", "static_graph")}
        assert all(r["total_ms"] > 0 for r in part["rows"])
        for c, sv in part["static_vs_find_unused"].items():
            assert sv["static_saving_pct"] == pytest.approx(
                100 * (sv["find_unused_ms"] - sv["static_graph_ms"]) / sv["find_unused_ms"],
                abs=0.01), c
    if "roundrobin" in sections:
        check_roundrobin(doc["roundrobin"]["resnet"], meta["configurations"], world,
                         meta["timing"]["iters"])


def check_hooks(rows: list, configs: list) -> None:
    by = {(r["config"], r["hook"]): r for r in rows}
    hooks = list(dict.fromkeys(r["hook"] for r in rows))
    assert set(by) == {(c, h) for c in configs for h in hooks}
    for c in configs:
        base = by[(c, "allreduce")]
        assert base["collectives"] >= 1 and base["wire_bytes"] > 0, base
        for h in hooks:
            r = by[(c, h)]
            if "skipped" in r:  # torch's own hooks only, each with its reason
                assert c.startswith("torch/") and "torch" in r["skipped"], r
                continue
            assert r["total_ms"] > 0 and r["time_vs_allreduce"] > 0, r
            if h == "noop":
                assert r["collectives"] == 0 and r["wire_bytes"] == 0, r
            elif h != "allreduce":  # every compression sends less than the allreduce
                assert r["collectives"] >= 1 and 0 < r["wire_vs_allreduce"] < 1, r
    for c in configs:  # ours: two allreduces per compressed bucket, torch's three
        if ("powerSGD r=1" in hooks and "skipped" not in by[(c, "powerSGD r=1")]
                and by[(c, "allreduce")]["collectives"] > 0):
            ps, plain = by[(c, "powerSGD r=1")], by[(c, "allreduce")]
            per_bucket = ps["collectives"] / plain["collectives"]
            assert per_bucket == (2 if c.startswith("ours/") else 3), (c, per_bucket)


def check_breakdown(doc: dict, world: int) -> None:
    meta = doc["meta"]

    bd = doc["breakdown"]["resnet"]
    assert set(bd["rows"]) == set(meta["configurations"]) | {"off/ringcomm", "off/gloo"}
    for name, r in bd["rows"].items():
        assert r["total_ms"] > 0 and r["forward_ms"] > 0, name
        if r["impl"] == "off":
            assert r["comm_ms"] > 0
            spans_positive(r["spans"])
        else:
            assert r["backward_compute_ms"] > 0
            assert r["exposed_comm_ms"] == pytest.approx(r["backward_ms"]
                                                         - r["backward_compute_ms"], abs=2e-3)
            spans_positive(r["sync"])
            spans_positive(r["no_sync"])
            assert len(r["sync"]["rank_median_ms"]["total"]) == world
    for backend in ("ringcomm", "gloo"):
        o = bd["overlap"][backend]
        for impl in ("ours", "torch"):
            e = o[impl]
            assert isinstance(e["saving_ms"], float) and isinstance(e["saving_pct"], float)
            assert e["saving_ms"] == pytest.approx(o["off_total_ms"] - e["on_total_ms"], abs=2e-3)
    check_trace_parts(bd, world)


def check_buckets(rows: list, n_params: int) -> None:
    caps = [r["bucket_cap_mb"] for r in rows if r["config"] == "ours/ringcomm"]
    assert caps == [0, 25, "all"]
    for r in rows:
        assert r["total_ms"] > 0
        if r["impl"] == "ours" and r["bucket_cap_mb"] == 0:
            assert r["buckets"] == n_params  # one bucket per parameter
        if r["impl"] == "ours" and r["bucket_cap_mb"] == "all":
            assert r["buckets"] <= 2  # the first bucket is capped at 1 MiB, the rest is one


def check_scaling(rows: list, world: int) -> None:
    assert sorted({r["world"] for r in rows}) == sorted({1, world})
    for r in rows:
        assert r["samples_per_s"] > 0 and r["scaling_fraction"] > 0
        if r["world"] == 1:
            assert r["scaling_fraction"] == pytest.approx(1.0)


def check_roundrobin(part: dict, configs: list[str], world: int, iters: int) -> None:
    """Every configuration at every K and cap, positive times with their quartiles,
    a verdict for each K > 1; each group really had K communicators; in the traced
    iterations the allreduces ran on min(K, allreduces) channel threads."""
    assert part["channels"] == [1, 3, 5] and part["caps"] == [25, 1] and part["base_k"] == 1
    assert part["communicators"] == {"ringcomm": {"1": 1, "3": 3, "5": 5},
                                     "gloo": {"1": 1, "3": 3, "5": 5}}
    by = {(r["config"], r["bucket_cap_mb"], r["k"]): r for r in part["rows"]}
    assert set(by) == {(c, cap, k) for c in configs for cap in (25, 1) for k in (1, 3, 5)}
    for (c, cap, k), r in by.items():
        assert 0 < r["q1_ms"] <= r["total_ms"] <= r["q3_ms"], r
        assert r["spans"]["samples"] == iters
        base = by[(c, cap, 1)]["total_ms"]
        assert r["speedup_vs_k1"] == pytest.approx(base / r["total_ms"], rel=1e-3)
        assert r["verdict"] == "baseline" if k == 1 else r["verdict"] in VERDICTS, r
    assert by[("ours/ringcomm", 1, 1)]["buckets"] > by[("ours/ringcomm", 25, 1)]["buckets"]
    t = part["trace"]
    assert t["config"] == "ours/ringcomm" and t["bucket_cap_mb"] == 1
    assert sorted(t["per_k"], key=int) == ["1", "3", "5"]
    for k, e in t["per_k"].items():
        if world == 1:  # nothing to reduce: ddp/ runs no allreduce on one rank
            continue
        assert "error" not in e, e
        m = e["median"]
        assert m["allreduces"] == by[("ours/ringcomm", 1, 1)]["buckets"]
        assert m["threads"] == min(int(k), m["allreduces"]), (k, m)  # the channels ran them
        assert 1 <= m["max_in_flight"] <= int(k)
        assert m["allreduce_union_ms"] <= m["allreduce_sum_ms"] + 1e-3
        assert 0 < m["backward_ms"] < m["total_ms"]


def check_trace_parts(bd: dict, world: int) -> None:
    """The trace overhead (ours/ringcomm with a recording on and off) and the breakdown
    read from one traced iteration, next to the wall-clock one."""
    t = bd["trace_overhead"]
    assert t["config"] == "ours/ringcomm" and t["off_total_ms"] == bd["rows"]["ours/ringcomm"][
        "total_ms"]
    assert t["on_total_ms"] > 0 and isinstance(t["overhead_pct"], float)
    assert t["overhead_ms"] == pytest.approx(t["on_total_ms"] - t["off_total_ms"], abs=2e-3)
    spans_positive(t["traced"])
    b = bd["trace_breakdown"]
    assert "error" not in b, b
    assert b["config"] == "ours/ringcomm" and "'copy-back'" in b["method"]
    for k in ("forward", "backward", "exposed_comm", "optimizer", "total"):
        assert b["ms"][k] >= 0 and len(b["rank_ms"][k]) == world, k
        assert k in b["wall_clock_ms"]
    m = b["ms"]
    assert m["total"] >= max(m["forward"], m["backward"], m["optimizer"]) > 0
    assert b["wall_clock_ms"]["total"] == bd["rows"]["ours/ringcomm"]["total_ms"]
    assert b["wall_clock_ms"]["backward"] == bd["rows"]["ours/ringcomm"]["backward_compute_ms"]
    assert b["off"]["ms"]["allreduce"] > 0 and b["off"]["config"] == "off/ringcomm"


def test_quick_run_on_two_ranks(tmp_path):
    out, plots, traced = tmp_path / "out.json", tmp_path / "plots", tmp_path / "run.json"
    proc = mpirun(2, str(SCRIPT), "--quick", "--iters", "1", "--warmup", "1", "--json", str(out),
                  "--plot", str(plots), "--trace", str(traced), timeout=150)
    doc = json.loads(out.read_text())
    check_document(doc, 2)
    assert doc["meta"]["trace"]["path"] == str(traced)
    # --trace: each rank's file, merged by rank 0 into one Chrome trace of both ranks
    merged = json.loads(traced.read_text())
    assert merged["otherData"]["ranks"] == [0, 1]
    assert (tmp_path / "run.rank0.json").exists() and (tmp_path / "run.rank1.json").exists()
    names = {e["name"] for e in merged["traceEvents"] if e.get("ph") == "X"}
    assert {"forward", "backward", "copy-back", "optimizer step"} <= names
    assert any(n.startswith("allreduce[") for n in names)
    for line in ("# trace overhead, ours/ringcomm:", "# breakdown of ours/ringcomm by two methods",
                 "#   trace spans, one iteration", "# trace: "):
        assert line in proc.stdout, line
    recs = doc["targets"]["results"]
    assert len(recs) == 6
    for rec in recs:  # the verdicts: met or missed, with the measured ratio
        assert rec["met"] in (True, False), rec
        assert rec["ratio"] > 0 and rec["per_model"]
    saving = next(r for r in recs if r["metric"] == "overlap_saving")
    assert saving["worst_model"] == "resnet"
    for line in ("# 1. latency breakdown", "# 2. time per iteration", "# 3. scaling",
                 "# 4. skipping synchronization", "# 5. round robin",
                 "# 6. communication hooks", "# 7. static graph", "# speed targets",
                 "# verification:", "traced iterations of ours/ringcomm per K"):
        assert line in proc.stdout, line
    assert ("MET" in proc.stdout) or ("MISSED" in proc.stdout)
    pytest.importorskip("matplotlib")
    assert sorted(p.name for p in plots.iterdir()) == sorted(
        [f"bench_ddp_{s}.png" for s in PLOTTED]
        + ["bench_ddp_timeline.png", "bench_ddp_timeline_off.png",
           "bench_ddp_roundrobin_timeline_k1.png", "bench_ddp_roundrobin_timeline_k5.png"])


def test_ringcomm_without_shared_memory_is_a_backend_of_its_own(tmp_path):
    # ringcomm-mpi: ringcomm with Options(shared_memory=False), beside ringcomm in one run
    out = tmp_path / "out.json"
    mpirun(2, str(SCRIPT), "--quick", "--iters", "1", "--warmup", "1", "--sections",
           "breakdown", "--impls", "ours", "--backends", "ringcomm,ringcomm-mpi", "--json",
           str(out), timeout=150)
    doc = json.loads(out.read_text())
    assert {"ours/ringcomm", "ours/ringcomm-mpi"} <= set(doc["meta"]["configurations"])
    assert all(r["ok"] for r in doc["verification"]["resnet"].values())


def test_one_process_without_a_launcher(tmp_path):
    out = tmp_path / "one.json"
    # the sections that run on one rank as on many (the rest: the two-rank run above)
    sections = ("breakdown", "scaling")
    cmd = [sys.executable, str(SCRIPT), "--quick", "--iters", "1", "--warmup", "1", "--json",
           str(out), "--targets", "none", "--sections", ",".join(sections)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(None), capture_output=True, text=True,
                          timeout=120, start_new_session=True)
    _checked(proc, cmd, True)
    assert "no launcher found; running 1 rank" in proc.stderr
    doc = json.loads(out.read_text())
    check_document(doc, 1, sections)
    assert "targets" not in doc


@pytest.mark.parametrize("argv, words", [
    (["--sections", "breakdown,warp"], ["unknown section (--sections) 'warp'", "breakdown",
                                        "nosync"]),
    (["--model", "gpt"], ["unknown model (--model) 'gpt'", "resnet", "bert"]),
    (["--backends", "nccl2"], ["unknown backend (--backends) 'nccl2'", "gloo"]),
    (["--backends", "ringcomm-mpi,gloo"], ["ringcomm-mpi cannot come first"]),
    (["--iters", "0"], ["--iters must be at least 1, got 0"]),
    (["--channels", "1,0"], ["--channels values must be at least 1, got 0"]),
    (["--rr-caps", "25,x"], ["--rr-caps takes a comma list of numbers, got 'x'"]),
])
def test_bad_flags_exit_2_naming_them(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)


def test_bad_targets_file_is_named(tmp_path, capsys):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"schema": TARGETS_SCHEMA, "targets": [
        {"name": "x", "metric": "speed", "models": "each", "of": "ours/ringcomm",
         "versus": "torch/gloo", "bound": "<=", "goal": 1.0}]}))
    with pytest.raises(SystemExit):
        cli.parse_args(["--targets", str(bad)])
    assert ("metric must be one of iteration_ratio, overlap_saving, roundrobin_ratio, got "
            "'speed'") in capsys.readouterr().err
    assert targets.load_targets(DEFAULT_TARGETS)  # the shipped file is valid


def test_targets_verdicts_from_a_document():
    rows = {"ours/ringcomm": {"total_ms": 90.0}, "torch/gloo": {"total_ms": 105.0},
            "torch/ringcomm": {"total_ms": 80.0}, "off/ringcomm": {"total_ms": 120.0}}
    doc = {"meta": {"world_size": 2, "default_group_backend": "ringcomm"},
           "breakdown": {"resnet": {"rows": rows, "overlap": {"ringcomm": {"comm_share_off": 0.3}}},
                         "bert": {"rows": rows, "overlap": {"ringcomm": {"comm_share_off": 0.1}}}}}
    text, recs = targets.check_targets(doc, targets.load_targets(DEFAULT_TARGETS))
    by = {r["name"]: r for r in recs}
    assert by["ours/ringcomm <= 0.9x torch/gloo"]["met"] is True
    assert by["ours/ringcomm <= 0.9x torch/gloo"]["ratio"] == pytest.approx(90 / 105, abs=1e-4)
    assert by["ours/ringcomm <= 1.0x torch/ringcomm"]["met"] is False  # 1.125x
    over = next(r for r in recs if r["metric"] == "overlap_saving")
    assert over["worst_model"] == "resnet" and over["met"] is True  # saves 25%
    assert over["value"] == pytest.approx(0.25)
    assert "MISSED" in text and "MET" in text
    rr = [r for r in recs if r["metric"] == "roundrobin_ratio"]
    assert rr and all(r["met"] is None for r in rr)  # no roundrobin section: not measured
    assert "NOT MEASURED (needs the roundrobin section" in text


def test_roundrobin_targets_read_the_section_at_their_cap():
    def row(config, k, cap, ms):
        return {"config": config, "k": k, "bucket_cap_mb": cap, "total_ms": ms}

    rows = [row("ours/ringcomm", 1, 25, 100.0), row("ours/ringcomm", 3, 25, 104.0),
            row("torch/gloo", 3, 25, 110.0), row("ours/ringcomm", 1, 1, 100.0),
            row("ours/ringcomm", 5, 1, 120.0)]
    doc = {"meta": {"world_size": 2, "default_group_backend": "ringcomm"},
           "roundrobin": {"resnet": {"rows": rows, "caps": [25, 1]}}}
    _, recs = targets.check_targets(doc, targets.load_targets(DEFAULT_TARGETS))
    by = {r["name"]: r for r in recs}
    k3 = by["ringcomm 3 channels <= 1.05x 1 channel (ours, default buckets)"]
    assert k3["met"] is True and k3["ratio"] == pytest.approx(1.04)
    k5 = by["ringcomm 5 channels <= 1.05x 1 channel (ours, 1 MB buckets)"]
    assert k5["met"] is False and k5["ratio"] == pytest.approx(1.2)  # the 1 MB cap's rows
    vs = by["ours/ringcomm 3 channels <= 1.0x torch/gloo on 3 round-robin groups"]
    assert vs["met"] is True and vs["per_model"]["resnet"]["versus_ms"] == 110.0
    assert by["ours/ringcomm <= 0.9x torch/gloo"]["met"] is None  # no breakdown section



def test_the_ddp_targets_read_three_committed_runs_of_one_command():
    """What make test-bench shows of the DDP targets: the three committed runs of the
    breakdown (docs/ddp.md renders their median: paper.median_of_runs) were each
    verified equal across ranks and configurations, and each carries a verdict for
    both iteration ratios (met or missed: no timing is asserted here)."""
    from ddp.bench import paper
    data = ROOT / "docs" / "data"
    runs = [(json.loads((data / name).read_text()), name) for name in
            ("bench_ddp_loop_2ranks_run1.json", "bench_ddp_loop_2ranks_run2.json",
             "bench_ddp_loop_2ranks.json")]
    for doc, name in runs:
        assert all(c["ok"] for model in doc["verification"].values() for c in model.values()), name
        verdicts = {t["name"]: t["met"] for t in doc["targets"]["results"]}
        for want in ("ours/ringcomm <= 0.9x torch/gloo", "ours/ringcomm <= 1.0x torch/ringcomm"):
            assert verdicts[want] in (True, False), (name, want)
    table = paper.median_of_runs(runs, [("ours/ringcomm", "torch/ringcomm", 1.0)])
    assert table.count("(met)") + table.count("(missed)") == 2  # resnet and bert
