"""Per-rank program: a soak of mixed collectives. Every rank draws the same random
sequence: collective, size, dtype, and which of two ringcomm groups (the world and
a second group over the same ranks); every call is asynchronous, handles are
waited out of order in random batches, some results go through ``Future.then``.
Every result is checked against its known value; resident memory after the
warm-up must stay flat.

Prints ``soak: {...}`` (operations, wrong values, memory); docs/reliability.md
uses it. Usage: soak_check.py [operations]
"""
from __future__ import annotations

import json
import random
import sys
import time

import torch
import torch.distributed as dist

import ringcomm  # noqa: F401
from _common import Checker

KINDS = ("allreduce", "broadcast", "allgather", "reduce_scatter", "all_to_all", "barrier")
SIZES = (0, 1, 7, 100, 1000, 10000, 65536)
DTYPES = (torch.float32, torch.int64, torch.bfloat16)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def main() -> None:
    ops = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    warm = ops // 2  # resident memory plateaus only after the first thousand or so
    dist.init_process_group("ringcomm")
    rank, p = dist.get_rank(), dist.get_world_size()
    c = Checker(rank)
    groups = [dist.group.WORLD, dist.new_group(backend="ringcomm")]
    rng = random.Random(20261130)  # the same sequence on every rank
    tri = p * (p + 1) // 2
    pending: list = []
    stats = {"operations": 0, "wrong": 0, "then": 0}
    mem_warm = None

    def settle(k: int) -> None:
        rng.shuffle(pending)  # out of issue order
        for check in pending[:k]:
            if not check():
                stats["wrong"] += 1
        del pending[:k]

    t0 = time.monotonic()
    for i in range(ops):
        g = groups[i % 2]
        kind, n, dtype = rng.choice(KINDS), rng.choice(SIZES), rng.choice(DTYPES)
        v = (torch.arange(n) % 7).to(dtype)
        if kind == "allreduce":
            t = v * (rank + 1)
            w = dist.all_reduce(t, group=g, async_op=True)
            want = v * tri
            if rng.random() < 0.3:  # through a future callback
                fut = w.get_future().then(lambda f: f.value()[0].double().sum().item())
                stats["then"] += 1
                pending.append(lambda fut=fut, s=want.double().sum().item(): fut.wait() == s)
            else:
                pending.append(lambda w=w, t=t, want=want: w.wait() and torch.equal(t, want))
        elif kind == "broadcast":
            root = i % p
            t = v * (rank + 1)
            w = dist.broadcast(t, src=root, group=g, async_op=True)
            pending.append(lambda w=w, t=t, want=v * (root + 1): w.wait() and torch.equal(t, want))
        elif kind == "allgather":
            outs = [torch.empty_like(v) for _ in range(p)]
            w = dist.all_gather(outs, v * (rank + 1), group=g, async_op=True)
            pending.append(lambda w=w, outs=outs, v=v: w.wait() and all(
                torch.equal(o, v * (r + 1)) for r, o in enumerate(outs)))
        elif kind == "reduce_scatter":
            big = torch.cat([v * (rank + 1)] * p)
            out = torch.empty_like(v)
            w = dist.reduce_scatter_tensor(out, big, group=g, async_op=True)
            pending.append(lambda w=w, out=out, want=v * tri: w.wait() and torch.equal(out, want))
        elif kind == "all_to_all":
            big = torch.cat([v * (rank + 1) + j for j in range(p)])
            out = torch.empty_like(big)
            w = dist.all_to_all_single(out, big, group=g, async_op=True)
            want = torch.cat([v * (r + 1) + rank for r in range(p)])
            pending.append(lambda w=w, out=out, want=want: w.wait() and torch.equal(out, want))
        else:
            w = dist.barrier(group=g, async_op=True)
            pending.append(lambda w=w: w.wait())
        stats["operations"] += 1
        if len(pending) >= rng.randint(1, 12):
            settle(rng.randint(1, len(pending)))
        if i == warm:
            settle(len(pending))
            mem_warm = rss_mb()
    settle(len(pending))
    mem_end = rss_mb()
    stats.update(seconds=round(time.monotonic() - t0, 1), ranks=p,
                 rss_mb_after_warmup=round(mem_warm, 1), rss_mb_at_end=round(mem_end, 1))
    c.check(stats["wrong"] == 0, f"{stats['wrong']} of {ops} results were wrong")
    c.check(mem_end - mem_warm < 10.0, f"resident memory grew {mem_end - mem_warm:.1f} MB "
                                       f"after the warm-up")
    if rank == 0:
        print("soak: " + json.dumps(stats), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    c.finish()


if __name__ == "__main__":
    main()
