"""scripts/gpu_check.py where there is no GPU: its decisions and its report."""
from __future__ import annotations

import json
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
    proc = _fake(tmp_path, "--stages", "versions,allreduce,device_id",
                 "--hang-stage", "allreduce", "--scale", "0.3")
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
