"""scripts/gpu_check.py where there is no GPU: its decisions and its report."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402


@pytest.mark.parametrize("version, key", [("2.30.3", "NCCL_MULTI_RANK_GPU_ENABLE"),
                                          ("2.32.3", "NCCL_MULTI_RANK_GPU_ENABLE"),
                                          ("2.30.2", "RINGCOMM_NCCL_HOSTID_PER_RANK"),
                                          ("2.21.5", "RINGCOMM_NCCL_HOSTID_PER_RANK"),
                                          (None, "RINGCOMM_NCCL_HOSTID_PER_RANK")])
def test_two_ranks_share_a_gpu_the_way_the_nccl_version_allows(version, key):
    how, env = gpu_check.sharing(version)
    assert key in env and env["NCCL_SOCKET_IFNAME"] == "lo"
    assert ("NCCL_MULTI_RANK_GPU_ENABLE=1" in how) == (key == "NCCL_MULTI_RANK_GPU_ENABLE")


def test_report_lists_versions_stages_failures_and_the_table():
    r = {"started": "now", "passed": False, "fake": False, "two_ranks_on_one_gpu": "shared",
         "versions": {"gpus": ["H200"], "torch": "2.11", "torch_cuda": "13.0",
                      "nccl_torch": "2.27.3", "cupy": "14.2.0", "nccl_cupy": "2.32.3",
                      "python": "3.12"},
         "stages": [{"name": "allreduce", "proves": "p", "status": "passed", "checks": 28,
                     "seconds": 3.0, "deadline_s": 30},
                    {"name": "collectives", "proves": "q", "status": "failed", "checks": 480,
                     "failures": ["rank 1: allreduce[ring] differs"], "seconds": 9.0,
                     "deadline_s": 55, "nccl_warnings": ["x NCCL WARN Duplicate GPU"],
                     "log_tail": "the end of it"},
                    {"name": "bench", "proves": "b", "status": "passed", "seconds": 1,
                     "deadline_s": 42, "markdown": "| size | ring |\n|---|---|"}]}
    text = gpu_check.report(r)
    assert "**FAILED**" in text and "H200" in text and "CuPy 14.2.0 (NCCL 2.32.3)" in text
    assert "| collectives | q | failed: 1 failures | 480 | 9 s of 55 |" in text
    assert "allreduce[ring] differs" in text and "NCCL WARN Duplicate GPU" in text
    assert "the end of it" in text and "| size | ring |" in text


def _fake(tmp_path, *extra, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--fake",
                           "--out", str(tmp_path / "gpu.md"), "--data", str(tmp_path), *extra],
                          capture_output=True, text=True, timeout=timeout)


def _no_workers_left() -> bool:
    return not any("gpu_check" in cmd and "--worker" in cmd
                   for cmd in map(_cmd, Path("/proc").iterdir()) if cmd)


def _cmd(entry: Path) -> str:
    """A process's command line ("" for what is not a process, or is gone)."""
    try:
        return (entry / "cmdline").read_bytes().decode(errors="replace") \
            if entry.name.isdigit() else ""
    except OSError:
        return ""


@pytest.mark.gpucheck
def test_the_driver_runs_every_stage_in_order_and_reports_from_its_json(tmp_path):
    proc = _fake(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [st["name"] for st in doc["stages"]] == [name for name, _, _ in gpu_check.STAGES]
    status = {st["name"]: st["status"] for st in doc["stages"]}
    assert status.pop("streams") == "skipped"  # needs CUDA streams
    assert set(status.values()) == {"passed"}, status
    by = {st["name"]: st for st in doc["stages"]}
    assert by["collectives"]["checks"] > 1000 and by["allreduce"]["checks"] > 10
    assert "| 1 KiB |" in by["bench"]["markdown"]
    assert (tmp_path / "gpu.md").read_text() == gpu_check.report(doc)


@pytest.mark.gpucheck
def test_a_stage_past_its_deadline_is_ended_and_the_others_still_run(tmp_path):
    # deadlines halved: the hung stage ends in 15 s, device_id has 10 s (it takes about
    # 4.5 s here, 8 s on a loaded machine)
    proc = _fake(tmp_path, "--stages", "versions,allreduce,device_id",
                 "--hang-stage", "allreduce", "--scale", "0.5")
    assert proc.returncode == 1
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    status = [(st["name"], st["status"]) for st in doc["stages"]]
    assert status == [("versions", "passed"), ("allreduce", "timed out"),
                      ("device_id", "passed")], status
    assert _no_workers_left()
    assert "timed out" in (tmp_path / "gpu.md").read_text()


@pytest.mark.gpucheck
def test_the_outer_timeout_still_leaves_the_results_so_far(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--fake", "--out",
           str(tmp_path / "gpu.md"), "--data", str(tmp_path), "--stages", "versions,allreduce",
           "--hang-stage", "allreduce"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    js = tmp_path / "gpu_check.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (js.exists() and "versions" in js.read_text()):
        time.sleep(0.5)
    time.sleep(3)  # the hanging stage's workers are up
    proc.send_signal(signal.SIGTERM)  # what `timeout 240` in gpu_check.sh sends
    assert proc.wait(60) == 124
    doc = json.loads(js.read_text())
    assert [st["status"] for st in doc["stages"]] == ["passed", "timed out"]
    assert _no_workers_left()


def test_without_a_gpu_it_says_so_and_fails(tmp_path):
    out = tmp_path / "gpu.md"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out",
                           str(out), "--data", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    if "cannot run" not in proc.stdout:
        pytest.skip("this machine has a GPU with CuPy: the check itself ran")
    assert proc.returncode == 1
    assert "FAILED" in out.read_text()


# -- what a hang leaves, and --outdir (a lent machine returns one folder) -------------

def _env_unset(*names: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in names}


def _docs_written() -> dict[str, int]:
    """The mtimes of what the check writes in docs/ without --outdir."""
    return {str(p): p.stat().st_mtime_ns for p in
            [ROOT / "docs" / "gpu-results.md", *(ROOT / "docs" / "data").glob("gpu_check*")]
            if p.exists()}


def _commands(stdout: str) -> list[list[str]]:
    """The command lines the driver ran (it prints each as ``$ ...``)."""
    return [line[2:].split() for line in stdout.splitlines() if line.startswith("$ ")]


@pytest.fixture(scope="module")
def outdir_run(tmp_path_factory):
    """One passing run of two stages into --outdir, NCCL_LAUNCH_ORDER_IMPLICIT unset."""
    out = tmp_path_factory.mktemp("outdir")
    before = _docs_written()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--fake",
                           "--outdir", str(out), "--stages", "allreduce,bench"],
                          capture_output=True, text=True, timeout=180,
                          env=_env_unset("NCCL_LAUNCH_ORDER_IMPLICIT"))
    assert proc.returncode == 0, proc.stdout[-3000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    return out, proc, doc, before


@pytest.mark.gpucheck
def test_outdir_holds_the_json_the_report_and_each_stages_whole_log(outdir_run):
    out, proc, doc, before = outdir_run
    assert [st["name"] for st in doc["stages"]] == ["allreduce", "bench"]
    assert {"gpu_check.json", "gpu-results.md", "allreduce.log", "bench.log",
            "gpu_check_allreduce.json", "gpu_check_bench.json"} <= {p.name for p in out.iterdir()}
    assert (out / "gpu-results.md").read_text() == gpu_check.report(doc)
    log = (out / "allreduce.log").read_text()
    # the whole output: from the command line to the workers' last words
    assert log.startswith("$ ") and "--stage allreduce" in log.splitlines()[0]
    assert "rank 0: allreduce:" in log and "rank 1: allreduce:" in log
    assert _docs_written() == before  # nothing written in docs/


@pytest.mark.gpucheck
def test_each_rank_names_every_case_before_it_runs_it(outdir_run):
    out, _, doc, _ = outdir_run
    log = (out / "allreduce.log").read_text()
    for rank in (0, 1):
        assert f"rank {rank}: case allreduce[ring] n=1024\n" in log
        assert f"rank {rank}: case allreduce[tree] n=262144\n" in log
    assert "rank 0: case allreduce[" in doc["stages"][0]["log_tail"]


@pytest.mark.gpucheck
def test_the_workers_groups_time_out_before_the_stage_does(outdir_run):
    out, proc, doc, _ = outdir_run
    by = {st["name"]: st for st in doc["stages"]}
    ran = {("bench" if "--bench" in cmd else cmd[cmd.index("--stage") + 1]): cmd
           for cmd in _commands(proc.stdout)}
    assert set(ran) == {"allreduce", "bench"}
    for name, cmd in ran.items():
        assert "--timeout" in cmd, f"{name}: {cmd}"
        timeout = float(cmd[cmd.index("--timeout") + 1])
        assert 3.0 <= timeout < by[name]["limit_s"] <= by[name]["deadline_s"], (name, timeout)
    # and ringcomm's group has it, not torch's 30 minutes
    timeout = float(ran["allreduce"][ran["allreduce"].index("--timeout") + 1])
    assert f"rank 1: group timeout {timeout:g} s" in (out / "allreduce.log").read_text()


@pytest.mark.gpucheck
def test_the_launch_order_setting_is_recorded_and_the_bench_says_it_is_no_speed(outdir_run):
    out, _, doc, _ = outdir_run
    assert doc["settings"]["NCCL_LAUNCH_ORDER_IMPLICIT"] == "1"
    assert "default" in doc["settings"]["NCCL_LAUNCH_ORDER_IMPLICIT_from"]
    bench = next(st for st in doc["stages"] if st["name"] == "bench")
    assert any("not a speed figure" in n for n in bench["notes"]), bench.get("notes")
    report = (out / "gpu-results.md").read_text()
    assert "NCCL_LAUNCH_ORDER_IMPLICIT=1" in report and "not a speed figure" in report


@pytest.mark.gpucheck
def test_a_hung_stage_leaves_every_ranks_stacks_in_its_log(tmp_path):
    # 15 s: the workers (torchrun, torch's import) are up well before the deadline
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--fake",
                           "--outdir", str(tmp_path), "--stages", "allreduce",
                           "--hang-stage", "allreduce", "--scale", "0.5"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    (stage,) = doc["stages"]
    assert stage["status"] == "timed out" and stage["exit_status"] == 124
    tail = stage["log_tail"]
    # faulthandler's own dump a little before the deadline ("Timeout (...)!"), and the
    # one on the driver's SIGUSR1 at it (from the signal handler: "Current thread")
    assert "Timeout (" in tail and "Current thread 0x" in tail, tail
    # the ranks stopped in the worker (the --hang sleep), in the stage's whole log (the
    # JSON keeps its end). Both ranks dump at the same moment into one pipe, so their
    # lines can interleave mid-line: four dumps leave at least two whole frames.
    log = (tmp_path / "allreduce.log").read_text()
    assert log.count("in worker") >= 2, log[-6000:]
    assert "in worker" in tail, tail
    assert "in worker" in (tmp_path / "gpu-results.md").read_text()
    assert _no_workers_left()


def test_the_group_timeout_is_below_every_stage_limit():
    for limit in (1.0, 4.0, 5.0, 9.0, 20.0, 55.0, 225.0):
        t = gpu_check.group_timeout(limit)
        # below the limit always; 70% of it, but a few seconds where the limit allows
        assert min(3.0, 0.9 * limit) - 0.05 <= t < limit, (limit, t)
        assert t <= max(0.7 * limit, 3.0) + 0.05, (limit, t)


def test_the_launch_order_default_is_set_only_where_unset():
    env, settings = gpu_check.stage_env({"PATH": "/bin"}, "m")
    assert env["NCCL_LAUNCH_ORDER_IMPLICIT"] == "1" == settings["NCCL_LAUNCH_ORDER_IMPLICIT"]
    assert env[gpu_check.MARK] == "m" and env["NCCL_DEBUG"] == "WARN"
    env, settings = gpu_check.stage_env({"NCCL_LAUNCH_ORDER_IMPLICIT": "0"}, "m")
    assert env["NCCL_LAUNCH_ORDER_IMPLICIT"] == "0" == settings["NCCL_LAUNCH_ORDER_IMPLICIT"]
    assert settings["NCCL_LAUNCH_ORDER_IMPLICIT_from"] == "the caller's environment"


def test_the_bench_says_when_its_busbw_is_no_speed_figure():
    assert "not a speed figure" in gpu_check.bench_notes(True, None)[0]
    (one,) = gpu_check.bench_notes(False, ["H100"])
    assert "2 ranks on 1 GPU" in one and "take turns" in one and "not a speed figure" in one
    assert gpu_check.bench_notes(False, ["H100", "H100"]) == []
    assert "not a speed figure" in gpu_check.bench_notes(False, None)[0]


def test_check_collectives_cases_are_named_once_per_collective_and_algorithm(capsys,
                                                                            monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    calls = []

    class Group:
        lanes = "the lanes"

        def set_algorithm(self, coll, name):
            calls.append((coll, name))

    named = gpu_check.Named(Group(), "2 channels: ")
    for coll, name in [("allreduce", "ring")] * 3 + [("allreduce", "auto"), ("barrier", "tree")]:
        named.set_algorithm(coll, name)  # what check_collectives' run() does: a start,
        named.set_algorithm(coll, "auto")  # and the reset after the call
    assert named.lanes == "the lanes" and len(calls) == 10
    assert capsys.readouterr().out.splitlines() == [
        "rank 0: case 2 channels: allreduce[ring]", "rank 0: case 2 channels: allreduce[auto]",
        "rank 0: case 2 channels: barrier[tree]"]


def test_outdir_replaces_out_and_data(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--outdir", str(tmp_path),
                                      "--out", str(tmp_path / "x.md")])
    with pytest.raises(SystemExit) as e:
        gpu_check.main()
    assert e.value.code == 2 and "--outdir" in capsys.readouterr().err


def test_a_stage_that_stopped_records_the_case_each_rank_started_last():
    text = ("rank 0: case allreduce[ring] n=1024\nrank 1: case allreduce[ring] n=1024\n"
            "rank 1: case allreduce[tree] n=1024\nThread 0x1 (most recent call first):\n")
    assert gpu_check.last_cases(text) == {"0": "allreduce[ring] n=1024",
                                          "1": "allreduce[tree] n=1024"}
    r = {"started": "now", "passed": False, "versions": {},
         "stages": [{"name": "allreduce", "status": "timed out", "log_tail": text,
                     "last_cases": gpu_check.last_cases(text)}]}
    assert "rank 0: allreduce[ring] n=1024; rank 1: allreduce[tree] n=1024" \
        in gpu_check.report(r)
