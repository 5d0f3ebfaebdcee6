"""The example training script trains and keeps replicas identical, under both launchers."""
from __future__ import annotations

import pytest

from conftest import mpirun, torchrun


@pytest.mark.compat
@pytest.mark.parametrize("launch", [torchrun], ids=["torchrun"])  # mpiexec: the loss curves
def test_train_example(launch):
    out = launch(2, "examples/train.py", "--epochs", "2", "--steps", "3", timeout=120).stdout
    assert "replicas identical" in out, out
    losses = [float(line.split("loss ")[1].split()[0]) for line in out.splitlines()
              if line.startswith("epoch")]
    assert len(losses) == 2 and losses[1] < losses[0], out


#: torch 2.13's gloo, as the default group under mpiexec, aborts about one exit in
#: five after destroy_process_group (seen without ringcomm imported too: a C++ thread
#: destroyed while joinable); the run's output is complete by then
TORCH_GLOO_EXIT_ABORT = "terminate called without an active exception"


def _losses(out: str) -> list[float]:
    return [float(line.split("loss ")[1].split()[0]) for line in out.splitlines()
            if line.startswith("epoch")]


@pytest.mark.wide  # 10 s; test_ddp checks each DDP against torch's in make test
def test_loss_curves_agree_across_ddps_and_backends(tmp_path):
    """Our DDP on ringcomm and torch's DDP on gloo (the two ends: neither the DDP nor
    the backend in common; test_ddp crosses them): the same model, data and seeds
    give the same loss curve; the traced run writes one Chrome trace per rank."""
    runs = {}
    for impl, backend in (("ours", "ringcomm"), ("torch", "gloo")):
        extra = ["--trace", str(tmp_path / "t.json")] if impl == "ours" else []
        proc = mpirun(2, "examples/train.py", "--epochs", "3", "--steps", "4", "--ddp", impl,
                      "--backend", backend, *extra, timeout=120, check=backend != "gloo")
        out = proc.stdout
        if proc.returncode:  # only the gloo oracle may end so, and only after its work
            assert TORCH_GLOO_EXIT_ABORT in proc.stderr + out, out + proc.stderr
        assert "replicas identical" in out, out
        runs[impl, backend] = _losses(out)
    ref = runs["torch", "gloo"]
    assert len(ref) == 3 and ref[2] < ref[0]
    for key, curve in runs.items():
        assert curve == pytest.approx(ref, rel=1e-4), (key, curve, ref)
    files = sorted(p.name for p in tmp_path.glob("t.rank*.json"))
    assert files == ["t.rank0.json", "t.rank1.json"]
