"""Per-rank program: standalone groups (ringcomm.connect_group) beside a ringcomm world
group, as torchft makes its replica groups: connected afresh over a store of their
own, with other rank orders, several in one process, released, and the world group
untouched by them.

Usage: standalone_check.py   (2 or more ranks, under mpiexec or torchrun)
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm
from _common import Checker


def allreduce(pg, t: torch.Tensor) -> torch.Tensor:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    pg.allreduce([t], opts).wait()
    return t


def main() -> None:
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    c = Checker(rank)
    store = dist.distributed_c10d._get_default_store()
    want = float(size * (size + 1) // 2)

    # ranks in world order, then reversed, then a third group while both live
    first = ringcomm.connect_group(dist.PrefixStore("first", store), rank, size,
                                   timedelta(seconds=30))
    reverse = ringcomm.connect_group(dist.PrefixStore("reverse", store), size - 1 - rank,
                                     size, timedelta(seconds=30))
    c.check(first.rank() == rank and reverse.rank() == size - 1 - rank,
            f"ranks {first.rank()}, {reverse.rank()}")
    for name, pg in (("first", first), ("reverse", reverse)):
        got = allreduce(pg, torch.full((1000,), rank + 1.0))
        c.check(bool((got == want).all()), f"{name}: allreduce gave {got[0].item()}")
    # group rank 0 of the reversed group is the last world rank
    t = torch.full((64,), float(rank))
    reverse.broadcast([t], dist.BroadcastOptions()).wait()
    c.check(bool((t == size - 1).all()), f"reverse: broadcast gave {t[0].item()}")
    third = ringcomm.connect_group(dist.PrefixStore("third", store), rank, size,
                                   timedelta(seconds=30), ringcomm.Options(shared_memory=False))
    got = allreduce(third, torch.full((70000,), rank + 1.0))
    c.check(bool((got == want).all()), f"third: allreduce gave {got[0].item()}")
    first.shutdown()
    reverse.abort()
    third.shutdown()
    try:
        allreduce(first, torch.ones(4))
        c.check(False, "a collective on a shut-down standalone group ran")
    except Exception as e:  # noqa: BLE001
        c.check("shut down" in str(e), f"after shutdown: {type(e).__name__}: {e}")
    # the world group is the one it was
    got = torch.full((1000,), rank + 1.0)
    dist.all_reduce(got)
    c.check(bool((got == want).all()), f"world: allreduce gave {got[0].item()}")

    # bad input names what is wrong, before anything connects
    for args, what in (((store, size, size), f"rank {size} must"), ((store, 0, 0), "size 0 must"),
                       ((store, 0, size, timedelta(0)), "timeout")):
        try:
            ringcomm.connect_group(*args)
            c.check(False, f"connect_group{args[1:]} was accepted")
        except ValueError as e:
            c.check(what in str(e), f"connect_group{args[1:]}: {e}")
    dist.barrier()
    dist.destroy_process_group()
    c.finish()


if __name__ == "__main__":
    main()
