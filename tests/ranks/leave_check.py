"""Per-rank program: a rank leaves while rank 0 waits on it in a collective.

Usage: mpiexec -n N python leave_check.py HOW [DELAYS]

HOW is how the last rank leaves after one allreduce, while the other ranks call
the next one: ``raise`` (an uncaught ValueError), ``exit`` (``sys.exit(3)``),
``end`` (the script ends, exit code 0), ``thread`` (a thread of its raises, then
the script ends), ``os_exit`` (``os._exit(4)``), ``sigterm``, ``sigkill``. It first
prints ``leaving: <time.time()>``. Each waiting rank prints one line
``left: {"rank": r, "seconds": s, "error": "..."}`` with what its allreduce raised
and after how long, then raises it (as a training script would).

HOW ``normal`` with DELAYS (a comma list, one per rank): every rank runs the same
collectives, sleeps its delay and ends normally; ``ended: r`` per rank.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

import ringcomm  # noqa: F401

dist.init_process_group("ringcomm")
rank, p = dist.get_rank(), dist.get_world_size()
how = sys.argv[1]
for n in (10, 1000, 1 << 18):
    dist.all_reduce(torch.ones(n))
def say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write: the ranks share the pipe
    sys.stdout.flush()


if how == "normal":
    time.sleep(float(sys.argv[2].split(",")[rank]))
    say(f"ended: {rank}")
    sys.exit(0)
if rank == p - 1:
    say(f"leaving: {time.time()}")  # when it left, by the clock every local rank shares
    if how == "raise":
        raise ValueError("bad batch")  # the tests name its line
    if how == "exit":
        sys.exit(3)
    if how == "thread":  # its data loader's thread dies; the script then ends
        loader = threading.Thread(target=lambda: int("loader died"), name="loader")
        loader.start()
        loader.join()
    if how == "os_exit":
        os._exit(4)
    if how in ("sigterm", "sigkill"):
        os.kill(os.getpid(), signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        time.sleep(5)
    # "end": the script just ends
else:
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1000))
    except Exception as e:
        say("left: " + json.dumps({"rank": rank, "seconds": round(time.monotonic() - t0, 3),
                                   "error": str(e)}))
        raise
    say("left: " + json.dumps({"rank": rank, "error": None}))
