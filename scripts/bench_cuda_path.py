"""The Python time of ringcomm's CUDA lane per collective, from ``dist.all_reduce``
to its return, next to torch's dispatch into a process group that does nothing.

The lane runs over :class:`ringcomm.testing.FakeNccl` in its recording mode:
every NCCL call is counted and returns at once, so what is timed is ringcomm's
own path (the prepared call, the stream engine, the program's precomputed
``groupStart``/``send``/``recv``/``groupEnd`` calls and its local reductions),
on CPU tensors, in one process: rank 0 of a group of ``p`` ranks, whose peers
need not exist. A ring allreduce of one segment takes ``2 (p - 1)`` steps, so
the time over several ``p`` gives the cost of one more step.

    python scripts/bench_cuda_path.py --json docs/data/cuda_path.json

Times are the best of 5 repetitions of the mean over many calls.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import timeit
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import ringcomm
from ringcomm.bench.columns import register_null_backend
from ringcomm.front.process_group import ProcessGroupRingcomm
from ringcomm.testing import FakeNccl

BACKEND = "rcrecord"
ALGOS = ("ring", "native")


def _register(size: int, lib: FakeNccl) -> None:
    """A backend whose group is rank 0 of ``size`` over the recording FakeNccl."""

    def create(dist_opts, pg_options):
        store = dist.HashStore()
        for k in range(4):  # the peers that need not exist, for up to 4 channels
            store.add(f"ringcomm/nccl/{k}/arrived", size - 1)
        return ProcessGroupRingcomm(0, size, None, timedelta(seconds=60), pg_options,
                                    f"{BACKEND}-{size}", store=store, cpu_error="not used",
                                    nccl=lib, nccl_device_type="cpu")

    dist.Backend.register_backend(f"{BACKEND}{size}", create, extended_api=True,
                                  devices=["cpu"])


def _time(fn, calls: int) -> float:
    for _ in range(200):
        fn()
    return min(timeit.repeat(fn, number=calls, repeat=5)) / calls * 1e6


def _round_robin(numel: int, calls: int, buckets: int = 8) -> dict:
    """DDP's use of channels (the paper's round-robin groups): a 2-channel group of
    2 ranks, ring allreduces of ``buckets`` distinct bucket tensors in turn; the
    time per call with the channels' issue order per tensor kept, and without."""
    lib = FakeNccl(record=True)
    _register(2, lib)
    group = dist.new_group(backend=f"{BACKEND}2",
                           pg_options=ringcomm.Options(num_channels=2))
    pg = ringcomm.get_group(group)
    pg.set_algorithm("allreduce", "ring")
    bucket_list = [torch.ones(numel) for _ in range(buckets)]
    turn = [0]

    def step():
        turn[0] += 1
        dist.all_reduce(bucket_list[turn[0] % buckets], group=group)

    order = pg.lanes.order
    ordered, unordered = [], []
    for _ in range(3):  # interleaved, so that the machine's drift hits both alike
        pg.lanes.order = order
        ordered.append(_time(step, calls))
        pg.lanes.order = None
        unordered.append(_time(step, calls))
    pg.lanes.order = order
    ordered, unordered = min(ordered), min(unordered)
    return {"channels": 2, "ranks": 2, "buckets": buckets, "ordered_us": ordered,
            "unordered_us": unordered}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--ranks", default="2,4,8", help="group sizes to time (comma list)")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.ranks.split(",")]
    dist.init_process_group(register_null_backend(), store=dist.HashStore(), rank=0,
                            world_size=1)
    t = torch.ones(a.bytes // 4)
    dispatch = _time(lambda: dist.all_reduce(t), a.calls)
    rows = []
    for p in sizes:
        lib = FakeNccl(record=True)
        _register(p, lib)
        group = dist.new_group(backend=f"{BACKEND}{p}")
        pg = ringcomm.get_group(group)
        for algo in ALGOS:
            pg.set_algorithm("allreduce", algo)
            dist.all_reduce(t, group=group)  # prepares the call (and the communicator)
            before = dict(lib.calls)
            dist.all_reduce(t, group=group)
            per_call = {k: v - before.get(k, 0) for k, v in lib.calls.items()
                        if v - before.get(k, 0)}
            us = _time(lambda: dist.all_reduce(t, group=group), a.calls)
            rows.append({"ranks": p, "algorithm": algo, "time_us": us,
                         "steps": per_call.get("groupStart", 0), "nccl_calls": per_call})
    robin = _round_robin(t.numel(), a.calls)
    ring = [r for r in rows if r["algorithm"] == "ring"]
    slope = (float(np.polyfit([r["steps"] for r in ring], [r["time_us"] for r in ring], 1)[0])
             if len(ring) > 1 else None)
    two = next((r for r in ring if r["ranks"] == 2), None)
    print(f"| {a.bytes} B allreduce, CUDA lane over FakeNccl (recording) | ranks | steps | "
          "time per call |")
    print("|---|---:|---:|---:|")
    print(f"| dist.all_reduce into a do-nothing group | | | {dispatch:.1f} us |")
    for r in rows:
        print(f"| ringcomm {r['algorithm']} | {r['ranks']} | {r['steps']} | {r['time_us']:.1f} us |")
    if two is not None:
        print(f"ring on 2 ranks: {two['time_us'] / dispatch:.2f}x the dispatch")
    if slope is not None:
        print(f"each further step: {slope:.2f} us")
    print(f"2 channels, DDP's round robin over {robin['buckets']} buckets: "
          f"{robin['ordered_us']:.1f} us a call keeping issue order per tensor, "
          f"{robin['unordered_us']:.1f} us without")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"schema": "ringcomm.bench_cuda_path/1",
                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "bytes": a.bytes, "dispatch_us": dispatch, "rows": rows,
                       "ring_2ranks_over_dispatch": two["time_us"] / dispatch if two else None,
                       "us_per_step": slope, "round_robin": robin}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
