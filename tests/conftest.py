"""Launch helpers: run a per-rank program under mpiexec or torchrun, bounded by a timeout.

Per-rank programs live in tests/ranks/; each exits non-zero and prints what
failed when any check fails. One launch checks many cases, since starting a
process with torch costs about two seconds.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RANKS = ROOT / "tests" / "ranks"
BIN = Path(sys.executable).parent


def _env(extra: dict | None) -> dict:
    env = dict(os.environ)
    # A launch inherits nothing of a rendezvous from the test process.
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    env["OMP_NUM_THREADS"] = "1"  # ranks share two cores
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def _descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (from /proc's parent ids)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _run(cmd: list[str], timeout: float, env: dict | None) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own; past ``timeout``, it and every process below it
    (torchrun starts each rank in a session of its own) are killed, and the test fails
    with their output."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process escaped: its pipes stay open
            proc.stdout.close()
            proc.stderr.close()
            out, err = "", "(the output could not be read: a process outlived the kill)"
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n--- stdout\n{out[-4000:]}"
                    f"\n--- stderr\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _which(name: str) -> str:
    exe = BIN / name
    if exe.exists():
        return str(exe)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found (install the project with `make install`)")
    return found


def mpirun(n: int, program: str, *args: str, timeout: float = 120, env: dict | None = None,
           check: bool = True) -> subprocess.CompletedProcess:
    """Run tests/ranks/``program`` (or a path) on ``n`` ranks under mpiexec."""
    path = program if os.path.sep in program else str(RANKS / program)
    cmd = [_which("mpiexec"), "-n", str(n), sys.executable, path, *args]
    return _checked(_run(cmd, timeout, env), cmd, check)


def torchrun(n: int, program: str, *args: str, timeout: float = 120, env: dict | None = None,
             check: bool = True, launcher_args: list[str] = ()) -> subprocess.CompletedProcess:
    """Run tests/ranks/``program`` (or a path) on ``n`` ranks under torchrun (with
    ``launcher_args`` for torchrun itself)."""
    path = program if os.path.sep in program else str(RANKS / program)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", *launcher_args, path, *args]
    return _checked(_run(cmd, timeout, env), cmd, check)


def _checked(proc: subprocess.CompletedProcess, cmd: list[str], check: bool):
    if check and proc.returncode != 0:
        pytest.fail(f"exit code {proc.returncode}: {' '.join(cmd)}\n--- stdout\n"
                    f"{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


LAUNCHERS = {"mpiexec": mpirun, "torchrun": torchrun}


def need(module: str, install: str = "pip install -e '.[frameworks]'",
         installed_here: bool = True) -> None:
    """Skip where ``module`` is missing; but where the make target installs it
    (``installed_here``: the extra's markers admit this machine), a missing one in CI
    is a broken install, not a reason to run nothing."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        if os.environ.get("CI") and installed_here:
            pytest.fail(f"{module} is not installed ({install})")
        pytest.skip(f"{module} is not installed ({install})")


# -- how many checks each per-rank program ran ------------------------------------------
# A program that stops early, or a loop that silently runs nothing, still exits 0;
# so every launch compares each rank's "N checks passed" with the count recorded in
# tests/expected_checks.json. After adding or removing checks, re-record with
#   RINGCOMM_RECORD_CHECKS=1 make test
EXPECTED_CHECKS = ROOT / "tests" / "expected_checks.json"
#: the torch (major.minor) whose counts are the plain keys: the default install's
RECORDED_TORCH = "2.13"


def shm_segments() -> set[str]:
    """ringcomm's shared-memory segments in /dev/shm now (a test compares the set
    before and after a job: nothing may be left)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith("ringcomm-")}


def checks_passed(out: str, n: int) -> list[int]:
    """Each rank's count of passed checks, in rank order; fails unless all ``n`` ranks
    reported."""
    import re

    found = {int(r): int(k) for r, k in re.findall(r"rank (\d+): (\d+) checks passed", out)}
    if sorted(found) != list(range(n)):
        pytest.fail(f"expected 'checks passed' from ranks 0..{n - 1}, got ranks "
                    f"{sorted(found)}\n{out[-3000:]}")
    return [found[r] for r in range(n)]


def covered_pairs(where: Path, n: int) -> list[set[str]]:
    """Each rank's ``collective[algorithm]`` pairs that passed checks named them, as
    the per-rank programs' Checker wrote them into ``where`` (``CHECKS_COVERED_DIR``)."""
    import json

    files = sorted(p.name for p in where.glob("rank*.json"))
    if files != sorted(f"rank{r}.json" for r in range(n)):
        pytest.fail(f"expected the covered pairs of ranks 0..{n - 1} in {where}, got {files}")
    return [set(json.loads((where / f"rank{r}.json").read_text())) for r in range(n)]


def assert_checks(out: str, key: str, n: int) -> list[int]:
    """Every rank ran exactly the recorded number of checks for ``key``."""
    import json

    from ringcomm import settings

    import torch

    counts = checks_passed(out, n)
    table = json.loads(EXPECTED_CHECKS.read_text()) if EXPECTED_CHECKS.exists() else {}
    # a program that adapts to what this torch's gloo can do runs another number of
    # checks there: recorded under the key with the torch version, where it differs
    minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    versioned = f"{key} [torch {minor}]" if minor != RECORDED_TORCH else key
    if settings.get("RINGCOMM_RECORD_CHECKS"):
        if versioned == key or counts != table.get(key):
            table[versioned] = counts
        EXPECTED_CHECKS.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
        return counts
    want = table.get(versioned, table.get(key))
    if want is None:
        pytest.fail(f"no recorded check count for {key!r} in {EXPECTED_CHECKS.name}; record "
                    "it with RINGCOMM_RECORD_CHECKS=1")
    if counts != want:
        pytest.fail(f"{key}: ranks ran {counts} checks, expected {want} (if checks were added "
                    "or removed on purpose, re-record with RINGCOMM_RECORD_CHECKS=1)")
    return counts
