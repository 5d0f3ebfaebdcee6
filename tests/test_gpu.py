"""The CUDA path on a real GPU (skipped where there is none; CI has none).

scripts/gpu_check.sh is the full check for a machine with a GPU. Here: one rank
(the CUDA streams and the process group's checks; at one rank every schedule is
empty, so no NCCL message moves), then two ranks through gpu_check's first
stages, where every algorithm sends and receives over real NCCL."""
from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ringcomm.front.process_group import ProcessGroupRingcomm
from ringcomm.testing import check_collectives
from ringcomm.transport import nccl


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        nccl.load()
    except nccl.NcclUnavailable as e:
        return str(e)
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


@pytest.fixture
def pg():
    group = ProcessGroupRingcomm(0, 1, None, timedelta(seconds=60), store=dist.HashStore(),
                                 cpu_error="not needed here")
    yield group
    group.shutdown()


def test_every_collective_on_cuda_tensors_matches_the_oracle(pg):
    assert check_collectives(pg, "cuda") > 200


def test_work_orders_the_callers_stream_and_the_future_holds_the_output(pg):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.full((1 << 20,), 3.0, device="cuda")
        work = pg.allreduce([t])
        work.wait()  # the side stream now runs after the collective
        t.mul_(2)
    side.synchronize()
    assert torch.equal(t, torch.full_like(t, 6.0))
    out = work.get_future().wait()
    assert out[0] is t


def test_cuda_tensors_must_be_contiguous(pg):
    with pytest.raises(ValueError, match="not contiguous"):
        pg.allreduce([torch.ones(4, 4, device="cuda").t()])


def test_two_ranks_exchange_real_nccl_messages(tmp_path):
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "scripts" / "gpu_check.py"), "--stages",
                           "versions,allreduce,collectives", "--out", str(tmp_path / "gpu.md"),
                           "--data", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (tmp_path / "gpu.md").read_text()
