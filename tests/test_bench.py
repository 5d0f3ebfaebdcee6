"""ringcomm.bench (``python -m ringcomm.bench`` and ``scripts/compare_collectives.py``):
a quick run on 2 ranks (results checked, JSON schema), the floor column,
ringcomm's native algorithm, the speed targets read from a targets file, the
flags and their errors, and sizes. The cost model and tuning are in
test_costmodel.py."""
from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, _checked, _run, _which, mpirun, torchrun

pytestmark = pytest.mark.bench  # make test-bench
from ringcomm.bench import columns
from ringcomm.bench import targets as bench_targets
from ringcomm.bench.analysis import analyse
from ringcomm.bench.cli import parse_args
from ringcomm.bench.results import SCHEMA
from ringcomm.bench.sizes import (BUSBW_FACTOR, COLLECTIVES, auto_nbytes, message_sizes,
                                  parse_size, shape_for)
from ringcomm.bench.targets import DEFAULT_TARGETS, TARGETS_SCHEMA, check_targets, load_targets

SCRIPT = str(ROOT / "scripts" / "compare_collectives.py")

RESULT_FIELDS = {"collective": str, "size": int, "count": int, "dtype": str, "redop": str,
                 "root": int, "column": str, "status": str}
OPTIONAL_FIELDS = {"time_us": float, "algbw": float, "busbw": float, "wrong": int,
                   "iters": int, "auto_choice": str, "reason": str,
                   "rank_median_us": list, "rank_q25_us": list, "rank_q75_us": list,
                   "dispatch_us": float}


def assert_result_schema(r: dict, min_iters: int) -> None:
    """One result of a 2-rank run has the documented fields, types and arithmetic."""
    for k, typ in RESULT_FIELDS.items():
        assert isinstance(r[k], typ), (k, r)
    for k, typ in OPTIONAL_FIELDS.items():
        assert r[k] is None or isinstance(r[k], typ), (k, r)
    if r["status"] == "ok":
        assert r["time_us"] > 0 and r["iters"] >= min_iters
        assert len(r["rank_median_us"]) == 2
        assert r["time_us"] == pytest.approx(max(r["rank_median_us"]))
        # busbw from the nccl-tests factors (2 ranks)
        factor = {"allreduce": 1.0, "broadcast": 1.0, "allgather": 0.5,
                  "reduce_scatter": 0.5, "alltoall": 0.5}[r["collective"]]
        assert r["algbw"] == pytest.approx(r["size"] / r["time_us"] / 1e3)
        assert r["busbw"] == pytest.approx(r["algbw"] * factor)


# ---------------------------------------------------------------------------
# runs on two ranks
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick run of every collective on 2 ranks, shared by the checks below."""
    d = tmp_path_factory.mktemp("quick")
    files = {k: str(d / f"out.{k}") for k in ("json", "csv", "png", "md")}
    files["tuning"] = str(d / "tuning.json")
    proc = mpirun(2, SCRIPT, "-b", "4", "-e", "64K", "-f", "128", "-n", "3", "-w", "0",
                  "--min-time", "0", "--rounds", "1", "-c", "--coll", "all",
                  "--algos", "auto,tree,ring",  # auto first: its pick must not see ring's setting
                  "--peers", "mpi,gloo,nccl,floor",  # the same columns where DeepSpeed is installed
                  "--predict-ranks", "8,64",
                  "--json", files["json"], "--csv", files["csv"], "--plot", files["png"], "--markdown", files["md"],
                  "--write-tuning", files["tuning"], timeout=150)
    with open(files["json"]) as f:
        doc = json.load(f)
    return proc, doc, files


def test_quick_run_checks_every_result_and_finds_nothing_wrong(quick_run):
    proc, doc, _ = quick_run
    results = doc["results"]
    ok = [r for r in results if r["status"] == "ok" and r["column"] != "floor"]
    assert ok, "no measurement succeeded"
    # -c was on: every measured point was checked, and against the expected values
    # (except the floor's, which computes nothing: see the floor test).
    assert all(r["wrong"] == 0 for r in ok), [r for r in ok if r["wrong"] != 0]
    assert "wrong values in total: 0 OK" in proc.stdout
    # What ringcomm has today must run; MPI and gloo run every collective.
    measured = {(r["collective"], r["column"]) for r in ok}
    for need in [("allreduce", "ring"), ("allreduce", "tree"), ("allreduce", "auto"),
                 ("broadcast", "ring"), ("broadcast", "tree"), ("allgather", "ring"),
                 *[(c, "mpi") for c in COLLECTIVES], ("allreduce", "gloo")]:
        assert need in measured, f"{need} was not measured"
    # What ringcomm lacks is reported, not a crash.
    for r in results:
        if r["status"] != "ok":
            assert r["status"] in ("unsupported", "skipped"), r
            assert r["reason"], r
    assert any(r["column"] == "tree" and r["collective"] == "allgather" and
               r["status"] == "unsupported" for r in results)


def test_quick_run_floor_is_dispatch_plus_mpi_for_allreduce_only(quick_run):
    _, doc, _ = quick_run
    cells = {(r["collective"], r["column"], r["size"]): r for r in doc["results"]}
    floors = [r for r in doc["results"] if r["column"] == "floor"]
    assert floors
    for fl in floors:
        if fl["collective"] != "allreduce":
            assert fl["status"] == "unsupported" and "allreduce only" in fl["reason"], fl
            continue
        mpi = cells[("allreduce", "mpi", fl["size"])]
        assert fl["status"] == "ok" and mpi["status"] == "ok", (fl, mpi)
        assert fl["wrong"] is None  # computes nothing, so nothing to check
        assert fl["dispatch_us"] > 0
        # per rank: do-nothing dispatch + that rank's MPI median; time = max over ranks
        assert fl["time_us"] == pytest.approx(max(fl["rank_median_us"]))
        assert mpi["time_us"] < fl["time_us"] <= fl["dispatch_us"] + mpi["time_us"] + 1e-6


def test_quick_run_table_has_a_row_per_size(quick_run):
    proc, doc, _ = quick_run
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.strip() and not ln.startswith("#")]
    # -b 4 -e 64K -f 128: 4, 512, 65536
    by_coll = {}
    for r in doc["results"]:
        by_coll.setdefault(r["collective"], set()).add(r["size"])
    assert len(rows) == sum(len(v) for v in by_coll.values())
    assert sorted(by_coll["allreduce"]) == [4, 512, 65536]
    # allgather etc. round to whole elements per rank: 4 B -> 2 floats on 2 ranks
    assert sorted(by_coll["allgather"]) == [8, 512, 65536]
    assert "# world: 2 ranks" in proc.stdout
    assert "MPICH" in proc.stdout or "MPI" in proc.stdout


def test_quick_run_json_schema(quick_run):
    from ringcomm.algorithms import select

    table = select.load_tuning()
    _, doc, _ = quick_run
    assert doc["schema"] == SCHEMA
    meta = doc["meta"]
    assert meta["world_size"] == 2
    assert sum(meta["hosts"].values()) == 2
    for key in ("ringcomm", "torch", "mpi4py", "mpi_library"):
        assert meta["versions"][key]
    assert meta["ringcomm"]["segment_bytes"] > 0
    assert {c["name"] for c in meta["columns"]} >= {"ring", "tree", "auto", "mpi", "gloo"}
    assert meta["gamma_s_per_byte"]["float/sum"] > 0
    for r in doc["results"]:
        assert_result_schema(r, min_iters=3)
        if r["column"] == "auto" and r["status"] == "ok":
            # what ringcomm's selection table says for this size (one rank's block for
            # allgather and reduce_scatter: what a rank passes in), independent of the script
            per_block = r["collective"] in ("allgather", "reduce_scatter")
            nbytes = r["size"] // 2 if per_block else r["size"]
            assert r["auto_choice"] == select.choose(table, r["collective"], nbytes, 2), r
    model = doc["analysis"]["cost_model"]
    assert {f["column"] for f in model["fits"] if f["collective"] == "allreduce"} >= {"ring", "tree"}
    assert {p["world_size"] for p in model["predictions"]} == {8, 64}


def test_quick_run_writes_csv_plot_and_a_tuning_file_ringcomm_accepts(quick_run):
    from ringcomm.algorithms import REGISTRY, select

    _, doc, files = quick_run
    with open(files["csv"]) as f:
        lines = f.read().splitlines()
    assert lines[0].startswith("collective,size,count,dtype")
    assert len(lines) == 1 + len(doc["results"])
    with open(files["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(files["md"]) as f:
        md = f.read()
    assert "#### allreduce, float, sum, 2 ranks" in md
    assert "| size | auto us | tree us | ring us | mpi us | gloo us | floor us |" in md
    table = select.load_tuning(files["tuning"])
    with open(files["tuning"]) as f:
        written = json.load(f)
    assert set(written) >= {"allreduce", "broadcast", "allgather"}
    for coll, by_p in written.items():
        assert list(by_p) == ["2"]
        rows = by_p["2"]
        assert rows[-1][0] is None
        assert all(algo in REGISTRY[coll] for _, algo in rows)
        for n in (1, 100, 10_000, 1 << 30):
            assert select.choose(table, coll, n, 2) in REGISTRY[coll]


def test_torchrun_launch_with_concurrent_collectives_on_channels(tmp_path):
    """Under torchrun, --concurrent 3 (three collectives in flight per timed call) on
    a ringcomm group of two channels, against MPI's non-blocking collectives and two
    gloo groups used in turn; -c checks the first collective's buffers; --links on
    measures the one link (within this host)."""
    out = str(tmp_path / "c.json")
    proc = torchrun(2, SCRIPT, "-b", "1K", "-e", "64K", "-f", "64", "-n", "2", "-w", "0",
                    "--min-time", "0", "--rounds", "1", "-c", "--concurrent", "3", "--links", "on",
                    "--channels", "2", "--coll", "allreduce,allgather", "--algos", "auto",
                    "--peers", "mpi,gloo,floor", "--no-model", "--json", out, timeout=120)
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.strip() and not ln.startswith("#")]
    assert [r[0] for r in rows] == ["1024", "65536"] * 2
    assert "launcher torchrun" in proc.stdout
    assert "# concurrent: 3 collectives in flight" in proc.stdout
    assert "2 channel(s)" in proc.stdout
    assert "wrong values in total: 0 OK" in proc.stdout
    with open(out) as f:
        doc = json.load(f)
    assert doc["meta"]["timing"]["concurrent"] == 3
    assert doc["meta"]["ringcomm"]["num_channels"] == 2
    [link] = doc["meta"]["links"]
    assert link["link"] == f"within {socket.gethostname()}" and link["ranks"] == [0, 1]
    assert link["latency_us"] > 0 and link["bandwidth_GBps"] > 0
    assert f"# links (ping-pong over ringcomm send/recv; latency 8 B, bandwidth 4 MiB): " \
           f"{link['link']} {link['latency_us']:.1f} us" in proc.stdout
    by_col: dict = {}
    for r in doc["results"]:
        by_col.setdefault(r["column"], []).append(r)
    for col in ("auto", "mpi", "gloo"):
        assert len(by_col[col]) == 4
        for r in by_col[col]:
            assert r["status"] == "ok", r
            # aggregate bandwidth: three collectives' bytes over the time of all three
            assert r["algbw"] == pytest.approx(3 * r["size"] / (r["time_us"] * 1e3),
                                                    rel=1e-6)
    assert all(r["status"] == "unsupported" for r in by_col["floor"])
    assert all("one collective at a time" in r["reason"] for r in by_col["floor"]
               if r["collective"] == "allreduce")


def test_a_torchrun_run_on_the_tcp_transport_skips_only_what_needs_mpi(tmp_path):
    """Under torchrun on the tcp transport no MPI world exists: the mpi and floor
    columns are skipped with that reason, ringcomm's algorithms and gloo run and are
    checked (-c), and the untimed exchanges go over gloo."""
    out = str(tmp_path / "t.json")
    proc = torchrun(2, SCRIPT, "-b", "1K", "-e", "64K", "-f", "64", "-n", "2", "-w", "0",
                    "--min-time", "0", "--rounds", "1", "-c", "--algos", "ring,auto",
                    "--peers", "mpi,gloo,floor", "--no-model", "--barrier-each",
                    "--json", out, env={"RINGCOMM_TRANSPORT": "tcp"}, timeout=120)
    assert "wrong values in total: 0 OK" in proc.stdout
    doc = json.loads(Path(out).read_text())
    status = {(r["column"], r["size"]): r["status"] for r in doc["results"]}
    for size in (1024, 65536):
        assert [status[c, size] for c in ("ring", "auto", "gloo")] == ["ok"] * 3, status
    skipped = [r for r in doc["results"] if r["column"] in ("mpi", "floor")]
    assert skipped and all(r["status"] != "ok" for r in skipped), skipped
    assert "the group's transport is tcp" in proc.stdout + proc.stderr


def test_python_m_ringcomm_bench_help_is_the_scripts_help():
    def help_of(*cmd):
        proc = subprocess.run([sys.executable, *cmd, "--help"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        usage, rest = proc.stdout.split("\n\n", 1)
        return usage, rest

    m_usage, m_rest = help_of("-m", "ringcomm.bench")
    s_usage, s_rest = help_of(SCRIPT)
    assert m_usage.startswith("usage: python -m ringcomm.bench [-h] [-b MINBYTES]")
    assert s_usage.startswith("usage: compare_collectives.py [-h] [-b MINBYTES]")
    assert m_rest == s_rest  # the same flags, defaults and texts
    assert "--model-from JSON [JSON ...]" in m_usage


def test_python_m_ringcomm_bench_on_two_ranks_writes_the_same_json_schema(tmp_path):
    out = str(tmp_path / "out.json")
    cmd = [_which("mpiexec"), "-n", "2", sys.executable, "-m", "ringcomm.bench", "-b", "4K",
           "-e", "16K", "-f", "4", "-n", "3", "-w", "0", "--min-time", "0", "--rounds", "1",
           "-c", "--coll", "allreduce,allgather", "--algos", "auto,ring", "--peers", "mpi",
           "--predict-ranks", "", "--json", out]
    proc = _checked(_run(cmd, 120, None), cmd, True)
    assert "wrong values in total: 0 OK" in proc.stdout
    with open(out) as f:
        doc = json.load(f)
    assert doc["schema"] == SCHEMA and set(doc) == {"schema", "meta", "results", "analysis"}
    assert doc["meta"]["world_size"] == 2 and doc["meta"]["launcher"] == "mpiexec"
    assert [c["name"] for c in doc["meta"]["columns"]] == ["auto", "ring", "mpi"]
    assert {(r["collective"], r["size"]) for r in doc["results"]} == {
        ("allreduce", 4096), ("allreduce", 16384), ("allgather", 4096), ("allgather", 16384)}
    for r in doc["results"]:
        assert_result_schema(r, min_iters=3)
        assert r["status"] == "ok" and r["wrong"] == 0, r
    # a user's run prints no verdicts on the project's own targets (make test-bench does)
    assert set(doc["analysis"]) == {"cost_model", "measured_tuning"}
    assert "speed targets" not in proc.stdout and "MISSED" not in proc.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_fails_naming_what_is_missing():
    # an empty table that exits 0 would read as a run
    cmd = [_which("mpiexec"), "-n", "2", sys.executable, SCRIPT, "--device", "cuda", "-b", "1K",
           "-e", "1K", "--no-model"]
    proc = _run(cmd, 120, None)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    torch = __import__("torch")
    missing = ("built without it" if torch.version.cuda is None
               else "torch.cuda.is_available() is False")
    assert "--device cuda: no column can run here (ring, tree, auto, nccl: no CUDA" in proc.stderr
    assert missing in proc.stderr and "#" not in proc.stdout, proc.stdout


def _targets_file(path, targets):
    path.write_text(json.dumps({"schema": TARGETS_SCHEMA, "targets": targets}))
    return str(path)


def _target(name, **kw):
    t = {"name": name, "collective": "allreduce", "dtype": "float", "redop": "sum",
         "ranks": 2, "min_bytes": 4096, "max_bytes": 4096, "metric": "time_us", "of": ["auto"],
         "versus": None, "bound": "<=", "goal": 1.0}
    t.update(kw)
    return t


def test_floor_native_and_a_targets_file_in_one_run(tmp_path):
    # Targets whose outcome is certain: the floor includes MPI's time (so it is never
    # below it, and its busbw never above); 64 MiB is not measured here.
    tfile = _targets_file(tmp_path / "t.json", [
        _target("floor at least mpi", of=["floor"], versus="mpi", bound=">=", goal=1.0),
        _target("floor busbw at least mpi's", of=["floor"], versus="mpi", metric="busbw",
                bound=">=", goal=1.0),
        _target("not measured here", min_bytes=64 << 20, max_bytes=64 << 20, of=["native"]),
    ])
    out = str(tmp_path / "out.json")
    proc = mpirun(2, SCRIPT, "-b", "4K", "-e", "4K", "-n", "3", "-w", "0", "--min-time", "0",
                  "--rounds", "1", "-c", "--coll", "allreduce", "-d", "float,bf16",
                  "--algos", "auto,native", "--peers", "mpi,floor", "--no-model",
                  "--targets", tfile, "--json", out, timeout=120)
    with open(out) as f:
        doc = json.load(f)
    cell = {(r["dtype"], r["column"]): r for r in doc["results"]}
    # native: ringcomm's own dispatch into MPI's Allreduce, checked like any column
    assert cell[("float", "native")]["status"] == "ok"
    assert cell[("float", "native")]["wrong"] == 0
    # ... which cannot reduce bfloat16: unsupported, with ringcomm's reason, not an error
    nb = cell[("bfloat16", "native")]
    assert nb["status"] == "unsupported" and "bfloat16" in nb["reason"], nb
    assert cell[("bfloat16", "auto")]["status"] == "ok"
    fl = cell[("float", "floor")]
    assert fl["status"] == "ok" and fl["dispatch_us"] > 0
    assert cell[("bfloat16", "floor")]["status"] == "unsupported"
    assert "ERROR" not in proc.stdout and "FAILED" not in proc.stdout
    assert "native: unsupported:" in proc.stdout
    recs = {r["name"]: r for r in doc["analysis"]["targets"]}
    assert list(recs) == ["floor at least mpi", "floor busbw at least mpi's", "not measured here"]
    assert recs["floor at least mpi"]["met"] is True
    assert recs["floor at least mpi"]["ratio"] == pytest.approx(
        fl["time_us"] / cell[("float", "mpi")]["time_us"])
    assert recs["floor busbw at least mpi's"]["met"] is False
    assert recs["not measured here"]["met"] is None
    assert "floor at least mpi (allreduce float sum): floor" in proc.stdout
    assert proc.stdout.count(" MET") == 1 and proc.stdout.count(" MISSED") == 1
    assert "not measured here (allreduce float sum): NOT MEASURED" in proc.stdout


def test_null_backend_registers_once():
    name = columns.register_null_backend()
    assert columns.register_null_backend() == name == columns.NULL_BACKEND


# ---------------------------------------------------------------------------
# speed targets
# ---------------------------------------------------------------------------
def _res(column, size, t_us, choice=None):
    # 2 ranks: allreduce busbw factor 2(n-1)/n = 1
    return {"collective": "allreduce", "dtype": "float", "redop": "sum", "column": column,
            "size": size, "status": "ok", "time_us": t_us, "busbw": size / t_us / 1e3,
            "auto_choice": choice}


def test_the_default_targets_file_ships_with_the_package_and_is_valid():
    # Its values are data (ringcomm/bench/targets.json), not pinned here.
    assert Path(DEFAULT_TARGETS) == Path(bench_targets.__file__).with_name("targets.json")
    assert parse_args([]).targets is None  # a user's run checks none unless asked
    spec = load_targets(DEFAULT_TARGETS)
    assert spec and all(t["metric"] in ("time_us", "busbw") for t in spec)


def test_the_report_checks_the_targets_file_it_is_given(tmp_path, capsys):
    # a goal no run can meet (a 4 KiB allreduce in a picosecond) and one every run meets
    path = _targets_file(tmp_path / "t.json", [
        _target("impossible", goal=1e-6, versus=None),
        _target("trivial", metric="busbw", bound=">=", goal=1e-3)])
    doc = {"meta": {"world_size": 2, "columns": []},
           "results": [_res("auto", 4096, 50.0, "recursive_doubling")]}
    out = analyse([doc], parse_args(["--targets", path, "--no-model"]), print)
    assert [(t["name"], t["met"]) for t in out["targets"]] == [("impossible", False),
                                                               ("trivial", True)]
    text = capsys.readouterr().out
    assert "impossible (allreduce float sum): auto 50.000 us" in text and "MISSED" in text
    assert "(target <= 1e-06 us) MISSED" in text and "(target >= 0.001 GB/s) MET" in text


#: the targets of the next test, as a targets file states them
RATIO_TARGETS = [
    _target("4 KiB latency: auto <= 3x floor", of=["auto"], versus="floor", goal=3.0),
    _target("256 KiB-16 MiB busbw: best >= 0.9x mpi", min_bytes=256 << 10,
            max_bytes=16 << 20, metric="busbw", of=["ring", "tree", "recursive_doubling", "auto"],
            versus="mpi", bound=">=", goal=0.9),
    _target("64 MiB busbw: ring >= 2.3 GB/s", min_bytes=64 << 20, max_bytes=64 << 20,
            metric="busbw", of=["ring"], bound=">=", goal=2.3),
]


def test_speed_targets_are_the_ratios_of_the_targets_file(tmp_path):
    spec = load_targets(_targets_file(tmp_path / "t.json", RATIO_TARGETS))
    MiB = 1 << 20
    res = [_res("auto", 4096, 105, "recursive_doubling"), _res("floor", 4096, 30),
           _res("ring", 4096, 120), _res("mpi", 4096, 10)]
    # 256 KiB .. 16 MiB: MPI at 1 GB/s; ringcomm's best at 0.95x, except 0.8x at 1 MiB
    for size, best in ((256 << 10, 0.95), (MiB, 0.8), (16 * MiB, 0.95)):
        t_mpi = size / 1e3  # us at 1 GB/s
        res += [_res("mpi", size, t_mpi), _res("ring", size, t_mpi / best),
                _res("tree", size, t_mpi / best * 2), _res("auto", size, t_mpi / best * 1.5)]
    res.append(_res("ring", 64 * MiB, 64 * MiB / 2.76e3))  # 2.76 GB/s = 1.2x the goal
    res.append({**_res("ring", 8 * MiB, 1.0), "status": "error", "busbw": None})
    text, recs = check_targets(res, 2, spec)
    got = {r["name"]: r for r in recs}
    lat = got["4 KiB latency: auto <= 3x floor"]
    assert (round(lat["ratio"], 6), lat["met"]) == (3.5, False)        # 105 / 30
    mid = got["256 KiB-16 MiB busbw: best >= 0.9x mpi"]
    assert (round(mid["ratio"], 6), mid["met"], mid["worst_size"]) == (0.8, False, MiB)
    assert [e["best"] for e in mid["sizes"]] == ["ring"] * 3          # the best of four
    assert mid["unmeasured_sizes"] == [8 * MiB]                       # ring failed there
    big = got["64 MiB busbw: ring >= 2.3 GB/s"]
    assert big["value"] == pytest.approx(2.76) and big["met"] is True
    assert big["ratio"] == pytest.approx(1.2)
    assert "= 3.50x (target <= 3x) MISSED" in text
    assert "worst at 1 MiB: ring" in text and "2 of 3 sizes" in text
    assert "ring 2.760 GB/s = 1.20x the goal (target >= 2.3 GB/s) MET" in text
    # other world sizes are reported, with a note
    text4, _ = check_targets(res, 4, spec)
    assert "stated for 2 ranks" in text4


@pytest.mark.parametrize("change,message", [
    ({"metric": "speed"}, "metric must be one of time_us, busbw"),
    ({"bound": "<"}, "bound must be"),
    ({"goal": "3"}, "field 'goal'"),
    ({"of": []}, "'of' must list column names"),
    ({"min_bytes": 10, "max_bytes": 5}, "min_bytes is above max_bytes"),
    ({"goal": 0}, "goal must be positive"),
])
def test_bad_targets_files_are_refused_naming_the_field(tmp_path, change, message, capsys):
    path = _targets_file(tmp_path / "t.json", [_target("x", **change)])
    with pytest.raises(ValueError, match=message):
        load_targets(path)
    with pytest.raises(SystemExit):
        parse_args(["--targets", path])
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------
# flags
# ---------------------------------------------------------------------------
def test_links_pair_ranks_within_each_host_then_each_pair_of_hosts():
    from ringcomm.bench.links import pairs

    assert pairs(["a"]) == []
    assert pairs(["a", "b", "a", "c", "b"]) == [
        (0, 2, "within a"), (1, 4, "within b"),
        (0, 1, "a <-> b"), (0, 3, "a <-> c"), (1, 3, "b <-> c")]


@pytest.mark.parametrize("text,value", [("4", 4), ("64K", 65536), ("1M", 1 << 20),
                                        ("2GiB", 2 << 30), ("0.5K", 512), ("8 kb", 8192)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("argv,message", [
    (["-b", "1M", "-e", "1K"], "-b/--minbytes (1048576) is larger than -e/--maxbytes (1024)"),
    (["-d", "complex"], "unknown data type (-d) 'complex'"),
    (["-o", "xor"], "unknown reduction op (-o) 'xor'"),
    (["--coll", "gather"], "unknown collective 'gather'"),
    (["-b", "lots"], "'lots' is not a size"),
    (["-f", "1"], "-f/--stepfactor must be larger than 1"),
    (["-f", "2", "-i", "4"], "either -f/--stepfactor or -i/--stepbytes"),
    (["-n", "0"], "-n/--iters must be at least 1"),
    (["--algos", "", "--peers", "none"], "nothing to compare"),
    (["--import", "no_such_module_here"], "--import no_such_module_here: ModuleNotFoundError"),
    (["--gap", "-5"], "--gap '-5': the pause must be a finite number of microseconds"),
    (["--gap", "soon"], "--gap 'soon': give microseconds (a number of at least 0), busy:US or "
                        "compute[:N]"),
    (["--gap", "inf"], "--gap 'inf': the pause must be a finite number"),
    (["--gap", "busy:-1"], "--gap 'busy:-1': the pause must be a finite number"),
    (["--gap", "compute:0"], "--gap 'compute:0': compute:N takes a whole N of at least 1"),
    (["--gap", "compute:big"], "--gap 'compute:big': compute:N takes a whole N"),
])
def test_bad_flags_exit_with_a_message_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_message_sizes():
    assert message_sizes(4, 64, 2.0, None) == [4, 8, 16, 32, 64]
    assert message_sizes(4, 70, 4.0, None) == [4, 16, 64]
    assert message_sizes(0, 3, 2.0, None) == [0, 1, 2]
    assert message_sizes(100, 400, None, 100) == [100, 200, 300, 400]
    assert message_sizes(8, 8, 2.0, None) == [8]


def test_shapes_round_to_whole_elements_per_rank():
    s = shape_for("allgather", 4, 4, 2)
    assert (s.size, s.count, s.per_rank) == (8, 2, 1)
    s = shape_for("allreduce", 6, 4, 2)
    assert (s.size, s.count) == (4, 1)
    assert auto_nbytes("allgather", shape_for("allgather", 4096, 4, 4), 4) == 1024
    assert math.isclose(BUSBW_FACTOR["allreduce"](4), 1.5)


def test_bench_copies_times_every_copy_in_both_forms(tmp_path):
    # scripts/bench_copies.py's JSON backs the hot path's comments: every row in both
    # forms, each a positive time (no timing asserted)
    out = tmp_path / "copies.json"
    mpirun(2, str(ROOT / "scripts" / "bench_copies.py"), "--calls", "20", "--rounds", "2",
           "--json", str(out), timeout=180)
    doc = json.loads(out.read_text())
    assert doc["schema"] == "ringcomm.bench_copies/1" and len(doc["rows"]) == 4
    assert all(r["in_code_us"] > 0 and r["other_us"] > 0 for r in doc["rows"])
    committed = json.loads((ROOT / "docs" / "data" / "hot_path_copies.json").read_text())
    assert [r["copy"] for r in committed["rows"]] == [r["copy"] for r in doc["rows"]]


def test_deepspeed_column_and_a_barrier_before_each_call(tmp_path):
    """The deepspeed column (DeepSpeed's shared-memory allreduce) is checked like any
    other where DeepSpeed is installed, and skipped naming why where it is not;
    --barrier-each is recorded in the JSON, and every column still checks right."""
    out = str(tmp_path / "ds.json")
    shm = Path("/dev/shm")
    before = set(shm.glob("deepspeed_allreduce_buffer_*"))
    mpirun(2, SCRIPT, "-b", "4K", "-e", "64K", "-f", "16", "-n", "3", "-w", "1", "--min-time", "0",
           "--rounds", "1", "-c", "--algos", "auto", "--peers", "mpi,deepspeed",
           "--barrier-each", "--no-model", "--json", out, timeout=400)
    # DeepSpeed's op never removes its segments; the run does, once every rank mapped them
    assert set(shm.glob("deepspeed_allreduce_buffer_*")) <= before
    with open(out) as f:
        doc = json.load(f)
    assert doc["meta"]["timing"]["barrier_each"] is True
    rows = [r for r in doc["results"] if r["column"] == "deepspeed"]
    assert len(rows) == 2, rows
    import importlib.util
    if importlib.util.find_spec("deepspeed") is None:
        assert all(r["status"] == "skipped" and "not installed" in r["reason"] for r in rows)
    else:
        assert all(r["status"] == "ok" and r["wrong"] == 0 for r in rows), rows
    others = [r for r in doc["results"] if r["column"] in ("auto", "mpi")]
    assert others and all(r["status"] == "ok" and r["wrong"] == 0 for r in others), others


def test_bench_layers_times_every_layer_of_shm_direct_beside_deepspeed(tmp_path):
    """scripts/bench_layers.py, as the committed layers_shm_direct_* runs were made:
    every layer a positive time, the program row names shm_direct's program, the
    DeepSpeed row is there where DeepSpeed is installed, and the rows are those of
    the committed files that docs/benchmarks.md renders (no timing asserted)."""
    import importlib.util
    out = tmp_path / "layers.json"
    ds = importlib.util.find_spec("deepspeed") is not None
    mpirun(2, str(ROOT / "scripts" / "bench_layers.py"), "--algo", "shm_direct", "--bytes",
           "262144", "--calls", "20", "--rounds", "1", *(["--deepspeed"] if ds else []),
           "--json", str(out), timeout=300)
    doc = json.loads(out.read_text())
    assert doc["schema"] == "ringcomm.bench_layers/1" and doc["algorithm"] == "shm_direct"
    assert all(r["time_us"] > 0 for r in doc["rows"]), doc["rows"]
    names = [r["layer"] for r in doc["rows"]]
    assert any("DirectAllreduce.run" in n for n in names), names
    assert names[-1] == "dist.all_reduce" and doc["peers"][0].startswith("MPI's own Allreduce")
    assert len(doc["peers"]) == (2 if ds else 1), doc["peers"]
    if ds:
        assert any(n.startswith("DeepSpeed's shared-memory allreduce") for n in doc["peers"])
        committed = json.loads((ROOT / "docs" / "data" /
                                "layers_shm_direct_262144B_2ranks.json").read_text())
        assert [r["layer"] for r in committed["rows"]] == names


def test_the_default_peers_are_the_quick_ones_and_deepspeed_is_asked_for_by_name():
    assert parse_args([]).peer_list == ["mpi", "gloo", "floor"]
    assert parse_args(["--peers", "mpi,deepspeed"]).peer_list == ["mpi", "deepspeed"]
    assert parse_args(["--device", "cuda"]).peer_list == ["nccl"]


@pytest.mark.parametrize("text,spec", [
    ("100", {"sleep_us": 100.0}), ("0", {"sleep_us": 0.0}), ("busy:12.5", {"busy_us": 12.5}),
    ("compute", {"matmul": 256}), ("compute:64", {"matmul": 64})])
def test_gap_pauses_as_asked(text, spec):
    import time

    from ringcomm.bench.timing import make_gap
    a = parse_args(["--gap", text])
    assert a.gap == spec
    pause = make_gap(a.gap)
    t0 = time.perf_counter()
    for _ in range(5):
        pause()
    took = time.perf_counter() - t0
    # a sleep or a busy wait lasts at least what was asked (a matmul: whatever it takes)
    assert took >= 5 * (spec.get("sleep_us") or spec.get("busy_us") or 0) * 1e-6
    assert make_gap(None) is None


def test_a_gap_before_each_call_is_recorded_said_and_plotted(tmp_path):
    out, png = str(tmp_path / "gap.json"), str(tmp_path / "gap.png")
    proc = mpirun(2, SCRIPT, "-b", "4K", "-e", "4K", "-n", "5", "-w", "1", "--min-time", "0",
                  "--rounds", "1", "-c", "--algos", "auto", "--peers", "mpi", "--gap", "busy:2000",
                  "--no-model", "--json", out, "--plot", png, timeout=120)
    doc = json.loads(Path(out).read_text())
    assert doc["meta"]["timing"]["gap"] == {"busy_us": 2000.0}
    assert "# before each timed call: an MPI barrier (untimed), then a 2000 us busy wait " \
           "(untimed)" in proc.stdout
    assert all(r["status"] == "ok" and r["wrong"] == 0 for r in doc["results"]), doc["results"]
    # the pause is not timed: no call took as long as the 2 ms it waited before
    # (the MPI library's 4 KiB allreduce takes microseconds on one host)
    mpi = next(r for r in doc["results"] if r["column"] == "mpi")
    assert mpi["time_us"] < 2000, mpi
    assert Path(png).stat().st_size > 0


@pytest.mark.parametrize("run,targets", [
    ("compare_2ranks.json", DEFAULT_TARGETS),
    ("pause_2ranks_gap100.json", str(Path(DEFAULT_TARGETS).with_name("targets_pause.json")))])
def test_the_project_targets_are_checked_on_a_committed_run(run, targets, capsys):
    """What make test-bench prints: every shipped target's verdict on its committed
    2-rank run (a verdict, met or missed, for each; not measured only where the run
    lacks the columns)."""
    from ringcomm.bench.cli import main
    committed = str(ROOT / "docs" / "data" / run)
    assert main(["--model-from", committed, "--targets", targets, "--no-model"]) == 0
    text = capsys.readouterr().out
    for t in load_targets(targets):
        line = next(x for x in text.splitlines() if x.lstrip("# ").startswith(t["name"] + " ("))
        assert line.endswith((" MET", " MISSED", " NOT MEASURED")), line


def test_bench_layers_after_a_pause_times_each_call_alone_beside_torchs_dispatch(tmp_path):
    """scripts/bench_layers.py --gap --dispatch, as the committed layers_pause_* runs
    were made: the gap is recorded, every collective row has its time from the last
    rank's start, torch's dispatch alone (no collective) has none."""
    out = tmp_path / "layers.json"
    mpirun(2, str(ROOT / "scripts" / "bench_layers.py"), "--calls", "20", "--rounds", "1",
           "--dispatch", "--gap", "busy:50", "--json", str(out), timeout=300)
    doc = json.loads(out.read_text())
    assert doc["gap"] == {"busy_us": 50.0}
    rows = {r["layer"]: r for r in doc["rows"]}
    dispatch = next(r for name, r in rows.items() if name.startswith("torch's dispatch alone"))
    assert "from_last_start_us" not in dispatch and dispatch["time_us"] > 0
    others = [r for r in doc["rows"] if r is not dispatch]
    assert others and all(r["time_us"] > 0 and "from_last_start_us" in r for r in others)


def test_bench_barrier_times_every_barrier_in_both_runs(tmp_path):
    """scripts/bench_barrier.py, as the committed barrier_2ranks.json was made: a run
    per --late value, a row per ringcomm algorithm asked for and for MPI and gloo,
    every statistic a number (no timing asserted: the release of a barrier whose
    ranks arrive together is its whole time, so it is positive); the committed file
    has the same rows; a negative --late is refused naming the flag."""
    out = tmp_path / "barrier.json"
    mpirun(2, str(ROOT / "scripts" / "bench_barrier.py"), "--calls", "20", "--rounds", "1",
           "--late", "0,20", "--json", str(out), timeout=300)
    doc = json.loads(out.read_text())
    assert doc["schema"] == "ringcomm.bench_barrier/2" and doc["world_size"] == 2
    assert sorted(doc["runs"]) == ["0", "20"]
    names = ["ringcomm auto", "ringcomm dissemination", "mpi", "gloo"]
    for run in doc["runs"].values():
        assert list(run) == names
        for stats in run.values():
            assert set(stats) == {"exit_skew_us", "release_us", "next_call_us"}
            assert all(s["median"] >= 0 and s["p90"] >= s["median"] for s in stats.values())
            assert stats["release_us"]["median"] > 0
    committed = json.loads((ROOT / "docs" / "data" / "barrier_2ranks.json").read_text())
    assert all(list(run) == names for run in committed["runs"].values())
    bad = _run([sys.executable, str(ROOT / "scripts" / "bench_barrier.py"), "--late", "-5"],
               120, None)
    assert bad.returncode == 2 and "--late" in bad.stderr, bad.stderr


def test_bench_steps_times_every_step_back_to_back_and_after_the_pause(tmp_path):
    """scripts/bench_steps.py, as the committed steps_pause.json was made (fewer calls):
    every step timed both ways, each a positive number (no timing asserted between
    them); the committed file names the same steps; bad sizes and counts are refused
    naming the flag."""
    out = tmp_path / "steps.json"
    script = str(ROOT / "scripts" / "bench_steps.py")
    cmd = [sys.executable, script, "--calls", "20", "--rounds", "1", "--json", str(out)]
    _checked(_run(cmd, 120, None), cmd, True)
    doc = json.loads(out.read_text())
    assert doc["schema"] == "ringcomm.bench_steps/1" and doc["bytes"] == 4096
    assert doc["gap_us"] == 100.0 and doc["calls"] == 20 and doc["rounds"] == 1
    for r in doc["rows"]:
        assert set(r) == {"group", "name", "back_to_back_us", "after_sleep_us"}
        assert r["back_to_back_us"] > 0 and r["after_sleep_us"] > 0, r
    committed = json.loads((ROOT / "docs" / "data" / "steps_pause.json").read_text())
    assert [r["name"] for r in committed["rows"]] == [r["name"] for r in doc["rows"]]
    for flag, value in (("--calls", "0"), ("--bytes", "6"), ("--rounds", "-1")):
        bad = _run([sys.executable, script, flag, value], 120, None)
        assert bad.returncode == 2 and flag in bad.stderr, bad.stderr
