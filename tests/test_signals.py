"""Ctrl-C on the launcher ends every rank, even ranks stuck in a collective."""
from __future__ import annotations

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import reliability_report  # noqa: E402


@pytest.mark.parametrize("launcher", ["mpiexec",
                                      pytest.param("torchrun", marks=pytest.mark.wide)])
def test_sigint_to_the_launcher_ends_every_rank_within_10s(launcher):
    took, left = reliability_report.sigint_exit_seconds(launcher, limit=10.0)
    assert took < 10, f"{launcher} still running 10 s after SIGINT"
    assert not left, f"ranks left running after {launcher} exited: {left}"
