"""Ray Train's TorchTrainer on ringcomm against the same run on gloo (`make test-ray`:
the "ray" extra, about 400 MB, is not in make install's environment by default)."""
from __future__ import annotations

import pytest

from conftest import RANKS, _checked, _run, assert_checks, need

pytestmark = pytest.mark.ray


def test_torch_trainer_on_ringcomm_equals_gloo(tmp_path):
    need("ray", "make test-ray installs the ray extra")
    import shutil
    import sys
    import tempfile

    # Ray's sockets live under RAY_TMPDIR, and a socket's path has at most 107 bytes:
    # pytest's tmp_path is too deep for it
    ray_tmp = tempfile.mkdtemp(prefix="rc-ray-", dir="/tmp")
    try:
        cmd = [sys.executable, str(RANKS / "ray_train_check.py"), str(tmp_path)]
        env = {"RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0"}
        out = _checked(_run(cmd, 400, env), cmd, True).stdout
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert_checks(out, "ray_train_check n=1", 1)
