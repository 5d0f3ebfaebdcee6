"""One test of torch's own distributed suite, run on ringcomm at world size 3 in
the processes the suite spawns: ``test_all_to_all_single_unequal_split``, a gate
opened for ringcomm (about 9 s). The whole suite (collectives, subgroups,
send/recv, DDP on CPU) is ``make conformance``, with its results in
docs/conformance.md; what it covers, our own tests check against gloo in
``make test`` (test_backend: every collective; test_ddp: torch's DDP on ringcomm),
so this one runs in ``make test-wide``."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import conformance  # noqa: E402

#: torch's tests CI runs: one, a gate opened for ringcomm (each spawns its own 3
#: processes, about 9 s). The whole suite is ``make conformance``; what the others
#: cover, our own tests check against gloo (test_backend: every collective;
#: test_ddp: torch's DDP on ringcomm)
CI_TESTS = [
    "test_all_to_all_single_unequal_split",
]


@pytest.mark.wide  # what it covers, test_backend and test_ddp check against gloo
def test_torch_suite_part_passes(tmp_path):
    xml = tmp_path / "suite.xml"
    env = dict(os.environ, OMP_NUM_THREADS="1", BACKEND="ringcomm", WORLD_SIZE="3",
               TEMP_DIR=str(tmp_path / "temp"))
    for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    (tmp_path / "temp").mkdir()
    ids = [f"{conformance.SUITE}::TestDistBackendWithSpawn::{name}" for name in CI_TESTS]
    proc = subprocess.run([sys.executable, "-m", "pytest", *ids, "-q", "-p", "no:cacheprovider",
                           "--timeout=240", f"--junitxml={xml}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    tests = {t["name"]: t for t in conformance.parse(xml)} if xml.exists() else {}
    outcome = {n: tests[n]["outcome"] if n in tests else "not run" for n in CI_TESTS}
    assert all(o == "passed" for o in outcome.values()), (
        f"{outcome}\n{proc.stdout[-5000:]}\n{proc.stderr[-3000:]}")
