"""Where a small allreduce's time goes: the same 4 KiB recursive-doubling allreduce
timed layer by layer, from MPI alone up to ``dist.all_reduce``.

    mpiexec -n 2 python scripts/bench_layers.py --json docs/data/layers_2ranks.json

Each row adds one layer of ringcomm on top of the row before; times are the
maximum over ranks of the best of 5 repetitions of the mean over many calls.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import timeit

import torch
import torch.distributed as dist

import ringcomm
from ringcomm import ops
from ringcomm.executors import run_p2p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--json", help="write the results here (rank 0)")
    a = ap.parse_args(argv)
    dist.init_process_group("ringcomm")
    from mpi4py import MPI

    rank, p = dist.get_rank(), dist.get_world_size()
    if p != 2:
        raise SystemExit("bench_layers: run it on exactly 2 ranks")
    pg = ringcomm.get_group()
    tp = pg.lanes.cpu.tp
    world = ringcomm.bootstrap.world_comm()
    n = a.bytes // 4
    t, s = torch.ones(n), torch.empty(n)
    peer = 1 - rank
    fa = MPI.buffer.fromaddress
    algo = "recursive_doubling"
    plan = pg.planner.plan("allreduce", algo, ringcomm.REGISTRY["allreduce"][algo], (n,), 0,
                           torch.float32)
    views = plan.bind([t], lambda i, k: tp.scratch(i, k, torch.float32))
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    ringcomm.set_algorithm("allreduce", algo)

    def raw_exchange():
        r = tp.comm.Irecv([fa(s.data_ptr(), s.nbytes), MPI.BYTE], peer, 7)
        q = tp.comm.Isend([fa(t.data_ptr(), t.nbytes), MPI.BYTE], peer, 7)
        while not (r.Test() and q.Test()):
            pass

    def tp_exchange():
        tp.wait_all([tp.irecv(s, peer), tp.isend(t, peer)])

    def executor():
        tp.begin("allreduce", 60.0, 5)
        run_p2p(plan, tp, views, ops.SUM)
        tp.end()

    layers = [
        ("MPI's own Allreduce (mpi4py)", lambda: tp.comm.Allreduce(MPI.IN_PLACE, t.numpy())),
        ("one exchange, mpi4py by hand", raw_exchange),
        ("one exchange through the transport", tp_exchange),
        ("the compiled schedule (run_p2p): exchange + add", executor),
        ("the engine (Work, deadline, issue order)",
         lambda: pg.lanes.cpu.engine.submit("allreduce", lambda: run_p2p(plan, tp, views, ops.SUM),
                                   async_op=False, timeout_s=60.0, tag=5)),
        ("ProcessGroupRingcomm.allreduce", lambda: pg.allreduce([t], opts)),
        ("dist.all_reduce", lambda: dist.all_reduce(t)),
    ]
    rows = []
    for name, fn in layers:
        for _ in range(200):
            fn()
        world.Barrier()
        best = min(timeit.repeat(fn, number=a.calls, repeat=5)) / a.calls * 1e6
        rows.append((name, max(world.allgather(best))))
    if rank == 0:
        print(f"| {a.bytes} B allreduce, {algo}, 2 ranks | time per call | added |")
        print("|---|---:|---:|")
        prev = None
        for name, us in rows:
            added = f"{us - prev:+.1f} us" if prev is not None and name != rows[1][0] else ""
            print(f"| {name} | {us:.1f} us | {added} |")
            prev = us
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"schema": "ringcomm.bench_layers/1",
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "bytes": a.bytes, "algorithm": algo, "world_size": p,
                           "rows": [{"layer": k, "time_us": v} for k, v in rows]}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
