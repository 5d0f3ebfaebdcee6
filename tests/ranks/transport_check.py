"""A transport without MPI serves every collective of a ringcomm group, checked
against a single-process oracle; MPI is never started. The transport is
``RINGCOMM_TRANSPORT``'s: ``store`` (a user's own, examples/store_transport.py, the
template of docs/architecture.md's "Writing a transport") or ``tcp`` (ringcomm's).

Modes: ``collectives`` (the world on the store transport, every collective and
algorithm; ``native`` and ``shm_direct`` refused by name), ``stalled`` (rank 1
never reaches the collective: the others time out naming it), ``dies`` (rank 1's
process ends: the others fail naming it, long before the timeout)."""
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
from ringcomm import settings  # noqa: E402
import store_transport  # noqa: E402,F401  (registers "store")
from ringcomm.testing import check_collectives  # noqa: E402


#: the class each transport's group holds
CLASSES = {"store": "StoreTransport", "tcp": "TcpTransport"}


def collectives() -> None:
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    pg = ringcomm.get_group()
    rank = dist.get_rank()
    name = settings.get("RINGCOMM_TRANSPORT")
    tps = [lane.tp for lane in pg.lanes.cpus]
    assert tps and all(type(tp).__name__ == CLASSES[name] for tp in tps), tps
    n = check_collectives(pg, "cpu", dtypes=(torch.float32, torch.int64),
                          reduce_ops=("SUM", "MAX"), numel=37)
    # the user's transport has no collective of its own: each refused, naming the need
    for algo, need in (("native", "collectives of its own"), ("shm_direct", "shared-memory")):
        try:
            with ringcomm.algorithm(algo):
                dist.all_reduce(torch.ones(4))
        except ValueError as e:
            assert algo in str(e) and need in str(e), e
        else:
            raise AssertionError(f"{algo} ran on the {name} transport")
    assert "mpi4py.MPI" not in sys.modules, "MPI was started for a store transport's group"
    # a sentinel-filled receive: every byte of it is written
    t = torch.full((1000,), -1.0)
    if rank == 0:
        t.copy_(torch.arange(1000.0))
    dist.broadcast(t, 0)
    assert torch.equal(t, torch.arange(1000.0)), t
    dist.barrier()
    print(f"rank {rank}: {n} checks passed over the {name} transport", flush=True)
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


def dies() -> None:
    """Rank 1 ends (exit 0, so torchrun lets the others go on) while the others wait
    in an allreduce with it: they learn it at once, not at the timeout."""
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    dist.all_reduce(torch.ones(8))  # every connection is made
    if dist.get_rank() == 1:
        os._exit(0)
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1 << 16))
    except Exception as e:  # noqa: BLE001
        text = str(e)
        assert "rank 1" in text, text
        print(f"rank {dist.get_rank()}: failed naming rank 1 after "
              f"{time.monotonic() - began:.1f} s: {text.splitlines()[0]}", flush=True)
        os._exit(0)
    raise AssertionError("an allreduce with a rank gone completed")


if __name__ == "__main__":
    {"collectives": collectives, "stalled": stalled, "dies": dies}[sys.argv[1]]()
