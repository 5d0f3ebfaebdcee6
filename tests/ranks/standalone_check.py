"""Per-rank program: standalone groups (ringcomm.connect_group) beside a ringcomm world
group, as torchft makes its replica groups: connected afresh over a store of their
own, with other rank orders, several in one process, released, and the world group
untouched by them; made on a second thread while the world group's collectives run on
the main one (torchft configures from its quorum thread); and a set-up whose member
stops after meeting the others fails within its limit, leaving the world group
working.

Usage: standalone_check.py   (2 or more ranks, under mpiexec or torchrun)
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm
from _common import Checker
from ringcomm.launch import hosts


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

    # groups made and used on a second thread while the world group runs on this one
    made: list[str] = []

    def quorums() -> None:
        try:
            for q in range(4):
                pg = ringcomm.connect_group(dist.PrefixStore(f"quorum-{q}", store),
                                            (rank + q) % size, size, timedelta(seconds=30))
                got = allreduce(pg, torch.full((5000,), rank + 1.0))
                made.append("ok" if bool((got == want).all()) else f"quorum {q}: {got[0]}")
                pg.shutdown()
        except Exception as e:  # noqa: BLE001  (reported by the main thread)
            made.append(f"{type(e).__name__}: {e}")

    worker = threading.Thread(target=quorums)
    worker.start()
    rounds, wrong, busy = 0, [], True
    while busy or rounds < 20:  # as many rounds on every rank: until no thread works
        got = torch.full((3001,), float(rank + rounds))
        got[-1] = float(worker.is_alive())
        dist.all_reduce(got)
        busy = got[-1].item() > 0
        if not bool((got[:-1] == want - size + size * rounds).all()):
            wrong.append((rounds, got[0].item()))
        rounds += 1
    worker.join()
    c.check(made == ["ok"] * 4, f"groups made beside the world's collectives: {made}")
    c.check(not wrong, f"world allreduces beside the groups' set-up: {wrong[:3]}")

    # a member that met the others at the store but never reaches MPI: the others' set-up
    # fails within the limit (3 s here, for the host layout only), releasing what it made
    real = hosts.host_layout

    def stops(*args, **kwargs):
        raise RuntimeError("this member stops before the host layout")

    def short(comm, world_rank, local_size=0, standalone=False, limit_s=None):
        return real(comm, world_rank, local_size, standalone, 3.0)

    hosts.host_layout = stops if rank == size - 1 else short
    begun = time.monotonic()
    try:
        ringcomm.connect_group(dist.PrefixStore("stuck", store), rank, size,
                               timedelta(seconds=30))
        c.check(False, "a set-up with a member missing succeeded")
    except Exception as e:  # noqa: BLE001
        took = time.monotonic() - begun
        if rank == size - 1:
            c.check("stops before" in str(e), f"the stopping member: {e}")
        else:
            c.check("host layout" in str(e) and "did not complete within 3 s" in str(e),
                    f"a waiting member: {type(e).__name__}: {e}")
            c.check(took < 25, f"the set-up failed only after {took:.1f} s")
    finally:
        hosts.host_layout = real
    got = torch.full((1000,), rank + 1.0)
    dist.all_reduce(got)
    c.check(bool((got == want).all()), f"world after the failed set-up: {got[0].item()}")

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
