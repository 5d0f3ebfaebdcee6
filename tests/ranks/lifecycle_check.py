"""Per-rank program: groups created, broken and destroyed many times leak nothing.

``N`` times (default 100): a new ringcomm group over every rank runs an allreduce;
then rank 0 alone starts an allreduce on it (the others never join) and aborts the
group while it runs; every rank destroys the group. Threads, open file
descriptors, live process groups and transports, and resident memory are compared
between the end of the warm-up (10 groups) and the end. Then a collective after
``destroy_process_group`` must raise a clear error.

Prints one line ``lifecycle: ...`` with the figures (docs/reliability.md uses it).
Usage: lifecycle_check.py [N]
"""
from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm
from _common import Checker

WARM = 10


def usage() -> dict:
    from mpi4py import MPI

    from ringcomm.transport.mpi import MPITransport
    from ringcomm.transport.mpi_requests import limbo

    gc.collect()
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with warnings.catch_warnings():  # isinstance on some of torch's objects warns
        warnings.simplefilter("ignore")
        objs = gc.get_objects()
        groups = sum(isinstance(o, ringcomm.ProcessGroupRingcomm) for o in objs)
        transports = sum(isinstance(o, MPITransport) for o in objs)
        # persistent requests not yet freed (a destroyed group frees its own)
        requests = sum(isinstance(o, MPI.Prequest) and o != MPI.REQUEST_NULL for o in objs)
    return {"threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
            "groups": groups, "transports": transports, "requests": requests,
            "limbo": len(limbo),
            "rss_mb": round(rss_kb / 1024, 1)}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=30))
    rank, p = dist.get_rank(), dist.get_world_size()
    c = Checker(rank)
    wrong, unraised, slow = 0, 0, 0.0
    before = None
    t_start = time.monotonic()
    for i in range(n):
        g = dist.new_group(backend="ringcomm")
        t = torch.full((1000,), float(rank))
        dist.all_reduce(t, group=g)
        wrong += int(not torch.equal(t, torch.full_like(t, float(sum(range(p))))))
        if rank == 0:
            work = dist.all_reduce(torch.ones(1000), group=g, async_op=True)
            time.sleep(0.02)
            t0 = time.monotonic()
            ringcomm.get_group(g).abort()
            try:
                work.wait()
                unraised += 1
            except dist.DistBackendError:
                pass
            slow = max(slow, time.monotonic() - t0)
        dist.destroy_process_group(g)
        if i == WARM - 1:
            before = usage()
    after = usage()
    took = time.monotonic() - t_start
    c.check(wrong == 0, f"{wrong} allreduces on fresh groups were wrong")
    c.check(unraised == 0, f"{unraised} aborted collectives did not raise")
    c.check(slow < 1.0, f"an abort took {slow:.2f}s to end the running collective")
    for key in ("threads", "fds", "groups", "transports", "requests"):
        c.check(after[key] <= before[key], f"{key}: {before[key]} after {WARM} groups, "
                                           f"{after[key]} after {n}")
    c.check(after["limbo"] <= before["limbo"] + 1,
            f"buffers kept for MPI: {before['limbo']} -> {after['limbo']}")
    c.check(after["rss_mb"] - before["rss_mb"] < 5.0,
            f"resident memory grew {after['rss_mb'] - before['rss_mb']:.1f} MB over "
            f"{n - WARM} groups")
    if rank == 0:
        print("lifecycle: " + json.dumps({"groups": n, "ranks": p, "seconds": round(took, 1),
                                          "after_warmup": before, "at_end": after}), flush=True)

    dist.barrier()
    dist.destroy_process_group()
    try:
        dist.all_reduce(torch.ones(2))
        c.check(False, "a collective after destroy_process_group ran")
    except (ValueError, RuntimeError) as e:
        c.check("not been initialized" in str(e) or "not initialized" in str(e),
                f"after destroy_process_group: {e}")
    c.finish()


if __name__ == "__main__":
    main()
