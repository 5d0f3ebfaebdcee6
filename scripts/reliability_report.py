#!/usr/bin/env python3
"""Every failure and bad-input case the test programs try, and what each produces.

Runs the per-rank programs of tests/ranks/ that provoke failures (timeouts,
short messages, inputs refused on one rank, mismatched collectives, abort and
shutdown while a collective runs, 100 groups created, broken and destroyed, a
soak of mixed asynchronous collectives, Ctrl-C on both launchers) and the
CUDA path's refusals (through ringcomm.testing.FakeNccl), collects the lines
``case: {...}``, ``lifecycle: {...}`` and ``soak: {...}`` they print, and writes
docs/data/reliability.json and docs/reliability.md.

    python scripts/reliability_report.py            # run everything (a few minutes)
    python scripts/reliability_report.py --render   # markdown from the saved JSON
    python scripts/reliability_report.py --check    # exit 1 unless the markdown is current
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANKS = ROOT / "tests" / "ranks"
JSON_PATH = ROOT / "docs" / "data" / "reliability.json"
MD_PATH = ROOT / "docs" / "reliability.md"
BIN = Path(sys.executable).parent

#: (program, arguments, ranks, extra environment)
RUNS = [
    ("failure_check.py", ["timeout"], 3, {}),
    ("failure_check.py", ["short"], 3, {}),
    ("failure_check.py", ["refused"], 3, {}),
    ("failure_check.py", ["mismatch"], 3, {"RINGCOMM_DEBUG": "DETAIL"}),
    ("failure_check.py", ["mismatch_op"], 3, {"RINGCOMM_DEBUG": "DETAIL"}),
    ("failure_check.py", ["tags"], 3, {}),
    ("failure_check.py", ["abort"], 3, {}),
    ("world_check.py", ["env"], 2, {"WORLD_SIZE": "3"}),
    ("world_check.py", ["explicit"], 2, {}),
    ("collectives_check.py", [], 2, {}),
    ("more_collectives_check.py", [], 2, {}),
    ("lifecycle_check.py", ["100"], 3, {}),
    ("soak_check.py", ["3000"], 2, {}),
]


def env(extra: dict | None = None) -> dict:
    e = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RUN_ID")}
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    e.update(extra or {})
    return e


def mpiexec() -> str:
    exe = BIN / "mpiexec"
    return str(exe) if exe.exists() else (shutil.which("mpiexec") or "mpiexec")


def launch_command(launcher: str, n: int, program: Path, args: list[str]) -> list[str]:
    if launcher == "mpiexec":
        return [mpiexec(), "-n", str(n), sys.executable, str(program), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={n}", str(program), *args]


def run_program(program: str, args: list[str], n: int, extra: dict) -> dict:
    cmd = launch_command("mpiexec", n, RANKS / program, args)
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env(extra), capture_output=True, text=True,
                       timeout=600)
    out: dict = {"program": f"{program} {' '.join(args)}".strip(), "ranks": n,
                 "exit_status": p.returncode, "seconds": round(time.monotonic() - t0, 1),
                 "cases": [], "lines": {}}
    decoder = json.JSONDecoder()
    for tag in ("case", "lifecycle", "soak"):
        # ranks share stdout, so lines may run into each other: find each object
        start = 0
        while (i := p.stdout.find(tag + ": {", start)) >= 0:
            start = i + len(tag) + 2
            try:
                doc, end = decoder.raw_decode(p.stdout, start)
            except json.JSONDecodeError:
                continue
            start = end
            if tag == "case":
                out["cases"].append(doc)
            else:
                out["lines"][tag] = doc
    return out


def sigint_exit_seconds(launcher: str, n: int = 3, limit: float = 10.0) -> tuple[float, list[str]]:
    """Start tests/ranks/stuck_check.py (ranks stuck in a collective), interrupt the
    launcher once every rank is waiting; return the seconds until the launcher
    exited (``inf`` past ``limit``) and the pids of ranks still running after it."""
    program = RANKS / "stuck_check.py"
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"ringcomm-sigint-{launcher}-{os.getpid()}.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(launch_command(launcher, n, program, []), cwd=ROOT, env=env(),
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while log.read_text().count("waiting") < n:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{launcher}: the ranks never started:\n"
                                   f"{log.read_text()[-2000:]}")
            time.sleep(0.2)
        time.sleep(1.0)  # every rank is inside the collective (or asleep) now
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=limit)
            took = time.monotonic() - t0
        except subprocess.TimeoutExpired:
            took = float("inf")
        time.sleep(0.5)
        left = subprocess.run(["pgrep", "-f", str(program)], capture_output=True,
                              text=True).stdout.split()
        return took, left
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in subprocess.run(["pgrep", "-f", str(program)], capture_output=True,
                                  text=True).stdout.split():
            os.kill(int(pid), signal.SIGKILL)
        log.unlink(missing_ok=True)


def cuda_path_cases() -> list[dict]:
    """The CUDA path's refusals and its timeout, on CPU tensors through FakeNccl."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ringcomm.front.process_group import ProcessGroupRingcomm
    from ringcomm.testing import FakeNccl, nccl_groups

    cases: list[dict] = []

    def note(what: str, fn) -> None:
        t0 = time.monotonic()
        try:
            fn()
            outcome = "no error"
        except Exception as e:  # noqa: BLE001
            outcome = f"{type(e).__name__}: {e}"
        cases.append({"case": what, "outcome": outcome,
                      "seconds": round(time.monotonic() - t0, 2)})

    def refusals(pg):
        if pg.rank() != 0:
            return
        note("non-contiguous tensor", lambda: pg.allreduce([torch.ones(4, 4).t()]))
        note("tensors on two devices in one call", lambda: pg.allgather(
            [[torch.empty(2), torch.empty(2, device="meta")]], [torch.ones(2)]))
        pg.set_algorithm("allreduce", "native")
        note("native allreduce of int16 (NCCL has no int16)",
             lambda: pg.allreduce([torch.ones(3, dtype=torch.int16)]))
        pg.set_algorithm("gather", "native")
        note("native gather (NCCL has none)", lambda: pg.gather(
            [[torch.empty(2), torch.empty(2)]], [torch.ones(2)], dist.GatherOptions()))
        note("receive from any rank", lambda: pg.recv_anysource([torch.ones(2)]))

    nccl_groups(2, refusals)
    no_cupy = ProcessGroupRingcomm(0, 1, None, timedelta(seconds=5), store=dist.HashStore(),
                                   cpu_error="unused", nccl_device_type="cpu")
    note("CUDA tensor where CuPy cannot run it (no CuPy, or no usable GPU)",
         lambda: no_cupy.allreduce([torch.ones(2)]))
    no_cupy.shutdown()

    def late_peer(pg):
        pg.allreduce([torch.ones(2)]).wait()
        if pg.rank() == 1:
            time.sleep(3)
            return
        o = dist.AllreduceOptions()
        o.timeout = timedelta(seconds=1)
        note("a peer misses a collective (timeout 1 s; the watchdog aborts)",
             lambda: pg.allreduce([torch.ones(2)], o).wait())
        note("the next call on that group", lambda: pg.allreduce([torch.ones(2)]))

    nccl_groups(2, late_peer, lib=FakeNccl(), timeout_s=20)
    return cases


def collect() -> dict:
    import torch

    import ringcomm

    runs = []
    for program, args, n, extra in RUNS:
        print(f"running {program} {' '.join(args)} on {n} ranks ...", flush=True)
        runs.append(run_program(program, args, n, extra))
    signals = {}
    for launcher in ("mpiexec", "torchrun"):
        print(f"interrupting {launcher} ...", flush=True)
        took, left = sigint_exit_seconds(launcher)
        signals[launcher] = {"seconds_to_exit": round(took, 1) if took != float("inf") else None,
                             "ranks_left_running": len(left)}
    print("the CUDA path's refusals (FakeNccl) ...", flush=True)
    return {
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": {"ringcomm": ringcomm.__version__, "torch": torch.__version__,
                        "python": platform.python_version(), "cores": os.cpu_count()},
        "runs": runs, "signals": signals, "cuda_path": cuda_path_cases(),
    }


def _cell(text: str, limit: int = 260) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def render(doc: dict) -> str:
    lines = [
        "# Reliability: what each failure and bad input produces",
        "",
        f"Generated by `scripts/reliability_report.py` from `docs/data/reliability.json` "
        f"({doc['generated']}; ringcomm {doc['environment']['ringcomm']}, torch "
        f"{doc['environment']['torch']}, {doc['environment']['cores']} cores). Every case "
        "below is also asserted by the test suite (`tests/ranks/failure_check.py`, "
        "`collectives_check.py`, `more_collectives_check.py`, `lifecycle_check.py`, "
        "`soak_check.py`, `tests/test_signals.py`, `tests/test_nccl_path.py`).",
        "",
        "## Failures and bad inputs (CPU tensors, MPI)",
        "",
        "| case | program (ranks) | what the caller gets | after (s) |",
        "|---|---|---|---:|",
    ]
    for run in doc["runs"]:
        seen = set()
        for c in run["cases"]:
            if c["case"] in seen:
                continue
            seen.add(c["case"])
            secs = "" if c.get("seconds") is None else f"{c['seconds']:.2f}"
            lines.append(f"| {_cell(c['case'], 80)} | `{run['program']}` ({run['ranks']}) | "
                         f"{_cell(c['outcome'])} | {secs} |")
    lines += ["", "## CUDA path (through the NCCL stand-in, CPU tensors)", "",
              "| case | what the caller gets | after (s) |", "|---|---|---:|"]
    for c in doc["cuda_path"]:
        lines.append(f"| {_cell(c['case'], 80)} | {_cell(c['outcome'])} | {c['seconds']:.2f} |")
    lines += ["", "## Ctrl-C on the launcher", "",
              "Three ranks, two stuck in a collective the third never joins (one waiting on "
              "the caller's thread, one on the progress thread); SIGINT to the launcher.", "",
              "| launcher | launcher gone after (s) | ranks left running |", "|---|---:|---:|"]
    for launcher, s in doc["signals"].items():
        lines.append(f"| {launcher} | {s['seconds_to_exit'] if s['seconds_to_exit'] is not None else '> 10'} | "
                     f"{s['ranks_left_running']} |")
    life = next((r["lines"]["lifecycle"] for r in doc["runs"] if "lifecycle" in r["lines"]), None)
    if life:
        a, b = life["after_warmup"], life["at_end"]
        lines += ["", "## Groups created, broken and destroyed", "",
                  f"{life['groups']} times on {life['ranks']} ranks ({life['seconds']} s): a new "
                  "group runs an allreduce; rank 0 alone starts another and aborts the group "
                  "while it runs; every rank destroys the group. Rank 0's process after the "
                  "first 10 groups and at the end:", "",
                  "| | threads | open files | ringcomm groups alive | MPI transports alive | "
                  "buffers kept for MPI | resident MB |", "|---|---:|---:|---:|---:|---:|---:|",
                  f"| after 10 | {a['threads']} | {a['fds']} | {a['groups']} | {a['transports']} | "
                  f"{a['limbo']} | {a['rss_mb']} |",
                  f"| after {life['groups']} | {b['threads']} | {b['fds']} | {b['groups']} | "
                  f"{b['transports']} | {b['limbo']} | {b['rss_mb']} |"]
    soak = next((r["lines"]["soak"] for r in doc["runs"] if "soak" in r["lines"]), None)
    if soak:
        lines += ["", "## Soak", "",
                  f"{soak['operations']} asynchronous collectives on {soak['ranks']} ranks "
                  f"({soak['seconds']} s): allreduce, broadcast, allgather, reduce_scatter, "
                  "all_to_all and barrier, sizes 0 to 64 Ki elements, float32/int64/bfloat16, "
                  "alternating between two groups, handles waited out of order in random "
                  f"batches, {soak['then']} results through `Future.then`.", "",
                  "| operations | wrong values | resident MB after warm-up | at the end |",
                  "|---:|---:|---:|---:|",
                  f"| {soak['operations']} | {soak['wrong']} | {soak['rss_mb_after_warmup']} | "
                  f"{soak['rss_mb_at_end']} |"]
    bad = [r for r in doc["runs"] if r["exit_status"] != 0]
    if bad:
        lines += ["", "**Programs that failed in this run:** " +
                  ", ".join(f"`{r['program']}` (exit {r['exit_status']})" for r in bad)]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--render", action="store_true", help="only render the saved JSON")
    g.add_argument("--check", action="store_true",
                   help="exit 1 unless docs/reliability.md is the rendering of the JSON")
    args = ap.parse_args()
    if args.check:
        current = render(json.loads(JSON_PATH.read_text()))
        if MD_PATH.read_text() != current:
            print(f"{MD_PATH} is not the rendering of {JSON_PATH}; run "
                  "scripts/reliability_report.py --render", file=sys.stderr)
            return 1
        return 0
    if not args.render:
        sys.path.insert(0, str(ROOT))
        JSON_PATH.parent.mkdir(parents=True, exist_ok=True)
        JSON_PATH.write_text(json.dumps(collect(), indent=1) + "\n")
    MD_PATH.write_text(render(json.loads(JSON_PATH.read_text())))
    print(f"wrote {MD_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
