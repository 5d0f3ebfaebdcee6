"""Numbers in the README come from the committed benchmark JSON, never by hand."""
from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_readme_benchmark_block_matches_committed_json():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "doc_numbers.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_stale_readme_is_detected(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- bench:begin -->\n| 4 KiB | 1 us |\n<!-- bench:end -->\n")
    cmd = [sys.executable, str(ROOT / "scripts" / "doc_numbers.py"), "--readme", str(readme)]
    assert subprocess.run(cmd + ["--check"], capture_output=True, timeout=60).returncode == 1
    assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    text = readme.read_text()
    assert "4 KiB time per call" in text and "| 4 KiB | 1 us |" not in text
    assert subprocess.run(cmd + ["--check"], capture_output=True, timeout=60).returncode == 0
