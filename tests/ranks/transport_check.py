"""A transport of a user's own (examples/store_transport.py, the template of
docs/architecture.md's "Writing a transport") serves every collective of a
ringcomm group, checked against a single-process oracle; MPI is never started.

Modes: ``collectives`` (the world on the store transport, every collective and
algorithm; ``native`` and ``shm_direct`` refused by name), ``stalled`` (rank 1
never reaches the collective: the others time out naming it)."""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ringcomm  # noqa: E402
import store_transport  # noqa: E402,F401  (registers "store")
from ringcomm.testing import check_collectives  # noqa: E402


def collectives() -> None:
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    pg = ringcomm.get_group()
    rank = dist.get_rank()
    tps = [lane.tp for lane in pg.lanes.cpus]
    assert tps and all(type(tp).__name__ == "StoreTransport" for tp in tps), tps
    n = check_collectives(pg, "cpu", dtypes=(torch.float32, torch.int64),
                          reduce_ops=("SUM", "MAX"), numel=37)
    # the user's transport has no collective of its own: each refused, naming the need
    for name, need in (("native", "collectives of its own"), ("shm_direct", "shared-memory")):
        try:
            with ringcomm.algorithm(name):
                dist.all_reduce(torch.ones(4))
        except ValueError as e:
            assert name in str(e) and need in str(e), e
        else:
            raise AssertionError(f"{name} ran on the store transport")
    assert "mpi4py.MPI" not in sys.modules, "MPI was started for a store transport's group"
    # a sentinel-filled receive: every byte of it is written
    t = torch.full((1000,), -1.0)
    if rank == 0:
        t.copy_(torch.arange(1000.0))
    dist.broadcast(t, 0)
    assert torch.equal(t, torch.arange(1000.0)), t
    dist.barrier()
    print(f"rank {rank}: {n} checks passed over the store transport", flush=True)
    dist.destroy_process_group()


def stalled() -> None:
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    ringcomm.set_timeout(timedelta(seconds=3))
    if dist.get_rank() == 1:
        time.sleep(8)
        os._exit(0)
    try:
        dist.all_reduce(torch.ones(8))
    except Exception as e:  # noqa: BLE001  (the timeout, whatever torch wraps it in)
        text = str(e)
        assert "rank 1" in text, text
        print(f"rank {dist.get_rank()}: timed out naming rank 1", flush=True)
        os._exit(0)
    raise AssertionError("an allreduce with a missing rank completed")


if __name__ == "__main__":
    {"collectives": collectives, "stalled": stalled}[sys.argv[1]]()
