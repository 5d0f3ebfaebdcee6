"""Per-rank program of scripts/bench_world.py: prints ``timing: {rank, imported,
first}`` (wall-clock seconds): when this rank had imported torch, and when its
first allreduce returned (the world formed), then checks the allreduce. Between the
two: ringcomm's import (which starts MPI under mpiexec), ``init_process_group``
(which starts it under torchrun) and the first call."""
from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

imported = time.time()

import ringcomm  # noqa: E402,F401

dist.init_process_group("ringcomm")
x = torch.ones(4)
dist.all_reduce(x)
first = time.time()
assert x[0].item() == dist.get_world_size(), x
print("timing: " + json.dumps({"rank": dist.get_rank(), "imported": imported, "first": first}),
      flush=True)
dist.destroy_process_group()
