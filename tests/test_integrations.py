"""The recipes of docs/integrations.md, run: DCP and FSDP2 with torch alone (`make
test-parallel`), PyTorch Lightning, HF Accelerate, the transformers Trainer and
DeepSpeed's ZeRO (`make test-frameworks`)."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_checks, mpirun, need, torchrun


@pytest.mark.parallel  # make test-parallel, with the other parallel styles
@pytest.mark.parametrize("launch", [mpirun, torchrun], ids=["mpiexec", "torchrun"])
def test_dcp_and_fsdp2(launch, tmp_path):
    out = launch(2, "integrations_check.py", "torch", str(tmp_path), timeout=240).stdout
    assert_checks(out, f"integrations_check torch {launch.__name__} n=2", 2)


@pytest.mark.frameworks  # make test-frameworks
@pytest.mark.parametrize("framework", ["lightning", "accelerate", "transformers"])
def test_framework(framework, tmp_path):
    need(framework)
    out = torchrun(2, "integrations_check.py", framework, str(tmp_path), timeout=300).stdout
    assert_checks(out, f"integrations_check {framework} torchrun n=2", 2)


# -- DeepSpeed ZeRO: each launcher's ringcomm run against a gloo run of as many ranks ----
def _deepspeed_launcher(n: int, program: str, *args: str, timeout: float):
    """DeepSpeed's own launcher (``deepspeed --num_gpus N``) on this host."""
    import socket
    import sys

    from conftest import RANKS, _checked, _run

    for _ in range(3):
        # a port free now may be taken before rank 0 binds it: then another one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", f"--num_gpus={n}",
               f"--master_port={port}", str(RANKS / program), *args]
        proc = _run(cmd, timeout, None)
        if proc.returncode == 0 or "Address already in use" not in proc.stderr + proc.stdout:
            break
    return _checked(proc, cmd, True)


_DEEPSPEED_LAUNCHERS = {"torchrun": torchrun, "mpiexec": mpirun,
                        "deepspeed": _deepspeed_launcher}


@pytest.fixture(scope="module")
def gloo_zero(tmp_path_factory):
    """DeepSpeed's run of every ZeRO configuration on gloo (torchrun), per rank count."""
    runs: dict[int, list[dict]] = {}

    def of(n: int) -> list[dict]:
        if n not in runs:
            d = tmp_path_factory.mktemp(f"gloo{n}")
            out = torchrun(n, "deepspeed_check.py", "gloo", str(d), timeout=400).stdout
            assert_checks(out, f"deepspeed_check gloo torchrun n={n}", n)
            runs[n] = [json.loads((d / f"gloo-rank{r}.json").read_text()) for r in range(n)]
        return runs[n]
    return of


@pytest.mark.frameworks  # make test-frameworks
@pytest.mark.parametrize("launcher,n", [("torchrun", 2), ("deepspeed", 2), ("mpiexec", 3)])
def test_deepspeed_zero(launcher, n, tmp_path, gloo_zero):
    """ZeRO 1-3, offloaded, accumulated and in bf16 (tests/ranks/deepspeed_check.py):
    every rank's losses and final parameters on ringcomm equal gloo's. At 2 ranks
    bit for bit; at 3 the two backends add the ranks' gradients in another order, so
    fp32 agrees to rounding and bf16 to a few of its (much larger) rounding steps."""
    need("deepspeed")
    want = gloo_zero(n)
    out = _DEEPSPEED_LAUNCHERS[launcher](n, "deepspeed_check.py", "ringcomm", str(tmp_path),
                                         timeout=400).stdout
    assert_checks(out, f"deepspeed_check ringcomm {launcher} n={n}", n)
    for r in range(n):
        got = json.loads((tmp_path / f"ringcomm-rank{r}.json").read_text())
        assert sorted(got) == sorted(want[r])
        for name, run in got.items():
            ref = want[r][name]
            if n == 2:
                assert run == ref, f"rank {r}, {name}: differs from gloo"
                continue
            atol = 1e-3 if "bf16" in name else 1e-6
            for a, b in zip([run["losses"], *run["params"]], [ref["losses"], *ref["params"]]):
                assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=atol), \
                    f"rank {r}, {name}: differs from gloo beyond rounding"
