#!/usr/bin/env python3
"""The check of ringcomm's CUDA path, for a machine with one (or more) GPUs, in
stages that each prove one thing and have a deadline of their own.

Run through ``scripts/gpu_check.sh``. It installs nothing: CUDA torch and CuPy
with NCCL must be there; MPI need not be (CUDA tensors do not use it). On a lent
machine where only one output folder comes back, run it as

    bash scripts/gpu_check.sh --outdir "$OUT"

and everything it writes goes to that folder: ``gpu_check.json``, the report
``gpu-results.md``, each stage's part files and each stage's whole output
(``<stage>.log``); nothing in docs/ is touched. Without ``--outdir``, ``--out``
(the report) and ``--data`` (the JSON) say where, as before.

Stages, in the order of what they prove (``STAGES``):

1. ``versions``: torch, CUDA, GPU, CuPy, NCCL as CuPy loads it and as torch has
   it, and how two ranks share one GPU (NCCL >= 2.30.3:
   ``NCCL_MULTI_RANK_GPU_ENABLE=1``; older: a distinct ``NCCL_HOSTID`` per rank).
2. ``allreduce``: two ranks, one allreduce of every algorithm, against one process.
3. ``collectives``: every collective x algorithm x dtype x op on 1 and 2 channels
   against one process, and against torch's own ``nccl`` backend.
4. ``device_id``: ``init_process_group(device_id=...)`` (bound device, NCCL made at
   init), send/recv on a pair communicator, a ``then`` on a CUDA future.
5. ``streams``: ``Work.wait`` orders the caller's stream, ``synchronize`` does not
   block the CPU, buffers a call owns survive an evicted call, and channels keep
   issue order on the same tensor.
6. ``frameworks``: ringcomm's DDP and torch's DDP against one process, FSDP2
   against torch's nccl.
7. ``bench``: a busbw table, ring, tree, native and torch's nccl (two ranks on
   one GPU take turns on it: the table is no speed figure, and says so).

Each stage runs in fresh worker processes (torchrun, two ranks) with
``NCCL_DEBUG=WARN`` and, unless set, ``NCCL_LAUNCH_ORDER_IMPLICIT=1`` (recorded in
the JSON's ``settings``; why: ``stage_env``); one that fails or passes its deadline is recorded so, its
workers are all killed (torchrun starts each in a session of its own, so they are
found by a marker in their environment), and the next stage runs. After every
stage the JSON (``docs/data/gpu_check.json``) is rewritten, so a check cut short
still holds what it found; the report (``docs/gpu-results.md``) is generated from
it. ``--fake`` runs the same driver on CPU tensors (MPI lanes, and the NCCL path
over FakeNccl in-process), as CI does, to prove the plumbing before a GPU sees it.

What a hang leaves: the workers' process groups time out at 70% of the stage's
limit (so ringcomm's and torch's own timeouts fire, naming the call, before the
driver's deadline does); each rank prints every case's name before it runs it (a
stage that stops records the last one of each rank); and each rank dumps the stack
of every thread (``faulthandler``) a little before the deadline, and again on the
driver's SIGUSR1 at the deadline, before it is killed: all in the stage's log, and
the end of it in the JSON's ``log_tail``.

Exit status: 0 when every stage passed.
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: the whole check must end within this (gpu_check.sh kills it a little later)
BUDGET_S = 225.0
#: kept back at the end for writing the report
REPORT_S = 3.0
#: (name, what it proves, deadline in seconds); the deadlines add up to the budget
STAGES = (
    ("versions", "imports and versions; how two ranks share a GPU", 20.0),
    ("allreduce", "a two-rank allreduce of every algorithm", 30.0),
    ("collectives", "every collective and algorithm, 1 and 2 channels, vs one process "
                    "and vs torch's nccl", 55.0),
    ("device_id", "init_process_group(device_id=...), send/recv, CUDA futures", 20.0),
    ("streams", "stream semantics: wait, synchronize, owned buffers, channel order", 20.0),
    ("frameworks", "DDP and torch DDP vs one process, FSDP2 vs torch's nccl", 35.0),
    ("bench", "busbw of ring, tree, native and torch's nccl", 42.0),
)
#: the environment variable that marks every process of one check
MARK = "GPU_CHECK_RUN"
#: ranks of every stage after versions (torchrun's --nproc-per-node)
RANKS = 2
#: characters of a stage's output kept in the JSON: a passed or failed stage's end,
#: and more of a hung one (every rank's stacks)
TAIL, TAIL_HUNG = 3000, 12000
#: the environment variable that gives a stage's processes its deadline (seconds
#: since the epoch): they dump their stacks a little before it
DEADLINE = "GPU_CHECK_DEADLINE"
#: how long before the deadline a stage's processes dump their stacks by themselves
DUMP_AHEAD_S = 2.0
#: how long the driver waits, after its SIGUSR1 at the deadline, for the stacks
DUMP_WAIT_S = 1.0
#: gpu_check.sh changes to the repository; relative paths given to it are the caller's
CALLER_DIR = "GPU_CHECK_CALLER_DIR"
SIZES = ("1K", "16M")


def group_timeout(limit: float) -> float:
    """The process groups' timeout in a stage of ``limit`` seconds: 70% of it, at
    least 3 s, and always below it, so that a collective that hangs fails by
    ringcomm's (or torch's) own timeout, which names the call, before the driver
    has to end the stage (torch's default, 30 minutes, never fires within one)."""
    return round(min(max(0.7 * limit, 3.0), 0.9 * limit), 1)


def stage_env(base: Mapping[str, str], mark: str) -> tuple[dict[str, str], dict[str, str]]:
    """The environment of every stage's processes, and the settings to record of it."""
    env = dict(base, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), base.get("PYTHONPATH")])), OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1", NCCL_DEBUG=base.get("NCCL_DEBUG", "WARN"), **{MARK: mark})
    # With several channels (num_channels > 1), or pair communicators for send/recv
    # beside the group's, kernels of several NCCL communicators run on one GPU at
    # once. NCCL before 2.26 needs one global launch order across communicators or
    # it may deadlock; from 2.26, NCCL_LAUNCH_ORDER_IMPLICIT=1 makes the host's
    # issue order that order. A value the caller set is kept (and recorded).
    given = base.get("NCCL_LAUNCH_ORDER_IMPLICIT")
    env["NCCL_LAUNCH_ORDER_IMPLICIT"] = "1" if given is None else given
    settings = {"NCCL_LAUNCH_ORDER_IMPLICIT": env["NCCL_LAUNCH_ORDER_IMPLICIT"],
                "NCCL_LAUNCH_ORDER_IMPLICIT_from": "gpu_check's default, as it was unset"
                if given is None else "the caller's environment",
                "NCCL_DEBUG": env["NCCL_DEBUG"]}
    return env, settings


def versions(fake: bool = False) -> dict:
    """The versions that decide what can run; ``fake``: no GPU is looked for."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "gpus": [], "cupy": None, "nccl_cupy": None,
           "nccl_torch": None}
    if fake:
        out["gpus"] = ["none (--fake: CPU tensors)"]
        return out
    if torch.cuda.is_available():
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            v = torch.cuda.nccl.version()
            out["nccl_torch"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001
            out["nccl_torch"] = f"unknown ({e})"
    try:
        import cupy
        out["cupy"] = cupy.__version__
        sys.path.insert(0, str(ROOT))
        from ringcomm.transport import nccl
        out["nccl_cupy"] = nccl.version(nccl.load())
    except Exception as e:  # noqa: BLE001
        out["cupy_error"] = f"{type(e).__name__}: {e}"
    return out


def sharing(nccl_version: str | None, fake: bool = False) -> tuple[str, dict]:
    """How two ranks share one GPU with this NCCL, and the environment for it."""
    if fake:
        return "not needed (--fake: CPU tensors)", {}
    parts = tuple(int(x) for x in (nccl_version or "0.0.0").split(".")[:3])
    if parts >= (2, 30, 3):
        return ("NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30.3)",
                {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_SOCKET_IFNAME": "lo"})
    return ("a distinct NCCL_HOSTID per rank with NCCL_SOCKET_IFNAME=lo (NCCL < 2.30.3: "
            "the ranks look like two hosts, so NCCL uses its network transport)",
            {"RINGCOMM_NCCL_HOSTID_PER_RANK": "1", "NCCL_SOCKET_IFNAME": "lo"})



def run(cmd: list[str], env: dict, timeout: float, log: Path) -> tuple[int, str]:
    """Run ``cmd``, its output (stdout and stderr) going to ``log`` as it comes, so
    that a driver cut short still leaves it there; past ``timeout`` have every
    process it started dump its stacks, then end them all (all carry the run's mark
    in their environment). Returns the exit status (124: timed out) and the output."""
    head = ("$ " + " ".join(cmd) + "\n").encode()
    print(head.decode(), end="", flush=True)
    # O_APPEND: the driver's lines and every process's output all land at the end
    fd = os.open(log, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    try:
        os.write(fd, head)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fd, stderr=subprocess.STDOUT,
                                start_new_session=True)
        _current[0] = (proc, fd, len(head))
        try:
            rc = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            end_all(proc, env[MARK])
            proc.wait()
            rc = 124
            os.write(fd, f"\n(timed out after {timeout:.0f}s; stacks dumped, every worker "
                         "killed)\n".encode())
        finally:
            _current[0] = None
        text = written(fd, len(head))
    finally:
        os.close(fd)
    print(text, flush=True)
    return rc, text


#: the stage running now: (torchrun's Popen, its log's descriptor, where its output starts)
_current: list[tuple[subprocess.Popen, int, int] | None] = [None]


def written(fd: int, start: int) -> str:
    """What the log open as ``fd`` holds from byte ``start`` on."""
    return os.pread(fd, max(os.fstat(fd).st_size - start, 0), start).decode(errors="replace")


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` handles ``signum`` (to one that does not, SIGUSR1 is
    fatal and prints nothing)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def marked(mark: str) -> list[int]:
    """The pids of the processes whose environment carries ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def end_all(proc: subprocess.Popen, mark: str) -> None:
    """End a stage: SIGUSR1 to every process of the run that handles it (the stage's
    workers: faulthandler prints the stack of each of their threads into the stage's
    log) and a moment for them to print; then SIGTERM to torchrun's process group (it
    stops its workers), then SIGKILL to every process of the run still there."""
    dumping = [pid for pid in marked(mark) if catches(pid, signal.SIGUSR1)]
    for pid in dumping:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if dumping:
        time.sleep(DUMP_WAIT_S)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and marked(mark):
        time.sleep(0.2)
    for pid in marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def last_cases(text: str) -> dict[str, str]:
    """The case each rank started last (``case()``'s lines): where a stage stopped."""
    found: dict[str, str] = {}
    for m in re.finditer(r"^rank (\d+): case (.*)$", text, re.MULTILINE):
        found[m.group(1)] = m.group(2)
    return dict(sorted(found.items()))


def nccl_warnings(text: str) -> list[str]:
    """NCCL's own WARN lines (``NCCL_DEBUG=WARN``), once each."""
    seen: list[str] = []
    for line in text.splitlines():
        if "NCCL WARN" in line and line.strip() not in seen:
            seen.append(line.strip())
    return seen[:20]


def driver(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="gpu_check_logs_") as tmp:
        # without --outdir the logs are only read back (for log_tail): nothing new in docs/
        return run_stages(args, Path(args.outdir) if args.outdir else Path(tmp))


def bench_notes(fake: bool, gpus: list | None) -> list[str]:
    """What the bench stage's bus bandwidths are not."""
    if fake:
        return ["--fake: CPU tensors, two processes on one machine: these bus bandwidths "
                "show the plumbing works; they are not a speed figure"]
    if gpus is None:
        return [f"if the {RANKS} ranks shared one GPU (the versions stage did not run to "
                "say), they took turns on it: then these bus bandwidths are not a speed "
                "figure"]
    if len(gpus) < RANKS:
        return [f"{RANKS} ranks on {len(gpus)} GPU: the processes take turns on it, so "
                "these bus bandwidths are not a speed figure (of the GPU, of NCCL or of "
                "ringcomm); they show every column ran"]
    return []


def run_stages(args: argparse.Namespace, logs: Path) -> int:
    start = time.monotonic()
    deadline = start + args.budget - REPORT_S
    mark = uuid.uuid4().hex
    if args.outdir:
        data, out = logs, logs / "gpu-results.md"
    else:
        data, out = Path(args.data), Path(args.out)
    data.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    js = data / "gpu_check.json"
    env, settings = stage_env(os.environ, mark)
    results: dict = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "fake": args.fake, "versions": {}, "settings": settings,
        "stages": []}
    running: list[str] = [""]  # the stage whose processes run now

    def save() -> None:
        results["passed"] = bool(results["stages"]) and all(
            st["status"] in ("passed", "skipped") for st in results["stages"])
        js.write_text(json.dumps(results, indent=1))
        out.write_text(report(results))

    def stop(signum, frame):  # gpu_check.sh's timeout: end the stage, keep what we have
        cut = {"name": "(cut short)", "status": "timed out",
               "detail": f"signal {signum}: the whole check ran out of time"}
        if _current[0] is not None:
            proc, fd, begin = _current[0]
            end_all(proc, mark)  # the stacks first: they say where it hung
            cut.update(stage=running[0], log_tail=written(fd, begin)[-TAIL_HUNG:])
        results["stages"].append(cut)
        save()
        sys.exit(124)

    signal.signal(signal.SIGTERM, stop)
    wanted = [st for st in STAGES if not args.stages or st[0] in args.stages.split(",")]
    share_env: dict = {}
    for name, proves, limit in wanted:
        left = deadline - time.monotonic()
        stage = {"name": name, "proves": proves, "deadline_s": limit}
        if left < 5.0:
            stage.update(status="not run", detail="no time left in the budget")
            results["stages"].append(stage)
            save()
            continue
        limit = min(limit * args.scale, left)
        timeout = group_timeout(limit)
        stage["limit_s"] = round(limit, 1)
        if name != "versions":  # it makes no group
            stage["group_timeout_s"] = timeout
        t0 = time.monotonic()
        if name == "versions":
            cmd = [sys.executable, str(Path(__file__)), "--versions"] + \
                (["--fake"] if args.fake else [])
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={RANKS}"]
            part = data / f"gpu_check_{name}.json"
            part.unlink(missing_ok=True)
            if name == "bench":
                device = "cpu" if args.fake else "cuda"
                # ringcomm.bench's own command line, behind --bench: the ranks dump
                # their stacks on a hang as the workers do
                cmd += [str(Path(__file__)), "--bench", "--device", device, "--algos",
                        "ring,tree" + ("" if args.fake else ",native"), "--peers",
                        "gloo" if args.fake else "nccl", "-b", SIZES[0],
                        "-e", "64K" if args.fake else SIZES[1], "-f", "4", "-c", "-w", "1",
                        "-n", "3", "--rounds", "1", "--min-time", "0", "--no-model",
                        "--targets", "none", "--timeout", f"{timeout:g}", "--json", str(part),
                        "--markdown", str(part.with_suffix(".md"))]
            else:
                cmd += [str(Path(__file__)), "--worker", "--stage", name, "--json", str(part),
                        "--timeout", f"{timeout:g}"]
                cmd += ["--fake"] if args.fake else []
                cmd += ["--hang"] if args.hang_stage == name else []
        log = logs / f"{name}.log"
        running[0] = name
        rc, text = run(cmd, dict(env, **share_env, **{DEADLINE: f"{time.time() + limit:.3f}"}),
                       limit, log)
        running[0] = ""
        stage["seconds"] = round(time.monotonic() - t0, 1)
        stage["exit_status"] = rc
        stage["nccl_warnings"] = nccl_warnings(text)
        # a hung stage's tail holds every rank's stacks, more than a line or two
        stage["log_tail"] = text[-(TAIL_HUNG if rc == 124 else TAIL):]
        if args.outdir:
            stage["log"] = log.name
        if name == "versions":
            try:
                v = json.loads(text.strip().splitlines()[-1])
            except (json.JSONDecodeError, IndexError):
                v = {"error": "the version query printed no JSON"}
            results["versions"] = v
            how, share_env = sharing(v.get("nccl_cupy"), args.fake)
            results["two_ranks_on_one_gpu"] = how
            ok = rc == 0 and (args.fake or (v.get("gpus") and not v.get("cupy_error")))
            stage["status"] = "passed" if ok else "failed"
            if not ok:
                stage["detail"] = v.get("cupy_error") or ("no CUDA device" if not v.get("gpus")
                                                         else f"exit status {rc}")
                results["stages"].append(stage)
                save()
                print(f"gpu_check: cannot run: {stage['detail']}", flush=True)
                break  # nothing after it can run
        else:
            found = json.loads(part.read_text()) if part.exists() else None
            if name == "bench":
                skipped = bench_skips(part)
                stage["markdown"] = (part.with_suffix(".md").read_text()
                                     if part.with_suffix(".md").exists() else None)
                stage["skipped"] = skipped
                stage["notes"] = bench_notes(args.fake, results["versions"].get("gpus"))
                ok = rc == 0 and not skipped
            else:
                stage.update(found or {})
                ok = rc == 0 and found is not None and not found.get("failures")
            stage["status"] = ("timed out" if rc == 124 else "failed" if not ok else
                               "skipped" if stage.get("skipped_because") else "passed")
            if stage["status"] in ("timed out", "failed") and last_cases(text):
                stage["last_cases"] = last_cases(text)
        results["stages"].append(stage)
        save()
    save()
    print(f"gpu_check: {'PASSED' if results['passed'] else 'FAILED'}; wrote {out} "
          f"and {js}" + (f" (and each stage's log) in {logs}" if args.outdir else ""),
          flush=True)
    return 0 if results["passed"] else 1


def bench_skips(path: Path) -> list[str]:
    """The benchmark's columns that did not run (a check that measured nothing fails)."""
    if not path.exists():
        return ["no results were written"]
    doc = json.loads(path.read_text())
    return sorted({f"{r['column']}: {r.get('reason')}" for r in doc.get("results", [])
                   if r.get("status") in ("skipped", "error")})


def report(r: dict) -> str:
    """docs/gpu-results.md, from the JSON: per stage what ran, where, and its result."""
    v = r.get("versions") or {}
    verdict = "all stages passed" if r.get("passed") else "FAILED"
    lines = [
        "# ringcomm on a GPU: results of scripts/gpu_check.sh",
        "",
        "<!-- generated by scripts/gpu_check.py from docs/data/gpu_check.json -->",
        "",
        f"Run {r['started']}{' (--fake: CPU tensors, no GPU)' if r.get('fake') else ''}: "
        f"**{verdict}**.",
        "",
        f"- GPU(s): {', '.join(v.get('gpus') or []) or 'none'}",
        f"- torch {v.get('torch')} (CUDA {v.get('torch_cuda')}, NCCL {v.get('nccl_torch')}), "
        f"CuPy {v.get('cupy')} (NCCL {v.get('nccl_cupy')}), Python {v.get('python')}",
        f"- two ranks on one GPU: {r.get('two_ranks_on_one_gpu', 'not decided')}",
    ]
    settings = r.get("settings") or {}
    if "NCCL_LAUNCH_ORDER_IMPLICIT" in settings:
        lines.append(f"- NCCL_LAUNCH_ORDER_IMPLICIT={settings['NCCL_LAUNCH_ORDER_IMPLICIT']} "
                     f"({settings.get('NCCL_LAUNCH_ORDER_IMPLICIT_from', 'set')}): from NCCL "
                     "2.26 it makes the host's issue order the launch order across communicators")
    lines += [
        "",
        "| stage | proves | result | checks | time |",
        "|---|---|---|---:|---:|",
    ]
    for st in r["stages"]:
        checks = st.get("checks", "")
        took = f"{st['seconds']:.0f} s of {st.get('deadline_s', 0):.0f}" if "seconds" in st else "-"
        result = st["status"] + (f" ({st['detail']})" if st.get("detail") else "")
        if st.get("failures"):
            result += f": {len(st['failures'])} failures"
        lines.append(f"| {st['name']} | {st.get('proves', '')} | {result} | {checks} | {took} |")
    for st in r["stages"]:
        extra = []
        if st.get("failures"):
            extra += ["Failures:", "", *(f"- {f}" for f in st["failures"][:40]), ""]
        if st.get("notes"):
            extra += [*(f"- {n}" for n in st["notes"]), ""]
        if st.get("nccl_warnings"):
            extra += ["NCCL's warnings:", "", "```", *st["nccl_warnings"], "```", ""]
        if st.get("skipped"):
            extra += ["Columns that did not run: " + "; ".join(st["skipped"]), ""]
        if st.get("markdown"):
            extra += [st["markdown"].rstrip(), ""]
        if st.get("last_cases"):
            extra += ["The case each rank started last: " + "; ".join(
                f"rank {rank}: {c}" for rank, c in st["last_cases"].items()), ""]
        if st["status"] not in ("passed", "not run") and st.get("log_tail"):
            # a hung stage's end is every rank's stacks, then torchrun's own traceback
            keep = 150 if st["status"] == "timed out" else 40
            extra += ["Its output (the end):", "", "```",
                      *st["log_tail"].splitlines()[-keep:], "```", ""]
        if extra:
            lines += ["", f"## {st['name']}", "", *extra]
    return "\n".join(lines).rstrip() + "\n"


# -- the per-rank part ---------------------------------------------------------------

#: this stage's process-group timeout (``--timeout``), for every group a worker makes
GROUP_TIMEOUT: datetime.timedelta | None = None


def arm_stack_dumps() -> None:
    """In a stage's process: on SIGUSR1 (the driver's, at the deadline) print the
    stack of every thread to stderr, which is the stage's log; and print them once
    by itself a little before the deadline (``GPU_CHECK_DEADLINE``), which needs no
    driver (one killed by gpu_check.sh's outer timeout sends nothing). faulthandler
    prints from C, so a thread stuck in NCCL or CUDA holding the GIL still shows."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    deadline = os.environ.get(DEADLINE)
    if deadline:
        ahead = float(deadline) - time.time() - DUMP_AHEAD_S
        if ahead > 0.5:  # else the driver's SIGUSR1 comes about as soon
            faulthandler.dump_traceback_later(ahead, exit=False, repeat=False)


def say(line: str) -> None:
    """Print one line in one write: the ranks share the log, and print() writes the
    line and its end apart, so two ranks' lines would run together."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def case(name: str) -> None:
    """Say which case this rank starts now: a hang's log then ends with it."""
    say(f"rank {os.environ.get('RANK', '0')}: case {name}")


def new_group(**kw: Any) -> Any:
    """``dist.new_group`` with this stage's timeout (torch's default is 30 minutes)."""
    import torch.distributed as dist

    return dist.new_group(timeout=GROUP_TIMEOUT, **kw)


class Named:
    """A ringcomm process group that says which collective and algorithm
    ``check_collectives`` starts: it calls ``set_algorithm(coll, name)`` before each
    call and ``set_algorithm(coll, "auto")`` after it, so every other call is a
    start. One line per collective and algorithm, not per dtype and op."""

    def __init__(self, pg: Any, label: str):
        self._pg, self._label = pg, label
        self._last: tuple[str, str] | None = None
        self._started = False

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._pg, attr)

    def set_algorithm(self, coll: str, name: str) -> None:
        self._started = not self._started
        if self._started and (coll, name) != self._last:
            self._last = (coll, name)
            case(f"{self._label}{coll}[{name}]")
        self._pg.set_algorithm(coll, name)


def worker(args: argparse.Namespace) -> int:
    """One rank of one stage: runs the stage's checks, rank 0 writes the JSON."""
    global GROUP_TIMEOUT
    arm_stack_dumps()  # first: a hang in the set-up below shows too
    rank = int(os.environ.get("RANK", "0"))
    if args.timeout:
        GROUP_TIMEOUT = datetime.timedelta(seconds=args.timeout)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests" / "ranks"))
    from ringcomm.bench.columns import host_id_per_rank

    host_id_per_rank()  # before NCCL starts
    import torch
    import torch.distributed as dist

    import ringcomm  # registers the backend

    if args.fake:
        device = torch.device("cpu")
        dist.init_process_group("ringcomm", timeout=GROUP_TIMEOUT)
    else:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        # torch's GPU idiom: the group bound to this rank's device, its NCCL
        # communicators made at once (eager_connect_single_device)
        dist.init_process_group("ringcomm", device_id=device, timeout=GROUP_TIMEOUT)
    left = float(os.environ.get(DEADLINE, "nan")) - time.time()
    say(f"rank {rank}: group timeout {ringcomm.get_group().timeout_s:g} s, the stage's "
        f"deadline in {left:.0f} s")
    peer = reference_group(new_group, args.fake)
    failures: list[str] = []
    notes: list[str] = []
    t0 = time.monotonic()
    if args.hang:  # for the driver's own test: a stage that never ends
        time.sleep(3600)
    checks = STAGE_CHECKS[args.stage](device, peer, failures, notes, args.fake)
    if device.type == "cuda":
        torch.cuda.synchronize()
    took = time.monotonic() - t0
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"checks": checks, "failures": failures, "notes": notes},
                           group=new_group(backend="gloo"))
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps({
            "checks": sum(e["checks"] for e in every),
            "failures": [f"rank {r}: {f}" for r, e in enumerate(every) for f in e["failures"]],
            "notes": every[0]["notes"], "worker_seconds": round(took, 1),
            "skipped_because": next((n for n in every[0]["notes"] if n.startswith("skipped")),
                                    None)}, indent=1))
    say(f"rank {rank}: {args.stage}: {checks} checks, {len(failures)} failed, {took:.1f}s")
    for f in failures[:40]:
        say(f"rank {rank}: FAIL {f}")
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()  # done: no stacks in a passed stage's log
    return 1 if failures else 0


def reference_group(new_group, fake: bool):
    """The reference backend's group, made as a user makes it: ``new_group(backend=
    "nccl")`` from the default ringcomm group bound to this rank's device. On CPU
    (``--fake``) the same torch path runs with the default group bound by hand and
    torch's NCCL backend stood in for by a gloo group that refuses what
    ``ProcessGroupNCCL`` refuses (``ringcomm.testing.torch_nccl``)."""
    if not fake:
        return new_group(backend="nccl")
    import torch
    import torch.distributed as dist

    from ringcomm.testing import torch_nccl

    torch_nccl.install()  # for the worker's life: the group's calls run on it
    world = dist.group.WORLD
    world.bound_device_id = torch.device("cuda", 0)  # as device_id= binds it on a GPU
    try:
        return new_group(backend="nccl")
    finally:
        world.bound_device_id = None


def allreduce_stage(device, peer, failures, notes, fake) -> int:
    """One allreduce of every algorithm, 4 KiB and 1 MiB, against one process."""
    import torch
    import torch.distributed as dist

    import ringcomm

    p, me = dist.get_world_size(), dist.get_rank()
    checks = 0
    for name in sorted(ringcomm.REGISTRY["allreduce"]):
        ringcomm.set_algorithm("allreduce", name)
        try:
            for n in (1024, 1 << 18):
                case(f"allreduce[{name}] n={n}")
                t = torch.full((n,), float(me + 1), device=device)
                try:
                    dist.all_reduce(t)
                except ValueError as e:  # refused before running (native without it)
                    notes.append(f"allreduce[{name}]: refused: {e}"[:160])
                    break
                checks += 1
                if not torch.equal(t, torch.full_like(t, p * (p + 1) / 2)):
                    failures.append(f"allreduce[{name}] n={n}: {t[:3].tolist()}")
        finally:
            ringcomm.set_algorithm("allreduce", "auto")
    return checks


def collectives_stage(device, peer, failures, notes, fake) -> int:
    import torch
    import torch.distributed as dist

    import ringcomm
    from ringcomm.testing import check_collectives, nccl_groups

    checks = 0
    try:
        checks += check_collectives(Named(ringcomm.get_group(), "1 channel: "), device)
    except AssertionError as e:
        failures += str(e).splitlines()[1:]
    two = new_group(backend="ringcomm", pg_options=ringcomm.Options(num_channels=2))
    try:
        checks += check_collectives(Named(ringcomm.get_group(two), "2 channels: "), device,
                                    dtypes=(torch.float32,), reduce_ops=("SUM", "MAX"))
    except AssertionError as e:
        failures += [f"2 channels: {x}" for x in str(e).splitlines()[1:]]
    checks += against_torch_nccl(peer, device, failures)
    if fake and dist.get_rank() == 0:
        # the NCCL path itself, over the stand-in, on two in-process ranks
        case("FakeNccl: every collective on 2 in-process ranks")
        try:
            checks += sum(nccl_groups(2, lambda pg: check_collectives(pg, "cpu")))
        except RuntimeError as e:
            failures.append(f"FakeNccl: {e}"[:300])
    return checks


def device_id_stage(device, peer, failures, notes, fake) -> int:
    import torch.distributed as dist

    case("bound_device_id")
    checks = 1
    bound = dist.group.WORLD.bound_device_id
    want = None if fake else device
    if bound != want:
        failures.append(f"init_process_group(device_id={want}): bound_device_id is {bound}")
    return checks + p2p_and_future_checks(device, failures)


def streams_stage(device, peer, failures, notes, fake) -> int:
    """What only a real stream shows: the caller's stream ordered after the
    collective, synchronize() leaving the CPU free, buffers of an evicted call kept
    until the stream is done with them, channel order on the same tensor."""
    import torch
    import torch.distributed as dist

    import ringcomm

    p = dist.get_world_size()
    checks = 0
    if fake:
        notes.append("skipped: needs CUDA streams (over FakeNccl: tests/test_nccl_faults.py)")
        return 0
    case("Work.wait() orders the caller's stream")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.full((1 << 22,), 3.0, device=device)
        work = dist.all_reduce(t, async_op=True)
        work.wait()  # the side stream now runs after the collective
        t.mul_(2)
    side.synchronize()
    checks += 1
    if not torch.equal(t, torch.full_like(t, 6.0 * p)):
        failures.append("Work.wait() did not order the caller's stream after the allreduce")
    case("synchronize() leaves the CPU free")
    u = torch.ones(1 << 24, device=device)
    work = dist.all_reduce(u, async_op=True)
    t0 = time.monotonic()
    work.synchronize()
    returned = time.monotonic() - t0
    torch.cuda.current_stream().synchronize()
    checks += 1
    if not torch.equal(u, torch.full_like(u, float(p))):
        failures.append("synchronize(): the current stream was not ordered after the allreduce")
    notes.append(f"synchronize() returned after {returned * 1e3:.2f} ms (the stream waits, "
                 "not the CPU)")
    # a call that owns its buffers (allreduce_coalesced), dropped while queued: the
    # caching allocator must not hand its memory out before the stream is done
    case("allreduce_coalesced: the buffers of a dropped call")
    pg = ringcomm.get_group()
    works, expect = [], []
    for k in range(4):
        a = torch.full((1 << 16,), float(k + 1), device=device)
        b = torch.full((1 << 10,), float(k), device=device)
        works.append(dist.all_reduce_coalesced([a, b], async_op=True))
        expect.append((a, b, k))
        pg.calls.clear()  # dropped at once, as at eviction or a refused call
        junk = torch.full((1 << 17,), -7.0, device=device)  # may reuse a freed block
        del junk
    for w in works:
        w.wait()
    for a, b, k in expect:
        checks += 1
        if not (torch.equal(a, torch.full_like(a, float((k + 1) * p)))
                and torch.equal(b, torch.full_like(b, float(k * p)))):
            failures.append(f"allreduce_coalesced #{k}: its buffer was reused while in use")
    case("2 channels: two allreduces of one tensor")
    two = new_group(backend="ringcomm", pg_options=ringcomm.Options(num_channels=2))
    x = torch.ones(1 << 22, device=device)
    first = dist.all_reduce(x, group=two, async_op=True)
    second = dist.all_reduce(x, group=two, async_op=True)
    first.wait()
    second.wait()
    torch.cuda.current_stream().synchronize()
    checks += 1
    if not torch.equal(x, torch.full_like(x, float(p * p))):
        failures.append("2 channels: two allreduces of one tensor overlapped")
    return checks


def frameworks_stage(device, peer, failures, notes, fake) -> int:
    found = ddp_checks(device, failures) + fsdp_check(peer, device, failures)
    notes += found
    return len(found)


def against_torch_nccl(nccl_group, device, failures: list[str]) -> int:
    """Same inputs through ringcomm (every algorithm) and torch's NCCL backend (gloo
    on the CPU, where it reduces the same way)."""
    import torch
    import torch.distributed as dist

    import ringcomm
    from ringcomm.testing.collectives import CHECK_OPS, case_input

    p, me = dist.get_world_size(), dist.get_rank()
    checks, number = 0, 0
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
    refused: set[str] = set()

    def same(what: str, got: torch.Tensor, want: torch.Tensor, op: str) -> None:
        nonlocal checks
        checks += 1
        exact = op != "AVG" or not got.is_floating_point()
        ok = torch.equal(got, want) if exact else torch.allclose(got.double(), want.double(),
                                                                 rtol=1e-2, atol=1e-2)
        if not ok:
            failures.append(f"{what}: differs from torch's nccl (max |diff| "
                            f"{(got.double() - want.double()).abs().max().item():.3g})")

    def both(coll: str, name: str, fn) -> tuple | None:
        ringcomm.set_algorithm(coll, name)
        try:
            mine = fn(None)
        except ValueError:
            return None  # refused before running (e.g. native where NCCL has none)
        finally:
            ringcomm.set_algorithm(coll, "auto")
        try:
            return mine, fn(nccl_group)
        except RuntimeError as e:  # gloo has no AVG of integers, for one
            refused.add(f"{coll} {e}"[:120])
            return None

    for coll in ("allreduce", "broadcast", "allgather", "reduce_scatter"):
        for name in sorted(ringcomm.REGISTRY[coll]):
            for dtype in dtypes:
                for op in (CHECK_OPS if coll in ("allreduce", "reduce_scatter") else ("SUM",)):
                    case(f"vs the reference: {coll}[{name}] "
                         f"{str(dtype).removeprefix('torch.')} {op}")
                    number += 1
                    n = 1000 * p
                    x = case_input(me, number, n, dtype, op).to(device)
                    rop = getattr(dist.ReduceOp, op)

                    def call(group, x=x, rop=rop, coll=coll):
                        t = x.clone()
                        if coll == "allreduce":
                            dist.all_reduce(t, op=rop, group=group)
                            return t
                        if coll == "broadcast":
                            dist.broadcast(t, src=p - 1, group=group)
                            return t
                        if coll == "allgather":
                            out = torch.empty(n * p, dtype=t.dtype, device=device)
                            dist.all_gather_into_tensor(out, t, group=group)
                            return out
                        out = torch.empty(n // p, dtype=t.dtype, device=device)
                        dist.reduce_scatter_tensor(out, t, op=rop, group=group)
                        return out

                    got = both(coll, name, call)
                    if got is not None:
                        same(f"{coll}[{name}] {dtype} {op}", got[0], got[1], op)
    if refused:
        say(f"the reference backend refused: {sorted(refused)}")
    return checks


def p2p_and_future_checks(device, failures: list[str]) -> int:
    """send/recv between ranks 0 and 1 (a two-rank NCCL communicator of the pair),
    fp32, bf16 and an empty tensor; a ``then`` callback on a CUDA collective's future."""
    import torch
    import torch.distributed as dist

    rank, p = dist.get_rank(), dist.get_world_size()
    checks = 0
    if p >= 2 and rank < 2:
        peer = 1 - rank
        for dtype in (torch.float32, torch.bfloat16):
            for n in (0, 5, 1 << 20):
                case(f"send/recv {str(dtype).removeprefix('torch.')} n={n}")
                mine = torch.full((n,), float(rank + 1), dtype=dtype, device=device)
                got = torch.zeros(n, dtype=dtype, device=device)
                if rank == 0:  # one side sends first: no pair waits on itself
                    dist.send(mine, peer)
                    dist.recv(got, peer)
                else:
                    dist.recv(got, peer)
                    dist.send(mine, peer)
                checks += 1
                if not torch.equal(got, torch.full_like(got, float(peer + 1))):
                    failures.append(f"send/recv {dtype} n={n}: got {got[:4].tolist()}")
    case("then() on an allreduce's future")
    t = torch.full((1000,), float(rank + 1), device=device)
    fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    want = float(p * (p + 1))
    checks += 1
    if not torch.equal(fut.wait(), torch.full_like(t, want)):
        failures.append(f"then() on an allreduce future: {fut.wait()[:4].tolist()}, want {want}")
    return checks


def ddp_checks(device, failures: list[str]) -> list[str]:
    """ringcomm's DDP and torch's DDP over ringcomm, on CUDA, against one process
    training on the whole batch."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from _ddp_common import grads, lm_batch, lm_loss, params, rank_slice, sgd, tiny_lm
    from ddp import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    notes = []
    for label, wrap in (("ringcomm ddp", lambda m: DDP(m, bucket_cap_mb=0.01)),
                        ("torch DDP", lambda m: TorchDDP(
                            m, device_ids=[device.index] if device.type == "cuda" else None,
                            bucket_cap_mb=0.01))):
        case(f"{label} vs one process")
        oracle = tiny_lm(seed=1000, dtype=torch.float32).to(device)
        model = tiny_lm(seed=1000 + rank, dtype=torch.float32).to(device)
        ddp = wrap(model)
        opt, opt_o = sgd(ddp), sgd(oracle)
        worst = 0.0
        for step in range(3):
            tokens, targets = (t.to(device) for t in lm_batch(seed=50 + step, n=2 * world))
            opt_o.zero_grad()
            lm_loss(oracle(tokens), targets).backward()
            opt.zero_grad()
            lm_loss(ddp(rank_slice(tokens, rank, world)),
                    rank_slice(targets, rank, world)).backward()
            for name, g in grads(model).items():
                w = grads(oracle)[name]
                worst = max(worst, (g.double() - w.double()).abs().max().item())
            opt.step()
            opt_o.step()
        for name, prm in params(model).items():
            worst = max(worst, (prm.double() - params(oracle)[name].double()).abs().max().item())
        ok = worst < 1e-4
        if not ok:
            failures.append(f"{label}: gradients/parameters differ from one process by {worst:.3g}")
        notes.append(f"{label}: {'ok' if ok else 'FAILED'} (max |diff| {worst:.1e})")
    return notes


def fsdp_check(nccl_group, device, failures: list[str]) -> list[str]:
    """FSDP2 (bf16 mixed precision) on a CUDA mesh: ringcomm against torch's nccl."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def train(group) -> list:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)
        mesh = DeviceMesh.from_group(group, device.type)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(10 * dist.get_rank() + step)
            model(torch.randn(4, 32, generator=g).to(device)).float().sum().backward()
            opt.step()
            opt.zero_grad()
        return [p.full_tensor().detach().float() for p in model.parameters()]

    case("FSDP2 bf16 over ringcomm")
    ours = train(dist.group.WORLD)
    case("FSDP2 bf16 over the reference")
    ref = train(nccl_group)
    worst = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    ok = worst < 1e-3  # bf16 compute; the reductions may round in another order
    if not ok:
        failures.append(f"FSDP2 bf16 on CUDA: parameters differ from torch's nccl by {worst:.3g}")
    return [f"FSDP2 bf16 vs nccl: {'ok' if ok else 'FAILED'} (max |diff| {worst:.1e})"]



STAGE_CHECKS = {"allreduce": allreduce_stage, "collectives": collectives_stage,
                "device_id": device_id_stage, "streams": streams_stage,
                "frameworks": frameworks_stage}


def main() -> int:
    if sys.argv[1:2] == ["--bench"]:
        # the bench stage's ranks: ringcomm.bench with its own command line, after
        # arming the stack dumps the workers have
        arm_stack_dumps()
        sys.path.insert(0, str(ROOT))
        from ringcomm.bench.cli import main as bench

        return bench(sys.argv[2:], prog="python -m ringcomm.bench")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--hang", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, help=argparse.SUPPRESS)  # the groups' (s)
    ap.add_argument("--versions", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--outdir",
                    help="one folder for everything it writes: gpu_check.json, "
                         "gpu-results.md, each stage's part files and whole log "
                         "(<stage>.log); replaces --out and --data")
    ap.add_argument("--out", help="where to write the report (default docs/gpu-results.md)")
    ap.add_argument("--data", help="where the JSON goes (default docs/data)")
    ap.add_argument("--budget", type=float, default=BUDGET_S,
                    help=f"seconds for the whole check (default {BUDGET_S:g})")
    ap.add_argument("--stages", default="",
                    help="comma list of stages to run (default all: "
                         + ",".join(s[0] for s in STAGES) + ")")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply every stage's deadline (a slow machine)")
    ap.add_argument("--fake", action="store_true",
                    help="no GPU: CPU tensors, gloo as the reference, FakeNccl in-process")
    ap.add_argument("--hang-stage", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.versions:
        arm_stack_dumps()
        print(json.dumps(versions(args.fake)))
        return 0
    if args.worker:
        return worker(args)
    if args.outdir and (args.out or args.data):
        ap.error("--outdir puts the report and the JSON in one folder: give it, or "
                 "--out and --data, not both")
    # relative paths are the caller's, though gpu_check.sh runs this from the repository
    here = Path(os.environ.get(CALLER_DIR) or os.getcwd())
    for attr in ("outdir", "out", "data"):
        if getattr(args, attr):
            setattr(args, attr, str(here / getattr(args, attr)))
    args.out = args.out or str(ROOT / "docs" / "gpu-results.md")
    args.data = args.data or str(ROOT / "docs" / "data")
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
