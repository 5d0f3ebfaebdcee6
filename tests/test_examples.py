"""The example training script trains and keeps replicas identical, under both launchers."""
from __future__ import annotations

import pytest

from conftest import mpirun, torchrun


@pytest.mark.parametrize("launch", [mpirun, torchrun], ids=["mpiexec", "torchrun"])
def test_train_example(launch):
    out = launch(2, "examples/train.py", "--epochs", "2", "--steps", "3", timeout=120).stdout
    assert "replicas identical" in out, out
    losses = [float(line.split("loss ")[1].split()[0]) for line in out.splitlines()
              if line.startswith("epoch")]
    assert len(losses) == 2 and losses[1] < losses[0], out
