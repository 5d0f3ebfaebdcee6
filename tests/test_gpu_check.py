"""scripts/gpu_check.py where there is no GPU: its decisions and its report."""
from __future__ import annotations

import subprocess
import sys
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


def test_report_lists_versions_failures_and_the_table():
    r = {"started": "now", "passed": False, "two_ranks_on_one_gpu": "shared",
         "versions": {"gpus": ["H200"], "torch": "2.11", "torch_cuda": "13.0",
                      "nccl_torch": "2.27.3", "cupy": "14.2.0", "nccl_cupy": "2.32.3",
                      "python": "3.12"},
         "worlds": {"1": {"checks": 500, "failures": [], "ddp": ["ringcomm ddp: ok"]},
                    "2": {"checks": 480, "failures": ["rank 1: allreduce[ring] differs"],
                          "ddp": []}},
         "bench": {"exit_status": 0, "markdown": "| size | ring |\n|---|---|"}}
    text = gpu_check.report(r, ["$ torchrun ...", "output"])
    assert "**FAILED**" in text and "H200" in text and "CuPy 14.2.0 (NCCL 2.32.3)" in text
    assert "| 2 | 480 | 1 |" in text and "allreduce[ring] differs" in text
    assert "| size | ring |" in text


def test_without_a_gpu_it_says_so_and_fails(tmp_path):
    out = tmp_path / "gpu.md"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out",
                           str(out)], capture_output=True, text=True, timeout=120)
    if "cannot run" not in proc.stdout:
        pytest.skip("this machine has a GPU with CuPy: the check itself ran")
    assert proc.returncode == 1
    assert "FAILED" in out.read_text()
