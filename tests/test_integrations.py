"""The recipes of docs/integrations.md, run: DCP and FSDP2 with torch alone (`make
test-parallel`), PyTorch Lightning, HF Accelerate and the transformers Trainer
(`make test-frameworks`)."""
from __future__ import annotations

import importlib.util
import os

import pytest

from conftest import assert_checks, mpirun, torchrun


@pytest.mark.parallel  # make test-parallel, with the other parallel styles
@pytest.mark.parametrize("launch", [mpirun, torchrun], ids=["mpiexec", "torchrun"])
def test_dcp_and_fsdp2(launch, tmp_path):
    out = launch(2, "integrations_check.py", "torch", str(tmp_path), timeout=240).stdout
    assert_checks(out, f"integrations_check torch {launch.__name__} n=2", 2)


@pytest.mark.frameworks  # make test-frameworks
@pytest.mark.parametrize("framework", ["lightning", "accelerate", "transformers"])
def test_framework(framework, tmp_path):
    if importlib.util.find_spec(framework) is None:
        # `make install` brings them (the "frameworks" extra): in CI a missing one is
        # a broken install, not a reason to run nothing
        if os.environ.get("CI"):
            pytest.fail(f"{framework} is not installed (pip install -e '.[frameworks]')")
        pytest.skip(f"{framework} is not installed")
    out = torchrun(2, "integrations_check.py", framework, str(tmp_path), timeout=300).stdout
    assert_checks(out, f"integrations_check {framework} torchrun n=2", 2)
