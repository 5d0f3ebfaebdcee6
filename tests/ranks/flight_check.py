"""Per-rank program: the flight recorder explains a hang.

Every rank trains for steps of one allreduce (and, every 10th step, a broadcast and a
send/receive pair between ranks 0 and 1) under a 5 s group timeout. At step
``--stuck-at`` the rank ``--stuck`` stops calling collectives (it sleeps, as a rank
stuck in its data loader would) while the others call the step's allreduce and time
out. Rank 0 first asks for a dump by signal (SIGUSR2) at step 5 and prints
``signal dump: True`` when it is there. Every rank must leave a dump: the waiting ones when their collective fails, the
stuck one when it learns of that failure through the store. Each rank prints
``dumped: <path>`` when its dump is there, then exits 0.

Run with ``TORCH_FR_BUFFER_SIZE`` set and ``TORCH_FR_DUMP_TEMP_FILE`` pointing into
a fresh directory.
"""
from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm  # noqa: F401
from ringcomm.trace import flight

TIMEOUT_S = 5.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stuck", type=int, default=2)
    p.add_argument("--stuck-at", type=int, default=37)
    args = p.parse_args()
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    path = flight.dump_path(rank)
    x = torch.ones(1024)
    for step in range(1, 1000):
        if rank == args.stuck and step == args.stuck_at:
            deadline = time.monotonic() + 3 * TIMEOUT_S
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.1)  # "stuck in its data loader"
            break
        if rank == 0 and step == 5:  # a dump on demand, by signal
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.2)  # the handler runs between the main thread's bytecodes
            print(f"signal dump: {os.path.exists(path)}", flush=True)
            if os.path.exists(path):
                os.remove(path)
        try:
            dist.all_reduce(x)
        except dist.DistBackendError as e:
            print(f"rank {rank} failed at step {step}: {str(e)[:200]}", flush=True)
            break
        if step % 10 == 0:
            dist.broadcast(x, src=0)
            if rank == 0:
                dist.send(torch.ones(4), dst=1)
            elif rank == 1:
                dist.recv(torch.empty(4), src=0)
    # every rank's dump is there (or the time is up) before any rank ends the job
    paths = [flight.dump_path(r) for r in range(dist.get_world_size())]
    deadline = time.monotonic() + 2 * TIMEOUT_S
    while not all(map(os.path.exists, paths)) and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"dumped: {path if os.path.exists(path) else None}", flush=True)


if __name__ == "__main__":
    main()
