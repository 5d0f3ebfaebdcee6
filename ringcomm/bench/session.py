"""This rank's part of a benchmark run, set up once ``init_process_group`` is done:
the world (rank, size, hosts, ranks per node, torch threads), the untimed
exchanges between ranks (:class:`Control`), the columns every rank agreed to run
and their process groups, and the run's metadata (:meth:`Session.meta`).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import socket
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import ringcomm
from ringcomm import settings
from ringcomm.bench import links
from ringcomm.bench.columns import (Calls, Column, mpi_comm, mpi_missing, nccl_needed,
                                    nccl_version, plan_columns)


class Control:
    """The untimed exchanges between ranks (agreeing on columns, iteration counts,
    statistics): over MPI when it is there, else over a gloo group, so the
    benchmark also runs on a GPU machine without an MPI library."""

    def __init__(self, comm: Any, size: int):
        self.comm, self.size = comm, size
        self.group = dist.new_group(backend="gloo") if comm is None else None

    def allgather(self, obj: Any) -> list:
        if self.comm is not None:
            return self.comm.allgather(obj)
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.Barrier()
        else:
            dist.barrier(group=self.group)


class Session:
    """The world, the agreed columns and their calls, on this rank.

    Raises:
        SystemExit: a flag that is wrong for this world (``-r`` not a rank, an
            unknown ``--algos`` name); rank 0 has said why.
        RuntimeError: ranks disagree on the columns, or no MPI communicator spans
            the world.
    """

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.no_mpi = mpi_missing()
        self.rank, self.p = dist.get_rank(), dist.get_world_size()
        self.pg = ringcomm.get_group()
        self.comm = None
        if self.no_mpi is None:
            try:
                self.comm = mpi_comm(self.p)
            except RuntimeError:
                transport = self.pg._options.transport
                if transport == "mpi":
                    raise
                # torchrun with a transport of no MPI: the MPI columns cannot run
                self.no_mpi = (f"no MPI world spans the ranks (the group's transport is "
                               f"{transport}; launch with mpiexec for the mpi columns)")
        self.ctrl = Control(self.comm, self.p)
        self.hosts = self.ctrl.allgather(socket.gethostname())
        self.local_size = self.hosts.count(self.hosts[self.rank])
        self.local_rank = self.hosts[: self.rank].count(self.hosts[self.rank])
        if args.threads == "auto":
            self.threads = max(1, (os.cpu_count() or 1) // self.local_size)
        else:
            self.threads = int(args.threads)
        torch.set_num_threads(self.threads)
        if not 0 <= args.root < self.p:
            raise SystemExit(self.fail(f"-r/--root {args.root} is not a rank of the "
                                       f"{self.p}-rank world"))
        self.columns = self._agreed_columns()
        if args.links == "on" or (args.links == "auto" and len(set(self.hosts)) > 1):
            self.links = links.measure(self.hosts, self.rank)
        else:
            self.links = None
        self.calls = Calls(self.columns, self.comm, args.root, self.p, self.pg.num_channels)
        self.pick_width = max([5] + [len(n) for coll in args.collectives
                                     for n in ringcomm.REGISTRY.get(coll, {})])
        self.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.load_start = loadavg()

    def fail(self, msg: str) -> int:
        """A bad flag found only once the world is known: rank 0 says so; exit status 2."""
        if self.rank == 0:
            print(f"compare_collectives: error: {msg}", file=sys.stderr, flush=True)
        return 2

    def _agreed_columns(self) -> list[Column]:
        try:
            cols = plan_columns(self.args, self.no_mpi, self.local_size)
        except ValueError as e:
            raise SystemExit(self.fail(str(e))) from None
        # Every rank must agree on which columns run (they all call the same collectives).
        mine = [(c.name, c.skipped) for c in cols]
        if self.ctrl.allgather(mine) != [mine] * self.p:
            raise RuntimeError("compare_collectives: ranks disagree on the columns to run "
                               "(different CUDA/gloo availability?)")
        if all(c.skipped for c in cols):
            # an empty table that exits 0 reads as a run; say what is missing instead
            by_reason: dict[str, list[str]] = {}
            for c in cols:
                by_reason.setdefault(c.skipped, []).append(c.name)
            why = "; ".join(f"{', '.join(names)}: {reason}" for reason, names in by_reason.items())
            flag = "--device cuda" if self.args.device == "cuda" else "--algos/--peers"
            raise SystemExit(self.fail(f"{flag}: no column can run here ({why})"))
        if nccl_needed(cols):
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
        return cols

    def meta(self, gamma: dict[str, float], load_end: list[float] | None) -> dict:
        """The run's metadata (the JSON's ``meta``): world, versions, device, ringcomm's
        settings, timing method, load, columns, command line and the measured
        reduction cost ``gamma`` (s/byte per dtype/op)."""
        hosts: dict[str, int] = {}
        for h in self.hosts:
            hosts[h] = hosts.get(h, 0) + 1
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "mpiexec"
        cuda = (torch.cuda.get_device_name(torch.cuda.current_device())
                if torch.cuda.is_available() else None)
        a = self.args
        return {
            "started": self.started, "world_size": self.p, "hosts": hosts, "launcher": launcher,
            "links": self.links,
            "versions": {"ringcomm": ringcomm.__version__, "torch": torch.__version__,
                         "mpi4py": version_of("mpi4py"),
                         "mpi_library": mpi_library() if self.no_mpi is None else self.no_mpi,
                         "cupy": version_of("cupy"), "nccl": nccl_version(),
                         "numpy": np.__version__, "python": platform.python_version()},
            "device": {"cpu": cpu_model(), "cores": os.cpu_count(), "cuda": cuda,
                       "torch_threads_per_rank": self.threads},
            "ringcomm": {"segment_bytes": self.pg.segment_bytes,
                         "num_channels": self.pg.num_channels,
                         "tuning_file": a.tuning or settings.get("RINGCOMM_TUNING"),
                         # the variable as given (its choices are in each row's "auto")
                         "RINGCOMM_ALGO": os.environ.get("RINGCOMM_ALGO")},
            "timing": {"warmup": a.warmup, "iters_min": a.iters, "rounds": a.rounds,
                       # collectives in flight per timed call (time of all of them,
                       # aggregate bandwidths)
                       "concurrent": a.concurrent,
                       # a barrier before each timed call (OSU's method)
                       "barrier_each": a.barrier_each,
                       # --gap: a barrier, then this pause, before each timed call
                       "gap": a.gap,
                       "min_time_s": a.min_time, "max_iters": a.max_iters,
                       "statistic": "max over ranks of the per-rank median"},
            "load_average": {"start": self.load_start, "end": load_end},
            "columns": [dataclasses.asdict(c) for c in self.columns],
            "argv": sys.argv[1:],
            "gamma_s_per_byte": gamma,
        }


def mpi_library() -> str:
    """The first line of the MPI library's version string."""
    from mpi4py import MPI

    return MPI.Get_library_version().splitlines()[0].strip()


def version_of(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - not installed, or not loadable here
        return None


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
