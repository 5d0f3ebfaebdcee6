#!/usr/bin/env python3
"""Every failure and bad-input case the test programs try, and what each produces.

Runs the per-rank programs of tests/ranks/ that provoke failures (timeouts,
short messages, inputs refused on one rank, mismatched collectives, abort and
shutdown while a collective runs, 100 groups created, broken and destroyed, a
soak of mixed asynchronous collectives, Ctrl-C on both launchers, a rank that
leaves under each launcher) and the CUDA path's refusals (through
ringcomm.testing.FakeNccl), collects the lines
``case: {...}``, ``lifecycle: {...}`` and ``soak: {...}`` they print, and writes
docs/data/reliability.json and docs/reliability.md.

    python scripts/reliability_report.py            # run everything (a few minutes)
    python scripts/reliability_report.py --render   # markdown from the saved JSON
    python scripts/reliability_report.py --check    # exit 1 unless the markdown is current
"""
from __future__ import annotations

import argparse
import contextlib
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


#: a rank leaves, while the others wait on it in an allreduce
#: (tests/ranks/leave_check.py): launcher -> the ways it leaves; every row is
#: asserted by tests/test_departure.py (the srun and two-host rows with a Slurm
#: cluster and namespace hosts: make test-cluster)
DEPARTURES = {
    "mpiexec": ["raise", "exit", "end", "thread", "os_exit", "sigterm", "sigkill"],
    "torchrun": ["raise", "exit", "end", "sigkill"],
    "srun": ["raise", "exit", "end"],
    "srun --mpi=pmi2": ["raise", "exit", "end"],
    "srun --mpi=pmix": ["raise", "exit", "end"],
    "mpiexec, 2 hosts": ["raise", "exit", "end"],
}
#: how each way of leaving reads in words, as leave_check.py does it
LEAVING = {"raise": "raises ValueError", "exit": "calls sys.exit(3)",
           "end": "ends its script (exit code 0)", "thread": "a thread of its raises, then "
           "its script ends", "os_exit": "calls os._exit(4)", "sigterm": "gets SIGTERM",
           "sigkill": "gets SIGKILL"}


def raise_line() -> int:
    """The line of leave_check.py's ``raise``, which the error must name."""
    text = (RANKS / "leave_check.py").read_text().splitlines()
    return next(i for i, line in enumerate(text, 1) if 'raise ValueError("bad batch")' in line)


def leaving_words(how: str) -> list[str]:
    """What a peer's error must say of the rank that left ``how`` (besides its rank)."""
    return {"raise": [f"raised ValueError: bad batch at leave_check.py:{raise_line()}",
                      "exit code 1"],
            "exit": ["called sys.exit(3)", "exit code 3"],
            "end": ["ended its script, while rank"],
            "thread": ["after an uncaught exception: raised ValueError: invalid literal",
                       "in thread 'loader'"]}.get(how, ["exited"])


def departure(launcher: str, how: str, run) -> dict:
    """A row of the table: 2 ranks under ``launcher``, the last leaving ``how``.
    ``run(argv)`` runs ``[python, leave_check.py, how]`` under the launcher and returns
    (exit code, output); the row: the job's exit code, when it ended after the rank
    left, and each waiting rank's error and after how long it came."""
    code, out = run([sys.executable, str(RANKS / "leave_check.py"), how])
    ended = time.time()
    left = [float(line.split()[1]) for line in out.splitlines() if line.startswith("leaving: ")]
    peers = []
    for line in out.splitlines():
        if line.startswith("left: "):
            with contextlib.suppress(json.JSONDecodeError):
                peers.append(json.loads(line[len("left: "):]))
    return {"launcher": launcher, "how": how, "exit_code": code,
            "job_ended_after": round(ended - left[0], 2) if left else None,
            "peers": sorted(peers, key=lambda x: x["rank"]), "tail": out[-1500:]}


def local_runner(launcher: str):
    """``run`` for :func:`departure` on this machine (mpiexec, torchrun)."""
    def run(argv: list[str]) -> tuple[int, str]:
        p = subprocess.run(launch_command(launcher, 2, Path(argv[1]), argv[2:]), cwd=ROOT,
                           env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=120)
        return p.returncode, p.stdout
    return run


def slurm_runner(cluster, mpi: str):
    """``run`` for :func:`departure` under srun on a local Slurm cluster
    (scripts/localslurm.py), the two ranks on two nodes (PMIx: on one, whose files
    in /tmp namespace hosts would share); ``mpi``: srun's --mpi."""
    nodes = "1" if mpi == "pmix" else "2"

    def run(argv: list[str]) -> tuple[int, str]:
        e = env({"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"})
        for k in list(e):  # nothing of an enclosing launch leaks into the job
            if k.startswith(("SLURM_JOB", "SLURM_STEP", "SLURM_PROCID", "PMI_", "PMIX_")):
                e.pop(k)
        e.update(cluster.env)
        p = subprocess.run(cluster.command(["srun", "-N", nodes, "-n", "2", f"--mpi={mpi}",
                                            *argv]),
                           cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=120)
        return p.returncode, p.stdout
    return run


def pmix_loads(cluster) -> bool:
    """Slurm's PMIx plugin loads on this cluster (Debian: libpmix-dev)."""
    code, _ = slurm_runner(cluster, "pmix")(["true"])
    return code == 0


def hosts_runner(hosts):
    """``run`` for :func:`departure` under mpiexec across two namespace hosts
    (scripts/nshosts.py)."""
    def run(argv: list[str]) -> tuple[int, str]:
        p = hosts.popen(0, hosts.mpiexec_argv(2, argv, hosts=2), cwd=ROOT, env=env(),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = p.communicate(timeout=120)
        return p.returncode, out
    return run


def departures() -> list[dict]:
    """Every row of :data:`DEPARTURES` this machine can run (srun: a local Slurm
    cluster; two hosts: network namespaces; both need root)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import localslurm
    import nshosts

    rows = []

    def run_all(launcher: str, run) -> None:
        for how in DEPARTURES[launcher]:
            print(f"{launcher}: the last rank {LEAVING[how]} ...", flush=True)
            rows.append(departure(launcher, how, run))

    for launcher in ("mpiexec", "torchrun"):
        run_all(launcher, local_runner(launcher))
    if localslurm.unavailable(hosts=2) is None:
        with localslurm.LocalSlurm(hosts=2, cpus=4) as cluster:
            run_all("srun", slurm_runner(cluster, "none"))
            run_all("srun --mpi=pmi2", slurm_runner(cluster, "pmi2"))
            if pmix_loads(cluster):
                run_all("srun --mpi=pmix", slurm_runner(cluster, "pmix"))
    if nshosts.unavailable() is None:
        with nshosts.NamespaceHosts(2, prefix=f"rrp{os.getpid() % 10000}h") as hosts:
            run_all("mpiexec, 2 hosts", hosts_runner(hosts))
    return rows


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
        # the group's communicator first, with both ranks (a later refusal that comes
        # after the lane is chosen would otherwise wait for the other rank to make it)
        pg.allreduce([torch.ones(2)]).wait()
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
    cuda = cuda_path_cases()
    return {
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": {"ringcomm": ringcomm.__version__, "torch": torch.__version__,
                        "python": platform.python_version(), "cores": os.cpu_count()},
        "runs": runs, "signals": signals, "cuda_path": cuda, "departures": departures(),
    }


def _cell(text: str, limit: int = 260) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def render_departures(rows: list[dict]) -> list[str]:
    """The table "a rank leaves"."""
    if not rows:
        return []
    lines = ["", "## A rank leaves", "",
             "Two ranks (`tests/ranks/leave_check.py`): after one good allreduce the last "
             "rank leaves while rank 0 calls the next, under the group's default 30-minute "
             "timeout. What rank 0's allreduce raised and after how long (none: the "
             "launcher ended rank 0 first), and when the job ended after the rank left. "
             "Each row is asserted by `tests/test_departure.py` (srun: "
             "`test_slurm_cluster.py`, two hosts: `test_multinode.py`).", "",
             "| launcher | the last rank ... | rank 0 got | after (s) | job ended after (s) "
             "| exit code |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        peer = r["peers"][0] if r["peers"] else None
        got = _cell(peer["error"], 300) if peer else "(ended by the launcher)"
        secs = f"{peer['seconds']:.2f}" if peer else ""
        ended = "" if r["job_ended_after"] is None else f"{r['job_ended_after']:.1f}"
        lines.append(f"| {r['launcher']} | {LEAVING[r['how']]} | {got} | {secs} | {ended} | "
                     f"{r['exit_code']} |")
    return lines


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
    lines += render_departures(doc.get("departures", []))
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
