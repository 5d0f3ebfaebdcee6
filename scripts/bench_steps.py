"""What one step of a small collective's short path costs back to back, and after a
pause: each step alone, timed right after a 100 us sleep (the core went idle, as
it does while a training loop waits on something else) and without one.

    python scripts/bench_steps.py --json docs/data/steps_pause.json

After a pause every step of a call costs several times its back-to-back time, in
proportion to the code it runs, not to its data (docs/benchmarks.md, "After a
pause"): so two ways of doing the same thing can cost the same back to back and
differ by microseconds after a pause. The steps come in pairs where the short
path chose one way over another: a 4 KiB copy into the window through numpy or a
memcpy, numpy's add given its output by keyword or by position, a completed Work
made per call or one handed out again. The others are reads a call cannot avoid
(the options torch hands a Python backend, the tensor's size, the lane's lock).

One process, no peers: a step's cost here is its code's, with no other rank in
it. The steps run in turn, ``--rounds`` times, so a slow spell of the machine
touches them all alike; each time is the median of every call of that step.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from ringcomm import ops
from ringcomm.runtime.work import Done

#: the pause before each timed step (us), as ``ringcomm.bench --gap 100``
GAP_US = 100.0


def steps(nbytes: int) -> list[tuple[str, str, object]]:
    """``(group, name, fn)`` of every step, on memory of ``nbytes``."""
    src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    mdst, msrc = memoryview(dst), memoryview(src)
    fdst, fsrc = ops.operand(dst, torch.float32), ops.operand(src, torch.float32)
    fdst[:] = 0
    fsrc[:] = 0
    reduce = ops.serial_reducer(ops.SUM, torch.float32)
    add = np.add
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    t = torch.zeros(nbytes // 4)
    lock = threading.Lock()
    spare = Done("allreduce", None, None)

    def copy_mv():
        mdst[:] = msrc

    def reuse():
        spare._op, spare._value, spare._public = "allreduce", None, None

    def locked():
        if lock.acquire(False):
            lock.release()

    kib = f"{nbytes // 1024} KiB" if nbytes >= 1024 else f"{nbytes} B"
    return [
        ("baseline", "nothing (the timer reads and the call of an empty function)",
         lambda: None),
        ("copy", f"a {kib} copy by numpy (np.copyto)", lambda: np.copyto(dst, src)),
        ("copy", f"a {kib} copy between memoryviews (a memcpy; the window's put)",
         copy_mv),
        ("add", f"a {kib} float add, np.add(a, b, out=a)", lambda: add(fdst, fsrc, out=fdst)),
        ("add", f"a {kib} float add, np.add(a, b, a)", lambda: add(fdst, fsrc, fdst)),
        ("add", "the same add as ringcomm folds (output by position, "
         "floating-point warnings off)", lambda: reduce(fdst, fsrc)),
        ("work", "a completed Work made (ringcomm's Done)",
         lambda: Done("allreduce", None, None)),
        ("work", "the lane's spare Work made complete again", reuse),
        ("reads", "torch's options: hash(opts.reduceOp)", lambda: hash(opts.reduceOp)),
        ("reads", "torch's options: opts.timeout", lambda: opts.timeout),
        ("reads", "torch's options: opts.asyncOp", lambda: opts.asyncOp),
        ("reads", "the tensor's t.numel()", lambda: t.numel()),
        ("reads", "the lane's lock, taken and given back", locked),
    ]


def measure(nbytes: int, calls: int, rounds: int) -> list[dict]:
    """Every step's median time (us) back to back and after the pause."""
    clock = time.perf_counter_ns
    todo = steps(nbytes)
    times = {(name, mode): [] for _, name, _ in todo for mode in ("b2b", "gap")}
    for _ in range(rounds):
        for _, name, fn in todo:
            for mode in ("b2b", "gap"):
                out = times[name, mode]
                for _ in range(calls):
                    if mode == "gap":
                        time.sleep(GAP_US * 1e-6)
                    t0 = clock()
                    fn()
                    out.append((clock() - t0) / 1e3)
    return [{"group": group, "name": name,
             "back_to_back_us": statistics.median(times[name, "b2b"]),
             "after_sleep_us": statistics.median(times[name, "gap"])}
            for group, name, _ in todo]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=4096,
                    help="the copy's and the add's size (default 4096)")
    ap.add_argument("--calls", type=int, default=400, help="calls per step per round")
    ap.add_argument("--rounds", type=int, default=5, help="turns over every step")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    for flag in ("bytes", "calls", "rounds"):
        if getattr(args, flag) < (4 if flag == "bytes" else 1):
            ap.error(f"--{flag} must be at least {4 if flag == 'bytes' else 1}, "
                     f"got {getattr(args, flag)}")
    if args.bytes % 4:
        ap.error(f"--bytes must be a multiple of 4 (a float add), got {args.bytes}")
    torch.set_num_threads(1)
    rows = measure(args.bytes, args.calls, args.rounds)
    doc = {"schema": "ringcomm.bench_steps/1",
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "bytes": args.bytes, "calls": args.calls, "rounds": args.rounds,
           "gap_us": GAP_US, "python": platform.python_version(),
           "numpy": np.__version__, "torch": torch.__version__, "rows": rows}
    width = max(len(r["name"]) for r in rows)
    print(f"{'step':{width}s}  back to back  after a {GAP_US:.0f} us sleep")
    for r in rows:
        print(f"{r['name']:{width}s}  {r['back_to_back_us']:9.2f} us  "
              f"{r['after_sleep_us']:9.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
