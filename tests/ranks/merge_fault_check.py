"""Per-rank program: a member that met the others but never comes to its merge of the
tree that forms a group (launch/bootstrap.py::_connect_world) is named by every rank
that waited for it, whatever the round, within a few connect limits.

Standalone groups (ringcomm.connect_group) form the way the world does under torchrun:
MPI singletons merged in ceil(log2 p) rounds. On 5 ranks the rounds are (0+1, 2+3),
(0-1 + 2-3), (0-3 + 4): rank 3 missing is seen in round 1 by rank 2, then by ranks 0
and 1 and by rank 4 through rank 2's report; rank 0 missing leaves the port of every
round unpublished; rank 4 missing is seen in the last round only.

A rank whose MPI accept is left waiting for a rank that never came cannot use MPI
again (the call cannot be cancelled): ringcomm ends such a process without
MPI_Finalize (which would wait for that call forever), and mpiexec then ends the job
with a signal's code. So each missing rank is one launch, and every rank prints its
checks before any leaves.

Usage: merge_fault_check.py MISSING   (5 ranks, under mpiexec)
"""
from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch.distributed as dist

import ringcomm
from _common import Checker
from ringcomm.launch import bootstrap

LIMIT_S = 4.0


def main() -> None:
    missing = int(sys.argv[1])
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=120))
    rank, size = dist.get_rank(), dist.get_world_size()
    c = Checker(rank)
    store = dist.PrefixStore(f"without-{missing}", dist.distributed_c10d._get_default_store())
    rounds = len(bootstrap.merge_rounds(size))

    def stays_away(*args, **kwargs):
        # until every other rank has given up on it
        store.wait([f"done/{r}" for r in range(size) if r != rank], timedelta(seconds=120))
        raise RuntimeError("this member never came to its merge")

    if rank == missing:
        bootstrap._connect_world = stays_away
    begun = time.monotonic()
    try:
        ringcomm.connect_group(dist.PrefixStore("group", store), rank, size,
                               timedelta(seconds=LIMIT_S))
        c.check(False, f"a group formed without rank {missing}")
    except Exception as e:  # noqa: BLE001
        took = time.monotonic() - begun
        if rank == missing:
            c.check("never came" in str(e), f"the missing member: {e}")
        else:
            c.check(f"rank {missing} did not join" in str(e) and f"of {rounds}." in str(e),
                    f"without rank {missing}: {type(e).__name__}: {e}")
            # the longest wait is for a round's port, k + 1 limits at most
            c.check(took < (rounds + 1) * LIMIT_S + 2 * bootstrap.REPORT_GRACE_S,
                    f"without rank {missing}: failed only after {took:.1f} s")
            store.set(f"done/{rank}", "1")
    c.finish()
    # every rank has printed before any leaves: one whose MPI accept still waits then
    # ends without MPI_Finalize, and mpiexec ends the others
    store.set(f"printed/{rank}", "1")
    store.wait([f"printed/{r}" for r in range(size)], timedelta(seconds=60))


if __name__ == "__main__":
    main()
