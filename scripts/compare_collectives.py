#!/usr/bin/env python3
"""Compare collective algorithms side by side: ringcomm's algorithms (ring, tree,
auto, ..., and ``native``, ringcomm's own dispatch into the MPI library's
collective), the MPI library's collective called directly (through mpi4py),
torch's gloo, and NCCL when CUDA is present, in one run.

Run it under a launcher::

    mpiexec -n 2 python scripts/compare_collectives.py -b 4 -e 64M -f 2 -c
    torchrun --nproc-per-node 2 scripts/compare_collectives.py -b 4 -e 64M

Flags follow nccl-tests (-b -e -f -i -n -w -o -d -c -r). Rank 0 prints a header
and one row per size; each algorithm's time is the maximum over ranks of that
rank's median call time. ``--json``, ``--csv`` and ``--plot`` save the results,
the alpha-beta-gamma cost model (scripts/costmodel.py) is fitted per algorithm
and extrapolated to larger world sizes, and ``--write-tuning`` turns the
measured ring/tree crossovers into a tuning file for ringcomm's ``auto``.

``--model-from a.json [b.json ...]`` refits the model from saved results
(several world sizes let it separate per-call overhead from per-message
latency) without launching anything.

The ``floor`` column (allreduce only) is the lower bound for a backend written in
Python over MPI, measured in the same run: the time of ``dist.all_reduce`` into
a process group that does nothing (it returns a completed Work at once) plus the
time of MPI's own Allreduce of the same buffer (the ``mpi`` column), per rank.

The report checks the speed targets listed in ``scripts/targets.json`` (or the
file ``--targets`` names) and says, for each, the measured ratio and whether it
was met; they are in the JSON output too (``analysis.targets``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import costmodel  # noqa: E402  (lives next to this script)

SCHEMA = "ringcomm.compare_collectives/1"
COLLECTIVES = ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall")
REDUCING = {"allreduce", "reduce_scatter"}
#: nccl-tests' bus bandwidth factors: busbw = algbw * factor(p)
BUSBW_FACTOR: dict[str, Callable[[int], float]] = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "alltoall": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
}
#: nccl-tests type names -> torch dtype names; aliases map to these
DTYPE_NAMES = ("int8", "uint8", "int32", "int64", "half", "float", "double", "bfloat16")
DTYPE_ALIASES = {"char": "int8", "int": "int32", "long": "int64", "float16": "half",
                 "fp16": "half", "float32": "float", "fp32": "float", "float64": "double",
                 "fp64": "double", "bf16": "bfloat16"}
OP_NAMES = ("sum", "prod", "max", "min", "avg")
PEER_NAMES = ("mpi", "gloo", "nccl", "floor")
#: the do-nothing backend the floor column dispatches into
NULL_BACKEND = "ccnull"
DEFAULT_TARGETS = str(Path(__file__).resolve().parent / "targets.json")
TARGETS_SCHEMA = "ringcomm.compare_collectives.targets/1"
#: the ProcessGroup method torch's functional API calls for each collective
TORCH_PG_METHOD = {"allreduce": "allreduce", "broadcast": "broadcast", "allgather": "allgather",
                   "reduce_scatter": "reduce_scatter_single", "alltoall": "all_to_all_single"}
DEFAULT_ALGOS = "ring,tree,auto"
#: ringcomm algorithms that are not ringcomm's own schedules (left out of tuning)
NOT_SCHEDULES = ("auto", "native")
LAUNCH_HINT = ("launch it with `mpiexec -n N python scripts/compare_collectives.py ...` or "
               "`torchrun --nproc-per-node N scripts/compare_collectives.py ...`")


# ----------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------
def _env_rank() -> int:
    for var in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if var in os.environ:
            try:
                return int(os.environ[var])
            except ValueError:
                pass
    return 0


class _Parser(argparse.ArgumentParser):
    """Prints usage errors on rank 0 only (every rank parses the same argv)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if _env_rank() == 0:
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``"4"``, ``"64K"``, ``"1M"``, ``"2GiB"`` (K/M/G/T are powers of 1024).

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    m = _SIZE_RE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use bytes with an optional K, M, G or T suffix (e.g. 64M)")
    mult = 1024 ** " kmgt".index((m.group(2) or " ").lower())
    value = float(m.group(1)) * mult
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes")
    return int(value)


def format_size(n: float) -> str:
    """``4096`` -> ``"4 KiB"``; sizes that are not whole units keep bytes."""
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{int(n // mult)} {unit}"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{int(n)} B"


def _names(text: str, valid: Sequence[str], what: str, aliases: dict | None = None) -> list[str]:
    out: list[str] = []
    for item in filter(None, (s.strip().lower() for s in text.split(","))):
        if item == "all":
            out.extend(v for v in valid if v not in out)
            continue
        item = (aliases or {}).get(item, item)
        if item not in valid:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {item!r}; choose from {', '.join(valid)} or all")
        if item not in out:
            out.append(item)
    if not out:
        raise argparse.ArgumentTypeError(f"no {what} given")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (flags in the style of nccl-tests)."""
    p = _Parser(
        prog="compare_collectives.py",
        description="Time ringcomm's collective algorithms against the MPI library's own "
                    "collectives, gloo and NCCL, in one run. " + LAUNCH_HINT[0].upper()
                    + LAUNCH_HINT[1:] + ".",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("sizes and iterations")
    g.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4"),
                   help="smallest message size (bytes, K/M/G suffixes)")
    g.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"),
                   help="largest message size")
    g.add_argument("-f", "--stepfactor", type=float, default=None,
                   help="multiply the size by this between rows (default 2 unless -i)")
    g.add_argument("-i", "--stepbytes", type=parse_size, default=None,
                   help="add this many bytes between rows instead of -f")
    g.add_argument("-n", "--iters", type=int, default=20,
                   help="timed iterations per size and algorithm (at least)")
    g.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations first")
    g.add_argument("--min-time", type=float, default=0.1,
                   help="run more iterations (up to --max-iters) until each point took "
                        "this many seconds; 0 keeps exactly -n")
    g.add_argument("--max-iters", type=int, default=10000,
                   help="cap on iterations per point")
    g.add_argument("--rounds", type=int, default=5,
                   help="split each point's timed calls into this many rounds that visit "
                        "the columns in turn, so background load hits all of them alike")
    g = p.add_argument_group("what to run")
    g.add_argument("--collective", "--coll", default="allreduce",
                   help=f"comma list of {', '.join(COLLECTIVES)}, or all")
    g.add_argument("-o", "--op", default="sum",
                   help=f"reduction op(s) for reducing collectives: {', '.join(OP_NAMES)}, or all")
    g.add_argument("-d", "--dtype", default="float",
                   help=f"data type(s): {', '.join(DTYPE_NAMES)} (aliases fp32, bf16, ...), or all")
    g.add_argument("-r", "--root", type=int, default=0, help="broadcast root rank")
    g.add_argument("-c", "--check", type=int, nargs="?", const=1, default=0, choices=(0, 1),
                   help="check results (-c or -c 1) and count wrong elements")
    g.add_argument("--algos", default=DEFAULT_ALGOS,
                   help="ringcomm algorithms to compare (ring, tree, auto, native, any "
                        "registered name), or all")
    g.add_argument("--peers", default=None,
                   help="other implementations to compare: mpi (the MPI library's own "
                        "collective), gloo, nccl (only with CUDA), floor (allreduce: "
                        "dispatch into a do-nothing process group + mpi's time; needs mpi); "
                        "'none' for none (default: all with --device cpu, nccl with cuda)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where ringcomm's algorithms run: CPU tensors over MPI, or CUDA "
                        "tensors over NCCL (one GPU per rank, or one shared GPU with "
                        "NCCL_MULTI_RANK_GPU_ENABLE=1)")
    g = p.add_argument_group("ringcomm settings")
    g.add_argument("--segment-bytes", type=parse_size, default=None,
                   help="ringcomm pipeline segment size (default: ringcomm's)")
    g.add_argument("--tuning", default=None,
                   help="tuning file for ringcomm's auto (default: $RINGCOMM_TUNING or built-in)")
    g.add_argument("--threads", default="auto",
                   help="torch intra-op threads per rank; auto = cores per node / ranks per node")
    g.add_argument("--timeout", type=float, default=300.0,
                   help="seconds any single collective may take before it fails")
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="FILE", help="write all results and the model as JSON")
    g.add_argument("--csv", metavar="FILE", help="write one CSV row per size and algorithm")
    g.add_argument("--plot", metavar="FILE.png",
                   help="plot busbw and latency against size (matplotlib)")
    g.add_argument("--markdown", metavar="FILE.md",
                   help="write the results as Markdown tables (time and busbw per column)")
    g.add_argument("--write-tuning", metavar="FILE",
                   help="write (or update) a ringcomm tuning file from the measured "
                        "ring/tree crossovers at this world size")
    g.add_argument("--tuning-tolerance", type=float, default=0.05,
                   help="the written tuning switches algorithm only where another is "
                        "faster by more than this fraction (noise is not a crossover)")
    g.add_argument("--predict-ranks", default="8,64",
                   help="world sizes to predict with the cost model ('' for none); the "
                        "features are simulated from the schedules, which takes about a "
                        "second per size at 64 ranks and a minute in all at 256")
    g.add_argument("--predict-sizes", default="4K,1M,64M",
                   help="message sizes shown in the predictions")
    g.add_argument("--no-model", action="store_true", help="skip the cost-model fit")
    g.add_argument("--targets", metavar="JSON", default=DEFAULT_TARGETS,
                   help="speed targets to check (see scripts/targets.json); 'none' for none")
    g.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress on rank 0's stderr (auto: when it is a terminal)")
    g.add_argument("--model-from", nargs="+", metavar="JSON",
                   help="no run: fit the cost model (and --write-tuning) from saved --json "
                        "results, possibly of several world sizes")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate the command line; bad flags exit with a message naming them."""
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        a.collectives = _names(a.collective, COLLECTIVES, "collective",
                               {"all_reduce": "allreduce", "all_gather": "allgather",
                                "reducescatter": "reduce_scatter", "all_to_all": "alltoall",
                                "bcast": "broadcast"})
        a.ops = _names(a.op, OP_NAMES, "reduction op (-o)", {"product": "prod"})
        a.dtypes = _names(a.dtype, DTYPE_NAMES, "data type (-d)", DTYPE_ALIASES)
        a.algo_list = [s.strip() for s in a.algos.split(",") if s.strip()]
        if a.peers is None:
            a.peers = "nccl" if a.device == "cuda" else ",".join(PEER_NAMES)
        if a.peers.strip().lower() in ("", "none"):
            a.peer_list = []
        else:
            a.peer_list = _names(a.peers, PEER_NAMES, "peer (--peers)")
        a.predict_rank_list = [int(x) for x in a.predict_ranks.split(",") if x.strip()]
        a.predict_size_list = [parse_size(x) for x in a.predict_sizes.split(",") if x.strip()]
    except (argparse.ArgumentTypeError, ValueError) as e:
        parser.error(str(e))
    if not a.algo_list and not a.peer_list:
        parser.error("nothing to compare: --algos and --peers are both empty")
    if a.minbytes < 0 or a.maxbytes < 0:
        parser.error("-b/--minbytes and -e/--maxbytes must not be negative")
    if a.minbytes > a.maxbytes:
        parser.error(f"-b/--minbytes ({a.minbytes}) is larger than -e/--maxbytes ({a.maxbytes})")
    if a.stepfactor is not None and a.stepbytes is not None:
        parser.error("give either -f/--stepfactor or -i/--stepbytes, not both")
    if a.stepbytes is None and a.stepfactor is None:
        a.stepfactor = 2.0
    if a.stepfactor is not None and a.stepfactor <= 1 and a.minbytes != a.maxbytes:
        parser.error(f"-f/--stepfactor must be larger than 1, got {a.stepfactor:g}")
    if a.stepbytes is not None and a.stepbytes <= 0 and a.minbytes != a.maxbytes:
        parser.error(f"-i/--stepbytes must be positive, got {a.stepbytes}")
    if a.iters < 1:
        parser.error(f"-n/--iters must be at least 1, got {a.iters}")
    if a.warmup < 0:
        parser.error(f"-w/--warmup must not be negative, got {a.warmup}")
    if a.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {a.rounds}")
    if a.min_time < 0:
        parser.error(f"--min-time must not be negative, got {a.min_time:g}")
    if a.max_iters < a.iters:
        parser.error(f"--max-iters ({a.max_iters}) is below -n/--iters ({a.iters})")
    if a.timeout <= 0:
        parser.error(f"--timeout must be positive, got {a.timeout:g}")
    if a.segment_bytes is not None and a.segment_bytes <= 0:
        parser.error("--segment-bytes must be positive")
    if a.threads != "auto" and not (a.threads.isdigit() and int(a.threads) > 0):
        parser.error(f"--threads must be a positive number or auto, got {a.threads!r}")
    if any(r < 2 for r in a.predict_rank_list):
        parser.error("--predict-ranks must be world sizes of at least 2")
    if not 0 <= a.tuning_tolerance < 1:
        parser.error("--tuning-tolerance must be in [0, 1)")
    if a.targets.strip().lower() in ("", "none"):
        a.targets = None
    elif not os.path.isfile(a.targets):
        parser.error(f"--targets file {a.targets!r} does not exist")
    else:
        try:
            load_targets(a.targets)
        except ValueError as e:
            parser.error(str(e))
    if a.tuning and not os.path.isfile(a.tuning):
        parser.error(f"--tuning file {a.tuning!r} does not exist")
    if a.model_from:
        for f in a.model_from:
            if not os.path.isfile(f):
                parser.error(f"--model-from file {f!r} does not exist")
    return a


def message_sizes(minbytes: int, maxbytes: int, factor: float | None, step: int | None) -> list[int]:
    """The requested sizes from ``minbytes`` to ``maxbytes`` (both included when reached)."""
    sizes, s = [], minbytes
    while s <= maxbytes:
        sizes.append(int(s))
        if minbytes == maxbytes:
            break
        nxt = s + step if step else (s * factor if s > 0 else 1)
        s = max(int(nxt), int(s) + 1)
    return sizes


# ----------------------------------------------------------------------------
# what one row of the table is made of
# ----------------------------------------------------------------------------
@dataclasses.dataclass
class Shape:
    """One message: ``size`` bytes as nccl-tests reports it, ``count`` elements in all."""

    collective: str
    size: int
    count: int
    per_rank: int  # elements each rank contributes / receives per block


def shape_for(collective: str, size: int, esize: int, p: int) -> Shape:
    """Round ``size`` to whole elements (and whole blocks per rank where the
    collective splits the buffer), at least one element per rank."""
    if collective in ("allreduce", "broadcast"):
        count = max(1, size // esize)
        return Shape(collective, count * esize, count, count)
    per = max(1, size // esize // p)
    return Shape(collective, per * p * esize, per * p, per)


def auto_nbytes(collective: str, shape: Shape, esize: int) -> int:
    """The size ringcomm's ``auto`` is asked with: the tensor a rank passes in
    (the whole buffer for allreduce/broadcast/alltoall, one rank's block for
    allgather and reduce_scatter)."""
    if collective in ("allgather", "reduce_scatter"):
        return shape.per_rank * esize
    return shape.count * esize


@dataclasses.dataclass
class Column:
    """One contender: a ringcomm algorithm or another library's collective."""

    name: str            # table heading: ring, tree, auto, native, mpi, gloo, nccl, rc-nccl, floor
    kind: str            # ringcomm | mpi | gloo | nccl | ringcomm-cuda | floor
    algo: str | None     # ringcomm algorithm name (auto included)
    device: str = "cpu"
    skipped: str | None = None  # why this column does not run at all

    def describe(self) -> str:
        if self.kind == "ringcomm" and self.algo == "native":
            return "ringcomm native (its dispatch into the MPI library's collective)"
        return {"ringcomm": f"ringcomm {self.algo}", "mpi": "MPI library collective (mpi4py)",
                "gloo": "torch gloo", "nccl": "torch NCCL",
                "ringcomm-cuda": f"ringcomm {self.algo} on CUDA tensors",
                "floor": "dist.all_reduce into a do-nothing process group + mpi's time "
                         "(the lower bound of a Python backend)"}[self.kind]


@dataclasses.dataclass
class Point:
    """The measurement of one column at one size."""

    column: str
    status: str                      # ok | unsupported | error | skipped
    time_us: float | None = None     # max over ranks of the per-rank median
    algbw: float | None = None       # GB/s
    busbw: float | None = None       # GB/s
    wrong: int | None = None         # wrong elements summed over ranks (None: not checked)
    iters: int | None = None
    rank_median_us: list | None = None
    rank_q25_us: list | None = None
    rank_q75_us: list | None = None
    auto_choice: str | None = None
    reason: str | None = None
    dispatch_us: float | None = None  # floor only: its do-nothing dist.all_reduce part


# ----------------------------------------------------------------------------
# the benchmark (only this part needs MPI and a process group)
# ----------------------------------------------------------------------------
class Bench:
    """Runs the comparison on this rank. Created after ``init_process_group``."""

    def __init__(self, args: argparse.Namespace):
        import numpy as np
        import torch
        import torch.distributed as dist

        import ringcomm

        try:
            from mpi4py import MPI
        except (ImportError, RuntimeError, OSError) as e:  # a GPU machine without MPI
            MPI, self.no_mpi = None, f"MPI cannot be loaded here ({type(e).__name__}: {e})"
        else:
            self.no_mpi = None
        self.np, self.torch, self.dist, self.MPI, self.ringcomm = np, torch, dist, MPI, ringcomm
        self.args = args
        self.rank, self.p = dist.get_rank(), dist.get_world_size()
        self.pg = ringcomm.get_group()
        self.comm = self._mpi_comm() if MPI is not None else None
        self.ctrl = _Control(self.comm, dist, self.p)
        self.hosts = self.ctrl.allgather(socket.gethostname())
        self.local_size = self.hosts.count(self.hosts[self.rank])
        self.local_rank = self.hosts[: self.rank].count(self.hosts[self.rank])
        if args.threads == "auto":
            self.threads = max(1, (os.cpu_count() or 1) // self.local_size)
        else:
            self.threads = int(args.threads)
        torch.set_num_threads(self.threads)
        if not 0 <= args.root < self.p:
            raise SystemExit(self._fail(f"-r/--root {args.root} is not a rank of the "
                                        f"{self.p}-rank world"))
        self.columns = self._columns()
        self.gloo = None
        if any(c.kind == "gloo" and not c.skipped for c in self.columns):
            self.gloo = dist.new_group(backend="gloo")
        self.nccl = None
        if any(c.kind == "nccl" and not c.skipped for c in self.columns):
            self.nccl = dist.new_group(backend="nccl")
        self.null = None
        if any(c.kind == "floor" and not c.skipped for c in self.columns):
            self.null = dist.new_group(backend=register_null_backend())
        self.pick_width = max([5] + [len(n) for coll in args.collectives
                                     for n in self.ringcomm.REGISTRY.get(coll, {})])
        self._unsupported: dict[tuple, str] = {}
        self._ran: set[tuple] = set()
        self._rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self.results: list[dict] = []
        self.gamma: dict[str, float] = {}
        self.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.load_start = _loadavg()

    # -- set-up ----------------------------------------------------------------
    def _fail(self, msg: str) -> int:
        """A bad flag found only once the world is known: rank 0 says so; exit status 2."""
        if self.rank == 0:
            print(f"compare_collectives: error: {msg}", file=sys.stderr, flush=True)
        return 2

    def _mpi_comm(self):
        """A communicator over the same ranks for the MPI library's own collectives."""
        MPI = self.MPI
        if MPI.COMM_WORLD.Get_size() == self.p:
            return MPI.COMM_WORLD.Dup()
        # torchrun: every process is an MPI singleton that ringcomm joined into one
        # communicator for its world group.
        comm = self.ringcomm.bootstrap.world_comm()
        if comm is None or comm.Get_size() != self.p:
            raise RuntimeError("compare_collectives: cannot find an MPI communicator spanning "
                               f"the {self.p} ranks (MPI.COMM_WORLD has "
                               f"{MPI.COMM_WORLD.Get_size()}); " + LAUNCH_HINT)
        return comm.Dup()

    def _columns(self) -> list[Column]:
        torch, dist, args = self.torch, self.dist, self.args
        if args.device == "cuda":
            why = self._cuda_missing()
            cols = [Column(a, "ringcomm-cuda", a, device="cuda", skipped=why)
                    for a in self._algo_names()]
        else:
            cols = [Column(a, "ringcomm", a) for a in self._algo_names()]
        for peer in args.peer_list:
            if peer == "mpi":
                cols.append(Column("mpi", "mpi", None, skipped=self.no_mpi))
            elif peer == "gloo":
                why = None if dist.is_gloo_available() else "torch was built without gloo"
                cols.append(Column("gloo", "gloo", None, skipped=why))
            elif peer == "nccl":
                why = self._cuda_missing() or (None if dist.is_nccl_available()
                                               else "torch was built without NCCL")
                cols.append(Column("nccl", "nccl", None, device="cuda", skipped=why))
                if args.device != "cuda":
                    cols.append(Column("rc-nccl", "ringcomm-cuda", "auto", device="cuda",
                                       skipped=why))
        if "floor" in args.peer_list:
            why = None
            if "allreduce" not in args.collectives:
                why = "measured for allreduce only"
            elif "mpi" not in args.peer_list:
                why = "needs the mpi column (add mpi to --peers)"
            elif args.device == "cuda":
                why = "the floor is for CPU tensors over MPI"
            cols.append(Column("floor", "floor", None, skipped=why or self.no_mpi))
        # Every rank must agree on which columns run (they all call the same collectives).
        mine = [(c.name, c.skipped) for c in cols]
        if self.ctrl.allgather(mine) != [mine] * self.p:
            raise RuntimeError("compare_collectives: ranks disagree on the columns to run "
                               "(different CUDA/gloo availability?)")
        if self.nccl_needed(cols):
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
        return cols

    def _nccl_version(self) -> str | None:
        """The NCCL ringcomm loads through CuPy (None without CuPy)."""
        from ringcomm.transport import nccl
        try:
            return nccl.version(nccl.load())
        except Exception:  # noqa: BLE001 - no CuPy or no NCCL here
            return None

    def _cuda_missing(self) -> str | None:
        """Why CUDA columns cannot run here (None: they can)."""
        torch = self.torch
        if not torch.cuda.is_available():
            return "no CUDA device"
        if torch.cuda.device_count() < self.local_size and not _gpu_sharing():
            return (f"{self.local_size} ranks per node share {torch.cuda.device_count()} GPU(s); "
                    "NCCL needs one GPU per rank (or NCCL_MULTI_RANK_GPU_ENABLE=1 with "
                    "NCCL >= 2.30.3)")
        return None

    @staticmethod
    def nccl_needed(cols: list[Column]) -> bool:
        return any(c.device == "cuda" and not c.skipped for c in cols)

    def _algo_names(self) -> list[str]:
        names: list[str] = []
        for a in self.args.algo_list:
            if a == "all":
                for coll in self.args.collectives:
                    for n in ["auto", *self.ringcomm.REGISTRY.get(coll, {})]:
                        if n not in names:
                            names.append(n)
            elif a not in names:
                names.append(a)
        known = {n for algos in self.ringcomm.REGISTRY.values() for n in algos} | {"auto"}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise SystemExit(self._fail(
                f"--algos names {', '.join(unknown)}, which ringcomm does not have; known: "
                f"{', '.join(sorted(known))}"))
        return names

    # -- buffers and calls -----------------------------------------------------
    def dtype(self, name: str):
        t = self.torch
        return {"int8": t.int8, "uint8": t.uint8, "int32": t.int32, "int64": t.int64,
                "half": t.float16, "float": t.float32, "double": t.float64,
                "bfloat16": t.bfloat16}[name]

    def buffers(self, shape: Shape, dtype, device: str) -> dict:
        """Input/output tensors of one size (reused by every column on ``device``)."""
        torch, p = self.torch, self.p
        z = lambda n: torch.zeros(n, dtype=dtype, device=device)  # noqa: E731
        c = shape.collective
        if c in ("allreduce", "broadcast"):
            buf = z(shape.count)
            return {"inp": buf, "out": buf}
        if c == "allgather":
            out = z(shape.count)
            return {"inp": z(shape.per_rank), "out": out, "outs": list(out.chunk(p))}
        if c == "reduce_scatter":
            return {"inp": z(shape.count), "out": z(shape.per_rank)}
        return {"inp": z(shape.count), "out": z(shape.count)}  # alltoall

    def reduce_op(self, op: str):
        R = self.dist.ReduceOp
        # "none": a collective that does not reduce; the op is not passed on.
        return {"sum": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX, "avg": R.AVG,
                "none": R.SUM}[op]

    def make_call(self, col: Column, coll: str, bufs: dict, op: str) -> Callable[[], None]:
        """A no-argument function that runs one collective of ``col`` on ``bufs``."""
        if col.kind == "mpi":
            return self._mpi_call(coll, bufs, op)
        dist = self.dist
        group = {"gloo": self.gloo, "nccl": self.nccl, "floor": self.null}.get(col.kind)
        rop, root = self.reduce_op(op), self.args.root
        inp, out = bufs["inp"], bufs["out"]
        if coll == "allreduce":
            return lambda: dist.all_reduce(inp, op=rop, group=group)
        if coll == "broadcast":
            return lambda: dist.broadcast(inp, src=root, group=group)
        if coll == "allgather":
            outs = bufs["outs"]
            return lambda: dist.all_gather(outs, inp, group=group)
        if coll == "reduce_scatter":
            rs = self._rs
            return lambda: rs(out, inp, op=rop, group=group)
        return lambda: dist.all_to_all_single(out, inp, group=group)

    def _mpi_call(self, coll: str, bufs: dict, op: str) -> Callable[[], None]:
        MPI, comm, torch, p = self.MPI, self.comm, self.torch, self.p
        inp, out = bufs["inp"], bufs["out"]
        if coll in REDUCING:
            # numpy views of the same tensors; bfloat16 has no numpy (nor MPI) type.
            try:
                ni, no = inp.numpy(), out.numpy()
            except TypeError as e:
                raise NotImplementedError(f"MPI has no reduction for {inp.dtype}") from e
            mop = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX,
                   "avg": MPI.SUM}[op]
            if op == "avg":  # MPI has no average: sum, then divide, as a user would
                div = ((lambda t: t.div_(p)) if out.dtype.is_floating_point
                       else (lambda t: t.copy_(torch.div(t, p, rounding_mode="trunc"))))
            else:
                div = None
            if coll == "allreduce":
                def call():
                    comm.Allreduce(MPI.IN_PLACE, no, op=mop)
                    if div:
                        div(out)
            else:
                def call():
                    comm.Reduce_scatter_block(ni, no, op=mop)
                    if div:
                        div(out)
            return call
        bi, bo = inp.view(torch.uint8).numpy(), out.view(torch.uint8).numpy()
        root = self.args.root
        if coll == "broadcast":
            return lambda: comm.Bcast(bi, root=root)
        if coll == "allgather":
            return lambda: comm.Allgather(bi, bo)
        return lambda: comm.Alltoall(bi, bo)

    # -- correctness -----------------------------------------------------------
    def pattern(self, rank: int, n: int, dtype_name: str, op: str, salt: int = 0):
        """Rank ``rank``'s test data: small integers, exact in every dtype and in
        any sum over few ranks, so the expected result is exact too."""
        np = self.np
        i = np.arange(n, dtype=np.int64)
        if op == "prod":  # products of +-1 (and 1 or 2 on rank 0 for unsigned) stay exact
            if dtype_name == "uint8":
                v = np.where((i + rank) % 5 == 0, 2 if rank == 0 else 1, 1)
            else:
                v = np.where((i * 3 + rank + salt) % 4 == 0, -1, 1)
        elif dtype_name == "uint8":
            v = (i * 3 + rank * 7 + salt) % 11
        else:
            v = (i * 3 + rank * 7 + salt) % 11 - 5
        return v.astype(np.float64)

    def expected_reduction(self, n: int, dtype_name: str, op: str):
        np, p = self.np, self.p
        parts = [self.pattern(r, n, dtype_name, op) for r in range(p)]
        if op in ("sum", "avg"):
            e = np.sum(parts, axis=0)
            if op == "avg":
                e = e / p if dtype_name in ("half", "float", "double", "bfloat16") else np.trunc(e / p)
        elif op == "prod":
            e = np.prod(parts, axis=0)
        elif op == "min":
            e = np.min(parts, axis=0)
        else:
            e = np.max(parts, axis=0)
        if dtype_name == "uint8":
            e = np.mod(e, 256)
        elif dtype_name == "int8":
            e = (e + 128) % 256 - 128
        return e

    def _tensor(self, values, dtype, device: str):
        return self.torch.from_numpy(values).to(dtype=dtype, device=device)

    def check(self, col: Column, coll: str, shape: Shape, dtype_name: str, op: str,
              bufs: dict, call: Callable[[], None], sync: Callable[[], None]) -> int:
        """Run ``call`` once on known data; wrong elements on this rank."""
        np, torch, p, r = self.np, self.torch, self.p, self.rank
        dtype, dev = self.dtype(dtype_name), col.device
        inp, out = bufs["inp"], bufs["out"]
        sentinel = 99
        if coll == "allreduce":
            inp.copy_(self._tensor(self.pattern(r, shape.count, dtype_name, op), dtype, dev))
            expect = self.expected_reduction(shape.count, dtype_name, op)
        elif coll == "broadcast":
            root = self.args.root
            if r == root:
                inp.copy_(self._tensor(self.pattern(root, shape.count, dtype_name, op), dtype, dev))
            else:
                inp.fill_(sentinel)
            expect = self.pattern(root, shape.count, dtype_name, op)
        elif coll == "allgather":
            inp.copy_(self._tensor(self.pattern(r, shape.per_rank, dtype_name, op), dtype, dev))
            out.fill_(sentinel)
            expect = np.concatenate([self.pattern(j, shape.per_rank, dtype_name, op)
                                     for j in range(p)])
        elif coll == "reduce_scatter":
            inp.copy_(self._tensor(self.pattern(r, shape.count, dtype_name, op), dtype, dev))
            out.fill_(sentinel)
            full = self.expected_reduction(shape.count, dtype_name, op)
            expect = full[r * shape.per_rank:(r + 1) * shape.per_rank]
        else:  # alltoall: block j of rank r goes to rank j
            inp.copy_(self._tensor(self.pattern(r, shape.count, dtype_name, op, salt=r), dtype, dev))
            out.fill_(sentinel)
            c = shape.per_rank
            expect = np.concatenate([self.pattern(j, shape.count, dtype_name, op, salt=j)[r * c:(r + 1) * c]
                                     for j in range(p)])
        call()
        sync()
        got = out.detach().to("cpu", torch.float64).numpy()
        if dtype.is_floating_point:
            eps = torch.finfo(dtype).eps
            bad = ~(np.abs(got - expect) <= 2 * eps * np.maximum(1.0, np.abs(expect)))
        else:
            bad = got != expect
        return int(np.count_nonzero(bad))

    # -- timing ----------------------------------------------------------------
    def _select(self, col: Column, coll: str) -> None:
        # ringcomm's columns share one group: pick the column's algorithm before each batch.
        if col.kind in ("ringcomm", "ringcomm-cuda"):
            self.ringcomm.set_algorithm(coll, col.algo)

    def _agree(self, err: str | None) -> str | None:
        """The first error any rank saw (every rank gets the same answer)."""
        errs = [e for e in self.ctrl.allgather(err) if e]
        return errs[0] if errs else None

    def _everywhere(self, fn: Callable[[], Any]) -> tuple[Any, str | None]:
        """Run ``fn``; return its value and the first error any rank saw, so that every
        rank drops a failing column together."""
        value, err = None, None
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        return value, self._agree(err)

    def prepare(self, col: Column, coll: str, shape: Shape, dtype_name: str, op: str,
                bufs: dict) -> "Point | tuple[Callable[[], None], Callable[[], None], int | None]":
        """Check that ``col`` runs this collective (and, with -c, runs it right).

        Returns:
            A Point when the column does not run here (skipped, unsupported, error);
            else ``(call, sync, wrong elements on this rank or None)``.
        """
        key = (col.name, coll, dtype_name, op)
        if col.skipped:
            return Point(col.name, "skipped", reason=col.skipped)
        if key in self._unsupported:
            return Point(col.name, "unsupported", reason=self._unsupported[key])
        static = self.static_unsupported(col, coll, dtype_name)
        if static:
            self._unsupported[key] = static
            return Point(col.name, "unsupported", reason=static)
        sync = self.torch.cuda.synchronize if col.device == "cuda" else _noop
        err: str | None = None
        wrong = None
        call = _noop
        first = key not in self._ran
        try:
            self._select(col, coll)
            call = self.make_call(col, coll, bufs, op)
            if self.args.check and col.kind != "floor":  # the floor computes nothing
                wrong = self.check(col, coll, shape, dtype_name, op, bufs, call, sync)
            else:
                call()
                sync()
        except Exception as e:  # noqa: BLE001 - a column's failure is a result, not a crash
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        err = self._agree(err)  # every rank takes the same branch from here on
        if err and "No backend type associated" in err and col.kind.startswith("ringcomm"):
            # torch's words when the Python process group lacks the method it calls
            method = TORCH_PG_METHOD.get(coll, coll)
            err = f"ringcomm's process group has no {method}() yet (torch: {err})"
        if err:
            # Failing on first use means "not there"; failing later is a real error.
            if first:
                self._unsupported[key] = err
                return Point(col.name, "unsupported", reason=err)
            return Point(col.name, "error", reason=err)
        self._ran.add(key)
        return call, sync, wrong

    def iterations(self, col: Column, coll: str, call: Callable[[], None],
                   sync: Callable[[], None]) -> int:
        """Warm up ``col``, then pick how many calls to time (the same on every rank)."""
        a = self.args
        self._select(col, coll)
        for _ in range(a.warmup):
            call()
        sync()
        iters = a.iters
        if a.min_time > 0:
            t0 = time.perf_counter()
            call()
            sync()
            one = max(time.perf_counter() - t0, 1e-7)
            iters = min(a.max_iters, max(a.iters, math.ceil(a.min_time / one)))
        return max(self.ctrl.allgather(iters))

    def batch(self, col: Column, coll: str, call: Callable[[], None],
              sync: Callable[[], None], n: int) -> "Any":
        """Time ``n`` calls of ``col`` after one untimed call, all ranks starting together."""
        np = self.np
        self._select(col, coll)
        call()  # the first call after another column's may pay for switching
        sync()
        times = np.empty(n)
        clock = time.perf_counter
        self.ctrl.barrier()
        for k in range(n):
            t0 = clock()
            call()
            sync()
            times[k] = clock() - t0
        return times

    def measure_row(self, coll: str, shape: Shape, dtype_name: str, op: str,
                    progress: "Progress") -> dict[str, Point]:
        """Every column at one size. Timed calls run in ``--rounds`` rounds that visit
        the columns in turn (rotating the order), so load from other processes on
        the machine falls on every column alike and the ratios stay fair."""
        np = self.np
        dtype = self.dtype(dtype_name)
        row: dict[str, Point] = {}
        ready: dict[str, tuple] = {}
        bufs_by_dev: dict[str, dict] = {}
        for col in self.columns:
            progress.step(f"{coll} {dtype_name} {format_size(shape.size)} {col.name}")
            if col.device not in bufs_by_dev and not col.skipped:
                bufs_by_dev[col.device] = self.buffers(shape, dtype, col.device)
            got = self.prepare(col, coll, shape, dtype_name, op, bufs_by_dev.get(col.device, {}))
            if isinstance(got, Point):
                row[col.name] = got
            else:
                ready[col.name] = (col, *got)
        for bufs in bufs_by_dev.values():
            for b in bufs.values():
                if hasattr(b, "zero_"):
                    b.zero_()  # neutral data while timing: no overflow, no denormals
        iters: dict[str, int] = {}
        for name, (col, call, sync, _) in list(ready.items()):
            n, err = self._everywhere(lambda: self.iterations(col, coll, call, sync))
            if err:
                row[name] = Point(name, "error", reason=err)
                del ready[name]
            else:
                iters[name] = n
        rounds = max(1, min(self.args.rounds, min(iters.values(), default=1)))
        times: dict[str, list] = {name: [] for name in ready}
        names = list(ready)
        gc.collect()
        gc.disable()  # a collection pause inside one rank stalls all of them
        try:
            for r in range(rounds):
                k = r % len(names) if names else 0
                for name in names[k:] + names[:k]:
                    if name not in ready:
                        continue
                    col, call, sync, _ = ready[name]
                    n = iters[name] // rounds + (1 if r < iters[name] % rounds else 0)
                    ts, err = self._everywhere(lambda: self.batch(col, coll, call, sync, n))
                    if err:
                        row[name] = Point(name, "error", reason=err)
                        del ready[name]
                    else:
                        times[name].append(ts)
        finally:
            gc.enable()
        for name, (col, _, _, wrong) in ready.items():
            ts = np.concatenate(times[name])
            q25, med, q75 = (float(x) * 1e6 for x in np.percentile(ts, [25, 50, 75]))
            everyone = self.ctrl.allgather((q25, med, q75, wrong))  # one exchange for all stats
            q25s, meds, q75s = ([e[i] for e in everyone] for i in range(3))
            if wrong is not None:
                wrong = sum(e[3] for e in everyone)
            t_us = max(meds)
            algbw = shape.size / (t_us * 1e-6) / 1e9
            pt = Point(name, "ok", t_us, algbw, algbw * BUSBW_FACTOR[coll](self.p), wrong,
                       len(ts), meds, q25s, q75s)
            if col.algo == "auto":
                esize = self.torch.empty((), dtype=dtype).element_size()
                self._select(col, coll)  # algorithm_for answers for the current setting
                pt.auto_choice = self.pg.algorithm_for(coll, auto_nbytes(coll, shape, esize))
            row[name] = pt
        for col in self.columns:
            if col.kind == "floor" and row[col.name].status == "ok":
                row[col.name] = floor_point(row[col.name], row.get("mpi"), coll, shape.size,
                                            self.p)
        return {c.name: row[c.name] for c in self.columns}

    def static_unsupported(self, col: Column, coll: str, dtype_name: str) -> str | None:
        """Reasons known without trying (the same on every rank)."""
        if col.kind in ("ringcomm", "ringcomm-cuda") and col.algo != "auto":
            algos = self.ringcomm.REGISTRY.get(coll)
            if algos is not None and col.algo not in algos:
                return (f"ringcomm has no {coll} algorithm {col.algo!r} "
                        f"(has: {', '.join(['auto', *algos])})")
            if algos is None:
                return f"ringcomm has no {coll} algorithms"
        if col.kind in ("mpi", "floor") and coll in REDUCING and dtype_name == "bfloat16":
            return "MPI has no bfloat16 reduction"
        if col.kind == "floor" and coll != "allreduce":
            return "the floor is measured for allreduce only"
        return None

    def gamma_for(self, dtype_name: str, op: str) -> float:
        """Seconds per byte of a local reduction (``dst op= src``), measured here."""
        key = f"{dtype_name}/{op}"
        if key in self.gamma:
            return self.gamma[key]
        torch = self.torch
        dtype = self.dtype(dtype_name)
        esize = torch.empty((), dtype=dtype).element_size()
        f = {"sum": lambda d, s: d.add_(s), "avg": lambda d, s: d.add_(s),
             "prod": lambda d, s: d.mul_(s),
             "min": lambda d, s: torch.minimum(d, s, out=d),
             "max": lambda d, s: torch.maximum(d, s, out=d)}[op]
        samples = []
        top = max(64 << 10, min(self.args.maxbytes, 16 << 20))
        for nbytes in sorted({64 << 10, 1 << 20, top}):
            n = max(1, nbytes // esize)
            d, s = torch.ones(n, dtype=dtype), torch.ones(n, dtype=dtype)
            f(d, s)
            reps = max(3, min(200, (32 << 20) // nbytes))
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                f(d, s)
                ts.append(time.perf_counter() - t0)
            samples.append((self.p, n * esize, float(self.np.median(ts))))
        g = costmodel.fit("local", None, samples, segment_bytes=1).beta
        g = max(self.ctrl.allgather(g))
        self.gamma[key] = g
        return g

    # -- the run ---------------------------------------------------------------
    def run(self) -> None:
        """Measure every (collective, dtype, op, size, column) and print the table."""
        a = self.args
        groups = []
        for coll in a.collectives:
            for dt in a.dtypes:
                for op in (a.ops if coll in REDUCING else ["none"]):
                    groups.append((coll, dt, op))
        sizes = message_sizes(a.minbytes, a.maxbytes, a.stepfactor, a.stepbytes)
        total = len(groups) * len(sizes) * len(self.columns)
        progress = Progress(total, self.rank == 0 and (
            a.progress == "on" or (a.progress == "auto" and sys.stderr.isatty())))
        if self.rank == 0:
            print(self.header_text(), flush=True)
        for coll, dt, op in groups:
            dtype = self.dtype(dt)
            esize = self.torch.empty((), dtype=dtype).element_size()
            shapes, seen = [], set()
            for s in sizes:
                sh = shape_for(coll, s, esize, self.p)
                if sh.size not in seen:
                    seen.add(sh.size)
                    shapes.append(sh)
            if self.rank == 0:
                print(self.table_heading(coll, dt, op), flush=True)
            for sh in shapes:
                row = self.measure_row(coll, sh, dt, op, progress)
                for pt in row.values():
                    self.results.append({
                        "collective": coll, "size": sh.size, "count": sh.count, "dtype": dt,
                        "redop": op, "root": a.root if coll == "broadcast" else -1,
                        **dataclasses.asdict(pt)})
                if self.rank == 0:
                    progress.clear()
                    print(self.table_row(coll, sh, dt, op, row), flush=True)
            if self.rank == 0:
                print(self.table_footer(coll, dt, op), flush=True)
        progress.done()
        self.load_end = _loadavg()
        if not a.no_model:
            for coll, dt, op in groups:
                if coll in REDUCING:
                    self.gamma_for(dt, op)

    # -- output ----------------------------------------------------------------
    def meta(self) -> dict:
        torch, MPI = self.torch, self.MPI
        hosts: dict[str, int] = {}
        for h in self.hosts:
            hosts[h] = hosts.get(h, 0) + 1
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "mpiexec"
        cuda = (torch.cuda.get_device_name(torch.cuda.current_device())
                if torch.cuda.is_available() else None)
        return {
            "started": self.started, "world_size": self.p, "hosts": hosts, "launcher": launcher,
            "versions": {"ringcomm": self.ringcomm.__version__, "torch": torch.__version__,
                         "mpi4py": _version_of("mpi4py"),
                         "mpi_library": (MPI.Get_library_version().splitlines()[0].strip()
                                         if MPI is not None else self.no_mpi),
                         "cupy": _version_of("cupy"), "nccl": self._nccl_version(),
                         "numpy": self.np.__version__, "python": platform.python_version()},
            "device": {"cpu": _cpu_model(), "cores": os.cpu_count(), "cuda": cuda,
                       "torch_threads_per_rank": self.threads},
            "ringcomm": {"segment_bytes": self.pg.segment_bytes,
                         "tuning_file": self.args.tuning or os.environ.get("RINGCOMM_TUNING"),
                         "RINGCOMM_ALGO": os.environ.get("RINGCOMM_ALGO")},
            "timing": {"warmup": self.args.warmup, "iters_min": self.args.iters,
                       "rounds": self.args.rounds,
                       "min_time_s": self.args.min_time, "max_iters": self.args.max_iters,
                       "statistic": "max over ranks of the per-rank median"},
            "load_average": {"start": self.load_start, "end": getattr(self, "load_end", None)},
            "columns": [dataclasses.asdict(c) for c in self.columns],
            "argv": sys.argv[1:],
            "gamma_s_per_byte": self.gamma,
        }

    def header_text(self) -> str:
        m = self.meta()
        v, d = m["versions"], m["device"]
        hosts = ", ".join(f"{h} x{n}" for h, n in m["hosts"].items())
        runs = [c for c in self.columns if not c.skipped]
        skipped = [f"{c.name} ({c.skipped})" for c in self.columns if c.skipped]
        a = self.args
        iters = (f"-n {a.iters}" + (f" or more to fill {a.min_time:g} s (at most {a.max_iters})"
                                    if a.min_time > 0 else ""))
        lines = [
            "# ringcomm compare_collectives " + m["started"],
            f"# world: {self.p} ranks on {len(m['hosts'])} host(s): {hosts}; launcher "
            f"{m['launcher']}",
            f"# versions: ringcomm {v['ringcomm']}, torch {v['torch']}, mpi4py {v['mpi4py']}, "
            f"{v['mpi_library']}, numpy {v['numpy']}, python {v['python']}"
            + (f", cupy {v['cupy']}, NCCL {v['nccl']}" if v["cupy"] else ""),
            f"# device: {d['cpu']}, {d['cores']} cores, torch threads per rank {d['torch_threads_per_rank']}"
            + (f"; CUDA {d['cuda']}" if d["cuda"] else "; no CUDA"),
            f"# ringcomm: segment {format_size(m['ringcomm']['segment_bytes'])}, auto tuning "
            f"{m['ringcomm']['tuning_file'] or 'built-in'}",
            f"# timing: warm-up {a.warmup}, {iters}, in {a.rounds} rounds across the columns; "
            "time = max over ranks of each rank's median; algbw = size/time; "
            "busbw = algbw * nccl-tests factor",
            "# load average at start: " + " ".join(f"{x:.2f}" for x in (m["load_average"]["start"] or [])),
            "# columns: " + "; ".join(f"{c.name} = {c.describe()}" for c in runs),
        ]
        if skipped:
            lines.append("# skipped: " + "; ".join(skipped))
        return "\n".join(lines)

    def table_heading(self, coll: str, dt: str, op: str) -> str:
        cols = [c for c in self.columns if not c.skipped]
        left = f"{'':>12} {'':>12} {'':>8} {'':>6} {'':>5} "
        pw = self.pick_width
        groups = "".join(f" {c.name + (' (pick)' if c.algo == 'auto' else ''):^{_width(c, pw)}}"
                         for c in cols)
        sub1 = "".join(f" {'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6}" +
                       (f" {'pick':>{pw}}" if c.algo == "auto" else "") for c in cols)
        sub2 = "".join(f" {'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}" +
                       (f" {'':>{pw}}" if c.algo == "auto" else "") for c in cols)
        return "\n".join([
            f"#\n# {coll}  dtype {dt}  op {op}  ({self.p} ranks)",
            "#" + left[1:] + groups,
            f"# {'size':>10} {'count':>12} {'type':>8} {'redop':>6} {'root':>5}" + sub1,
            f"# {'(B)':>10} {'(elements)':>12} {'':>8} {'':>6} {'':>5}" + sub2,
        ])

    def table_row(self, coll: str, sh: Shape, dt: str, op: str, row: dict[str, Point]) -> str:
        root = self.args.root if coll == "broadcast" else -1
        out = f"  {sh.size:>10} {sh.count:>12} {dt:>8} {op:>6} {root:>5}"
        for c in self.columns:
            if c.skipped:
                continue
            pt = row[c.name]
            if pt.status == "ok":
                t = f"{pt.time_us:10.2f}" if pt.time_us < 1e6 else f"{pt.time_us:10.0f}"
                w = "N/A" if pt.wrong is None else str(pt.wrong)
                out += f" {t} {pt.algbw:7.3f} {pt.busbw:7.3f} {w:>6}"
            else:
                label = {"unsupported": "unsupp", "error": "ERROR"}.get(pt.status, pt.status)
                out += f" {label:>10} {'--':>7} {'--':>7} {'--':>6}"
            if c.algo == "auto":
                out += f" {(pt.auto_choice or '--'):>{self.pick_width}}"
        return out

    def points(self, coll: str, dt: str, op: str, column: str) -> list[dict]:
        return [r for r in self.results if r["collective"] == coll and r["dtype"] == dt
                and r["redop"] == op and r["column"] == column]

    def table_footer(self, coll: str, dt: str, op: str) -> str:
        lines = []
        wrong_total, checked = 0, False
        for c in self.columns:
            if c.skipped:
                continue
            pts = self.points(coll, dt, op, c.name)
            bad = [r for r in pts if r["status"] in ("unsupported", "error")]
            if bad:
                lines.append(f"# {c.name}: {bad[0]['status']}: {bad[0]['reason']}")
            for r in pts:
                if r["wrong"] is not None:
                    checked = True
                    wrong_total += r["wrong"]
        if checked:
            lines.append(f"# wrong values in total: {wrong_total} "
                         f"{'OK' if wrong_total == 0 else 'FAILED'}")
        avg = []
        for c in self.columns:
            bws = [r["busbw"] for r in self.points(coll, dt, op, c.name) if r["status"] == "ok"]
            if bws:
                avg.append(f"{c.name} {sum(bws) / len(bws):.3f}")
        if avg:
            lines.append("# average busbw (GB/s): " + ", ".join(avg))
        return "\n".join(lines)

    def group_keys(self) -> list[tuple[str, str, str]]:
        keys: list[tuple[str, str, str]] = []
        for r in self.results:
            k = (r["collective"], r["dtype"], r["redop"])
            if k not in keys:
                keys.append(k)
        return keys

    def document(self) -> dict:
        """Everything this run measured, in the JSON schema (``SCHEMA``)."""
        return {"schema": SCHEMA, "meta": self.meta(), "results": self.results}


def _width(c: Column, pick_width: int = 5) -> int:
    return 10 + 1 + 7 + 1 + 7 + 1 + 6 + (pick_width + 1 if c.algo == "auto" else 0)


def floor_point(null: Point, mpi: Point | None, coll: str, size: int, p: int) -> Point:
    """The floor column's point: on each rank, its median time of ``dist.all_reduce``
    into the do-nothing group (``null``) plus its median of MPI's own collective
    (the ``mpi`` column); the time is the maximum over ranks, as for every column."""
    if mpi is None or mpi.status != "ok":
        why = mpi.reason if mpi is not None else "no mpi column"
        return Point(null.column, mpi.status if mpi is not None else "unsupported",
                     reason=f"no mpi time at this size ({why})")

    def add(a, b):
        return [x + y for x, y in zip(a, b)] if a and b else None

    meds = add(null.rank_median_us, mpi.rank_median_us)
    t_us = max(meds)
    algbw = size / (t_us * 1e-6) / 1e9
    return Point(null.column, "ok", t_us, algbw, algbw * BUSBW_FACTOR[coll](p), None,
                 null.iters, meds, add(null.rank_q25_us, mpi.rank_q25_us),
                 add(null.rank_q75_us, mpi.rank_q75_us), dispatch_us=null.time_us)


def register_null_backend() -> str:
    """Register (once) a torch backend whose process group does nothing: every
    allreduce returns an already completed Work. Returns its name.

    It is created like ringcomm's own group (an extended-API backend whose creator
    returns a ``dist.ProcessGroup`` subclass), so ``dist.all_reduce`` takes the
    same path through torch up to the backend's Python method.
    """
    import torch
    import torch.distributed as dist

    if hasattr(dist.Backend, NULL_BACKEND.upper()):
        return NULL_BACKEND

    class _DoneWork(dist.Work):
        def __init__(self, result):
            super().__init__()
            self._result = result

        def wait(self, timeout=None) -> bool:
            return True

        def get_future(self):
            fut = torch.futures.Future()
            fut.set_result(self._result)
            return fut

    class _NullGroup(dist.ProcessGroup):
        def getBackendName(self) -> str:
            return NULL_BACKEND

        def allreduce(self, tensors, opts=None):
            return _DoneWork(tensors)

    def create(dist_opts, pg_options):
        return _NullGroup(dist_opts.group_rank, dist_opts.group_size)

    dist.Backend.register_backend(NULL_BACKEND, create, extended_api=True, devices=["cpu"])
    return NULL_BACKEND


def _gpu_sharing() -> bool:
    """Whether NCCL was told it may run several ranks on one GPU: NCCL >= 2.30.3 with
    ``NCCL_MULTI_RANK_GPU_ENABLE=1``, or a distinct ``NCCL_HOSTID`` per rank (the ranks
    then look like separate hosts to NCCL; ``RINGCOMM_NCCL_HOSTID_PER_RANK=1`` sets it)."""
    return (os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1" or "NCCL_HOSTID" in os.environ
            or os.environ.get("RINGCOMM_NCCL_HOSTID_PER_RANK") == "1")


def host_id_per_rank() -> None:
    """With ``RINGCOMM_NCCL_HOSTID_PER_RANK=1``, give this rank an NCCL host id of its own
    (before NCCL starts): how ranks share one GPU with NCCL < 2.30.3."""
    if os.environ.get("RINGCOMM_NCCL_HOSTID_PER_RANK") == "1":
        os.environ["NCCL_HOSTID"] = f"ringcomm-rank-{os.environ.get('RANK', '0')}"


def _version_of(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - not installed, or not loadable here
        return None


class _Control:
    """The untimed exchanges between ranks (agreeing on columns, iteration counts,
    statistics): over MPI when it is there, else over a gloo group, so the script
    also runs on a GPU machine without an MPI library."""

    def __init__(self, comm: Any, dist: Any, size: int):
        self.comm, self.dist, self.size = comm, dist, size
        self.group = dist.new_group(backend="gloo") if comm is None else None

    def allgather(self, obj: Any) -> list:
        if self.comm is not None:
            return self.comm.allgather(obj)
        out: list = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.Barrier()
        else:
            self.dist.barrier(group=self.group)


def _noop() -> None:
    pass


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Progress:
    """A one-line progress bar on stderr (rank 0, terminals only unless forced)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.n = max(1, total), enabled, 0
        self.tty = sys.stderr.isatty()
        self.started = time.monotonic()
        self.last = 0.0

    def step(self, what: str) -> None:
        self.n += 1
        if not self.enabled:
            return
        frac = (self.n - 1) / self.total
        now = time.monotonic()
        if self.tty:
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r[{bar:<30}] {self.n}/{self.total} {what[:50]:<50}")
            sys.stderr.flush()
        elif now - self.last > 10:
            self.last = now
            print(f"# progress {self.n}/{self.total} ({frac:.0%}, {now - self.started:.0f} s): "
                  f"{what}", file=sys.stderr, flush=True)

    def clear(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\r" + " " * 96 + "\r")
            sys.stderr.flush()

    def done(self) -> None:
        self.clear()


# ----------------------------------------------------------------------------
# analysis: needs only the results (works on a live run or on saved JSON)
# ----------------------------------------------------------------------------
def _ok_points(results: list[dict], coll: str, dt: str, op: str, column: str) -> list[dict]:
    return sorted((r for r in results if r["collective"] == coll and r["dtype"] == dt and
                   r["redop"] == op and r["column"] == column and r["status"] == "ok"),
                  key=lambda r: r["size"])


def fit_models(docs: list[dict]) -> list[dict]:
    """Fit a cost model per (collective, dtype, op, column) over one or more result
    documents (several world sizes give a better model).

    Returns:
        One dict per fit: the :class:`costmodel.Fit` fields plus ``column``, ``dtype``, ``redop``.
    """
    by_key: dict[tuple, list] = {}
    seg: dict[tuple, int] = {}
    gammas: dict[tuple, float] = {}
    kinds: dict[str, str] = {}
    for doc in docs:
        meta = doc["meta"]
        p = int(meta["world_size"])
        for c in meta["columns"]:
            kinds[c["name"]] = c["kind"] if c["algo"] != "auto" else "auto"
        for r in doc["results"]:
            if r["status"] != "ok" or r["time_us"] is None:
                continue
            k = (r["collective"], r["dtype"], r["redop"], r["column"])
            by_key.setdefault(k, []).append((p, r["size"], r["time_us"] * 1e-6))
            seg[k] = int(meta["ringcomm"]["segment_bytes"])
            g = meta.get("gamma_s_per_byte", {}).get(f"{r['dtype']}/{r['redop']}")
            if g is not None:
                gammas[k] = max(gammas.get(k, 0.0), float(g))
    fits = []
    for (coll, dt, op, column), samples in by_key.items():
        kind = kinds.get(column, column)
        if kind in ("auto", "floor") or len(samples) < 2:
            # auto is one algorithm or another by size: its own curve has no single
            # model; the floor is a bound made of two measurements, not an implementation
            continue
        algo = column if kind in ("ringcomm", "ringcomm-cuda") else None
        gamma = gammas.get((coll, dt, op, column)) if coll in REDUCING else None
        note = None
        try:
            f = costmodel.fit(coll, algo, samples, segment_bytes=seg[(coll, dt, op, column)],
                              gamma=gamma)
        except ValueError as e:  # e.g. a user's builder the checker refuses at this shape
            if algo is None:
                raise
            note = f"no structural model ({e}); black box instead"
            f = costmodel.fit(coll, None, samples, segment_bytes=seg[(coll, dt, op, column)])
        fits.append({**f.as_dict(), "column": column, "dtype": dt, "redop": op,
                     **({"note": note} if note else {})})
    return fits


def _fit_obj(d: dict) -> costmodel.Fit:
    names = {f.name for f in dataclasses.fields(costmodel.Fit)}
    kw = {k: v for k, v in d.items() if k in names}
    kw["fitted"] = tuple(kw["fitted"])
    kw["world_sizes"] = tuple(kw["world_sizes"])
    return costmodel.Fit(**kw)


def model_report(fits: list[dict], predict_ranks: Sequence[int],
                 predict_sizes: Sequence[int]) -> tuple[str, dict]:
    """Text for the fitted models, predictions at other world sizes and ring/tree
    crossovers; and the same as a JSON-ready dict."""
    lines = ["#", "# cost model: T = o + alpha*A(p,n) + beta*B(p,n) + gamma*G(p,n)  "
             "(A messages, B bytes on the busiest link, G bytes reduced, for each algorithm;",
             "#   other libraries: T = o + beta*n at the measured world size only; gamma is "
             "measured by a local reduction, not fitted)"]
    out: dict = {"fits": fits, "predictions": [], "crossovers": []}
    groups: dict[tuple, list[dict]] = {}
    for f in fits:
        groups.setdefault((f["collective"], f["dtype"], f["redop"]), []).append(f)
    for (coll, dt, op), fs in groups.items():
        lines.append(f"# {coll} {dt} {op}: fitted on world sizes "
                     f"{', '.join(str(p) for p in sorted({p for f in fs for p in f['world_sizes']}))}")
        w = max([8] + [len(f["column"]) for f in fs])
        lines.append(f"#   {'column':<{w}} {'o(us)':>8} {'alpha(us)':>10} {'beta(ns/B)':>11} "
                     f"{'=GB/s':>7} {'gamma(ns/B)':>12} {'rms err':>8}  fitted")
        for f in fs:
            bw = 1e-9 / f["beta"] if f["beta"] > 0 else float("inf")
            lines.append(f"#   {f['column']:<{w}} {f['o'] * 1e6:8.2f} {f['alpha'] * 1e6:10.2f} "
                         f"{f['beta'] * 1e9:11.4f} {bw:7.2f} {f['gamma'] * 1e9:12.4f} "
                         f"{f['rms_rel_err']:7.1%}  {','.join(f['fitted'])}"
                         + (f"  ({f['note']})" if f.get("note") else ""))
        models = {f["column"]: _fit_obj(f) for f in fs
                  if f["algorithm"] and costmodel.has_model(coll, f["algorithm"])}
        if models and predict_ranks:
            names = list(models)
            widths = {k: max(12, len(k)) for k in names}
            lines.append("#   predicted time (us) at larger world sizes (features counted "
                         "from the schedules):")
            lines.append(f"#   {'ranks':>6} {'size':>10} " +
                         " ".join(f"{n:>{widths[n]}}" for n in names) + "   best")
            for p in predict_ranks:
                for n in predict_sizes:
                    ts = {name: m.predict(p, n) for name, m in models.items()}
                    best = min(ts, key=ts.get)
                    lines.append(f"#   {p:>6} {format_size(n):>10} " +
                                 " ".join(f"{ts[k] * 1e6:{widths[k]}.1f}" for k in names)
                                 + f"   {best}")
                    out["predictions"].append({"collective": coll, "dtype": dt, "redop": op,
                                               "world_size": p, "size": n,
                                               "time_us": {k: v * 1e6 for k, v in ts.items()},
                                               "best": best})
        if "ring" in models and "tree" in models:
            ws = sorted({p for f in fs for p in f["world_sizes"]} | set(predict_ranks))
            for p in ws:
                xs = costmodel.crossovers(models["tree"], models["ring"], p)
                if xs:
                    txt = f"{xs[0][1]} first; " + "; ".join(
                        f"{b} faster from {format_size(n)}" for n, _, b in xs)
                    first = xs[0][1]
                else:
                    grid = [1 << k for k in range(0, 37, 2)]
                    faster = {"tree" if models["tree"].predict(p, n) < models["ring"].predict(p, n)
                              else "ring" for n in grid}
                    first = faster.pop() if len(faster) == 1 else "tie"
                    txt = (f"{first} faster at every size" if first != "tie" else
                           "no crossover: within 2% of each other from 1 B to 64 GiB")
                lines.append(f"#   ring/tree crossover at {p} ranks (model): {txt}")
                out["crossovers"].append({"collective": coll, "dtype": dt, "redop": op,
                                          "world_size": p, "source": "model", "first": first,
                                          "changes": [[n, b] for n, _, b in xs]})
    return "\n".join(lines), out


def measured_tuning(docs: list[dict], tolerance: float) -> dict[str, dict[str, list]]:
    """Tuning rows per collective and world size from the measured ringcomm
    algorithms (auto and native excluded), in ringcomm's tuning-file shape.

    Uses float/sum timings when present (else the first dtype/op measured); sizes
    are converted to what ``auto`` is asked with (one rank's block for allgather
    and reduce_scatter).
    """
    table: dict[str, dict[str, list]] = {}
    for doc in docs:
        meta = doc["meta"]
        p = int(meta["world_size"])
        # ringcomm's own schedules only: auto is their mix, and native is MPI's
        # collective (which cannot reduce every dtype ringcomm can)
        algos = [c["name"] for c in meta["columns"]
                 if c["kind"] == "ringcomm" and c["algo"] not in NOT_SCHEDULES]
        colls = []
        for r in doc["results"]:
            if r["collective"] not in colls:
                colls.append(r["collective"])
        for coll in colls:
            combos = []
            for r in doc["results"]:
                k = (r["dtype"], r["redop"])
                if r["collective"] == coll and k not in combos:
                    combos.append(k)
            dt, op = ("float", "sum" if coll in REDUCING else "none")
            if (dt, op) not in combos:
                dt, op = combos[0]
            per_algo = {a: {r["size"]: r for r in _ok_points(doc["results"], coll, dt, op, a)}
                        for a in algos}
            per_algo = {a: v for a, v in per_algo.items() if v}
            if not per_algo:
                continue
            sizes = sorted(set().union(*[set(v) for v in per_algo.values()]))
            esize = _esize(dt)
            units = []
            for s in sizes:
                count = s // esize
                per = count // p if coll in ("allgather", "reduce_scatter") else count
                units.append(per * esize)
            times = {a: [v[s]["time_us"] if s in v else None for s in sizes]
                     for a, v in per_algo.items()}
            # Drop sizes where no algorithm ran, and sizes that round to a unit
            # already seen (too small to give every rank a whole element).
            keep, seen = [], set()
            for i, u in enumerate(units):
                if u not in seen and any(times[a][i] for a in times):
                    keep.append(i)
                    seen.add(u)
            if not keep:
                continue
            units = [units[i] for i in keep]
            times = {a: [t[i] for i in keep] for a, t in times.items()}
            rows = costmodel.tuning_rows(units, times, tolerance)
            table.setdefault(coll, {})[str(p)] = rows
    return table


def _esize(dtype_name: str) -> int:
    return {"int8": 1, "uint8": 1, "half": 2, "bfloat16": 2, "int32": 4, "float": 4,
            "int64": 8, "double": 8}[dtype_name]


def write_tuning(path: str, table: dict[str, dict[str, list]]) -> tuple[list[str], list[str]]:
    """Merge ``table`` into the tuning file at ``path`` (created if missing) and
    check ringcomm accepts the result.

    Returns:
        (entries written as "collective/world size", collectives ringcomm's tuning
        does not know and were left out).
    Raises:
        ValueError: the existing file is not a tuning file, or ringcomm rejects the result.
    """
    from ringcomm.algorithms import select

    existing: dict = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                existing = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--write-tuning: {path!r} exists and is not JSON ({e}); "
                             "remove it or pick another file") from e
        if not isinstance(existing, dict):
            raise ValueError(f"--write-tuning: {path!r} is not a ringcomm tuning file")
    written, left_out = [], []
    for coll, by_p in table.items():
        if coll not in select.DEFAULT_TUNING:
            left_out.append(coll)
            continue
        for p, rows in by_p.items():
            existing.setdefault(coll, {})[p] = rows
            written.append(f"{coll}/{p}")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(existing, f, indent=1)
        f.write("\n")
    try:
        select.load_tuning(tmp)
    except ValueError:
        os.unlink(tmp)
        raise
    os.replace(tmp, path)
    return written, left_out


def tuning_text(table: dict[str, dict[str, list]]) -> str:
    lines = []
    for coll, by_p in table.items():
        for p, rows in by_p.items():
            parts, lo = [], 0
            for max_bytes, algo in rows:
                if max_bytes is None:
                    parts.append(f"{algo} from {format_size(lo)}" if lo else f"{algo} always")
                else:
                    parts.append(f"{algo} up to {format_size(max_bytes)}")
                    lo = max_bytes + 1
            lines.append(f"#   measured best at {p} ranks, {coll}: " + ", then ".join(parts))
    return "\n".join(lines)


_TARGET_KEYS = {"name": str, "collective": str, "dtype": str, "redop": str, "min_bytes": int,
                "max_bytes": int, "metric": str, "of": list, "bound": str, "goal": (int, float)}


def load_targets(path: str) -> list[dict]:
    """The targets listed in the JSON file at ``path`` (see scripts/targets.json).

    Raises:
        ValueError: unreadable, or a target lacks a field or has a bad one (named).
    """
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--targets {path!r}: cannot read it: {e}") from e
    if not isinstance(doc, dict) or doc.get("schema") != TARGETS_SCHEMA:
        raise ValueError(f"--targets {path!r}: not a targets file (schema must be "
                         f"{TARGETS_SCHEMA!r})")
    out = []
    for i, t in enumerate(doc.get("targets", [])):
        where = f"--targets {path!r}, target {i}"
        if not isinstance(t, dict):
            raise ValueError(f"{where}: not an object")
        for k, typ in _TARGET_KEYS.items():
            if not isinstance(t.get(k), typ) or isinstance(t.get(k), bool):
                raise ValueError(f"{where} ({t.get('name', '?')}): field {k!r} is missing or "
                                 f"not a {typ.__name__ if isinstance(typ, type) else 'number'}")
        if t["metric"] not in ("time_us", "busbw"):
            raise ValueError(f"{where}: metric must be time_us or busbw, got {t['metric']!r}")
        if t["bound"] not in ("<=", ">="):
            raise ValueError(f"{where}: bound must be '<=' or '>=', got {t['bound']!r}")
        if not t["of"] or not all(isinstance(c, str) for c in t["of"]):
            raise ValueError(f"{where}: 'of' must list column names")
        if t.get("versus") is not None and not isinstance(t["versus"], str):
            raise ValueError(f"{where}: 'versus' must be a column name or null")
        if t["min_bytes"] > t["max_bytes"]:
            raise ValueError(f"{where}: min_bytes is above max_bytes")
        out.append(t)
    return out


def _range_text(t: dict) -> str:
    lo, hi = format_size(t["min_bytes"]), format_size(t["max_bytes"])
    return lo if lo == hi else f"{lo}-{hi}"


def targets(results: list[dict], p: int, spec: list[dict] | None = None,
            ) -> tuple[str, list[dict]]:
    """Check the speed targets ``spec`` (default: scripts/targets.json) against one
    run's results, as text and records. Ratios use this run's numbers only.

    Each record: the target's fields plus ``value`` (the worst measured ratio, or
    the worst measured value when the target has no ``versus``), ``ratio`` (value
    over goal for an absolute target, else the same as ``value``), ``met`` (True,
    False, or None when no size in its range was measured with every column it
    needs), ``sizes`` (per size: the best column, its value and the ratio).
    """
    if spec is None:
        spec = load_targets(DEFAULT_TARGETS)
    recs: list[dict] = []
    if not spec:
        return "", recs
    lines = ["#", f"# speed targets on {p} ranks (met when true at every measured size in "
                  "its range)"]

    def ok(coll, dt, op, column, size):
        for r in results:
            if (r["collective"], r["dtype"], r["redop"], r["column"], r["size"]) == \
                    (coll, dt, op, column, size) and r["status"] == "ok":
                return r
        return None

    for t in spec:
        coll, dt, op, metric = t["collective"], t["dtype"], t["redop"], t["metric"]
        versus, goal, bound = t.get("versus"), float(t["goal"]), t["bound"]
        lower_better = metric == "time_us"
        unit = "us" if lower_better else "GB/s"
        sizes = sorted({r["size"] for r in results if (r["collective"], r["dtype"], r["redop"])
                        == (coll, dt, op) and t["min_bytes"] <= r["size"] <= t["max_bytes"]})
        per_size, missing = [], []
        for size in sizes:
            cands = [x for x in (ok(coll, dt, op, c, size) for c in t["of"]) if x]
            if not cands:
                missing.append(size)
                continue
            best = (min if lower_better else max)(cands, key=lambda r: r[metric])
            entry = {"size": size, "best": best["column"], "value": best[metric]}
            if versus:
                other = ok(coll, dt, op, versus, size)
                if not other:
                    missing.append(size)
                    continue
                entry["versus_value"] = other[metric]
                entry["ratio"] = best[metric] / other[metric]
            else:
                entry["ratio"] = best[metric] / goal
            per_size.append(entry)
        rec = {**t, "sizes": per_size, "unmeasured_sizes": missing}
        stated = f" (stated for {t['ranks']} ranks)" if t.get("ranks") not in (None, p) else ""
        head = f"#   {t['name']} ({coll} {dt} {op}{stated}): "
        if not per_size:
            need = ", ".join(t["of"]) + (f" and {versus}" if versus else "")
            rec.update(value=None, ratio=None, met=None)
            recs.append(rec)
            lines.append(head + f"NOT MEASURED (needs {need} at {_range_text(t)}, "
                         f"-d {dt}" + (f" -o {op}" if op != "none" else "") + ")")
            continue
        key = "ratio" if versus else "value"
        worst = (max if bound == "<=" else min)(per_size, key=lambda e: e[key])
        value = worst[key]
        met = all(e[key] <= goal if bound == "<=" else e[key] >= goal for e in per_size)
        rec.update(value=value, ratio=worst["ratio"], met=met, worst_size=worst["size"])
        recs.append(rec)
        at = f"worst at {format_size(worst['size'])}: " if len(per_size) > 1 else ""
        n_ok = sum(1 for e in per_size if (e[key] <= goal if bound == "<=" else e[key] >= goal))
        count = f", {n_ok} of {len(per_size)} sizes" if len(per_size) > 1 else ""
        if missing:
            count += f"; no data at {', '.join(format_size(m) for m in missing)}"
        if versus:
            lines.append(head + f"{at}{worst['best']} {worst['value']:.3f} {unit} vs "
                         f"{versus} {worst['versus_value']:.3f} {unit} = {value:.2f}x "
                         f"(target {bound} {goal:g}x{count}) {'MET' if met else 'MISSED'}")
        else:
            lines.append(head + f"{at}{worst['best']} {value:.3f} {unit} = "
                         f"{worst['ratio']:.2f}x the goal (target {bound} {goal:g} {unit}"
                         f"{count}) {'MET' if met else 'MISSED'}")
    return "\n".join(lines), recs


def write_csv(path: str, results: list[dict]) -> None:
    """One row per (collective, size, dtype, op, column)."""
    import csv

    fields = ["collective", "size", "count", "dtype", "redop", "root", "column", "status",
              "time_us", "algbw", "busbw", "wrong", "iters", "auto_choice", "reason"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerow(r)


def write_markdown(path: str, doc: dict) -> None:
    """One Markdown table per (collective, dtype, op): time (us) and busbw (GB/s) of
    every column by size, and what auto ran."""
    results = doc["results"]
    columns = [c["name"] for c in doc["meta"]["columns"] if not c["skipped"]]
    keys: list[tuple] = []
    for r in results:
        k = (r["collective"], r["dtype"], r["redop"])
        if k not in keys:
            keys.append(k)
    out = []
    for coll, dt, op in keys:
        rows = [r for r in results if (r["collective"], r["dtype"], r["redop"]) == (coll, dt, op)]
        cols = [c for c in columns if any(r["column"] == c and r["status"] == "ok" for r in rows)]
        missing = [c for c in columns if c not in cols]
        has_auto = "auto" in cols
        out.append(f"#### {coll}, {dt}" + (f", {op}" if op != "none" else "")
                   + f", {doc['meta']['world_size']} ranks\n")
        head = (["size"] + [f"{c} us" for c in cols] + [f"{c} GB/s" for c in cols]
                + (["auto ran"] if has_auto else []))
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join("---:" for _ in head) + "|")
        for size in sorted({r["size"] for r in rows}):
            cell = {r["column"]: r for r in rows if r["size"] == size}
            ok = {c: cell[c] for c in cols if c in cell and cell[c]["status"] == "ok"}
            t = [f"{ok[c]['time_us']:.1f}" if c in ok else "--" for c in cols]
            bw = [f"{ok[c]['busbw']:.3f}" if c in ok else "--" for c in cols]
            pick = [ok["auto"].get("auto_choice") or "--"] if has_auto and "auto" in ok else (
                ["--"] if has_auto else [])
            out.append("| " + " | ".join([format_size(size), *t, *bw, *pick]) + " |")
        if missing:
            reasons = {r["column"]: r["reason"] for r in rows if r["status"] != "ok"}
            out.append("\nNot measured: " + "; ".join(f"{c} ({reasons.get(c, 'no data')})"
                                                       for c in missing) + ".")
        out.append("")
    with open(path, "w") as f:
        f.write("\n".join(out))


def plot(path: str, doc: dict) -> None:
    """busbw vs size and latency vs size, one panel pair per (collective, dtype, op)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = doc["results"]
    keys: list[tuple] = []
    for r in results:
        k = (r["collective"], r["dtype"], r["redop"])
        if k not in keys:
            keys.append(k)
    columns = [c["name"] for c in doc["meta"]["columns"] if not c["skipped"]]
    fig, axes = plt.subplots(len(keys), 2, figsize=(12, 4.2 * len(keys)), squeeze=False)
    p = doc["meta"]["world_size"]
    for (coll, dt, op), (ax_bw, ax_t) in zip(keys, axes):
        for i, c in enumerate(columns):
            pts = _ok_points(results, coll, dt, op, c)
            if not pts:
                continue
            x = [r["size"] for r in pts]
            # one colour per column in every panel, even where some columns are missing
            style = dict(marker="o", markersize=3, linewidth=1.5, color=f"C{i}",
                         linestyle="--" if c == "auto" else "-")
            ax_bw.plot(x, [r["busbw"] for r in pts], label=c, **style)
            ax_t.plot(x, [r["time_us"] for r in pts], label=c, **style)
        title = f"{coll} {dt}" + (f" {op}" if op != "none" else "") + f", {p} ranks"
        for ax, ylab in ((ax_bw, "bus bandwidth (GB/s)"), (ax_t, "time per call (us)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("message size (bytes)")
            ax.set_ylabel(ylab)
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        ax_t.set_yscale("log")
    fig.suptitle(f"compare_collectives: {doc['meta']['device']['cpu']}, "
                 f"{doc['meta']['started']}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / (4.2 * len(keys))))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def analyse(docs: list[dict], args: argparse.Namespace, out: Callable[[str], None]) -> dict:
    """Cost model, targets and tuning over result documents; prints through ``out``."""
    analysis: dict = {}
    results = docs[-1]["results"]
    p = int(docs[-1]["meta"]["world_size"])
    if not args.model_from and args.targets:  # one run's side-by-side numbers
        text, recs = targets(results, p, load_targets(args.targets))
        if text:
            out(text)
        analysis["targets"] = recs
    if not args.no_model:
        try:
            fits = fit_models(docs)
            text, model = model_report(fits, args.predict_rank_list, args.predict_size_list)
            out(text)
            analysis["cost_model"] = model
        except ValueError as e:
            out(f"# cost model: not fitted: {e}")
    table = measured_tuning(docs, args.tuning_tolerance)
    if table:
        out("#\n# measured tuning (the fastest ringcomm algorithm by size; sizes as auto "
            "sees them):\n" + tuning_text(table))
        analysis["measured_tuning"] = table
    if args.write_tuning:
        written, left_out = write_tuning(args.write_tuning, table)
        out(f"# wrote tuning for {', '.join(written) or 'nothing'} to {args.write_tuning}"
            + (f" (left out {', '.join(left_out)}: ringcomm's tuning has no such collective)"
               if left_out else ""))
    return analysis


# ----------------------------------------------------------------------------
# entry points
# ----------------------------------------------------------------------------
def main_offline(args: argparse.Namespace) -> int:
    """``--model-from``: refit and report from saved JSON results."""
    docs = []
    for path in args.model_from:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("schema") != SCHEMA:
            print(f"compare_collectives: error: {path} is not a compare_collectives result "
                  f"(schema {doc.get('schema')!r}, expected {SCHEMA!r})", file=sys.stderr)
            return 2
        docs.append(doc)
    analysis = analyse(docs, args, print)
    # Tables and plots of the last file: regenerate a report without rerunning.
    if args.markdown:
        write_markdown(args.markdown, docs[-1])
    if args.plot:
        plot(args.plot, docs[-1])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": SCHEMA + "/model", "inputs": args.model_from, **analysis}, f,
                      indent=1)
    return 0


def report(doc: dict, args: argparse.Namespace) -> int:
    """Rank 0 after the run: analysis, files. Returns the exit status (1: wrong values)."""
    doc["analysis"] = analyse([doc], args, lambda s: print(s, flush=True))
    wrong = sum(r["wrong"] or 0 for r in doc["results"])
    errors = [r for r in doc["results"] if r["status"] == "error"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.csv:
        write_csv(args.csv, doc["results"])
    if args.plot:
        plot(args.plot, doc)
    if args.markdown:
        write_markdown(args.markdown, doc)
    end = doc["meta"]["load_average"]["end"] or []
    print(f"# load average at end: {' '.join(f'{x:.2f}' for x in end)}", flush=True)
    if wrong:
        print(f"# FAILED: {wrong} wrong values", flush=True)
    if errors:
        print(f"# FAILED: {len(errors)} measurements ended in an error", flush=True)
    return 1 if wrong or errors else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison (under mpiexec or torchrun) or, with ``--model-from``, the analysis."""
    args = parse_args(argv)
    if args.model_from:
        return main_offline(args)
    launched = any(v in os.environ for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                                               "PMIX_RANK", "TORCHELASTIC_RUN_ID", "RANK"))
    if not launched:
        print("compare_collectives: note: no launcher found; running 1 rank. To compare "
              "collectives, " + LAUNCH_HINT, file=sys.stderr)
    from datetime import timedelta

    import torch.distributed as dist

    import ringcomm  # registers the backend; under mpiexec it fills in RANK etc.

    if not launched:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    host_id_per_rank()
    opts = ringcomm.Options(segment_bytes=args.segment_bytes, tuning_file=args.tuning)
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=args.timeout),
                            pg_options=opts)
    rc = 0
    try:
        bench = Bench(args)
        bench.run()
        doc = bench.document()
        if bench.rank == 0:
            # Rank 0 alone writes; the others wait for its exit status below.
            try:
                rc = report(doc, args)
            except (OSError, ValueError, ImportError) as e:
                print(f"compare_collectives: error: {e}", file=sys.stderr, flush=True)
                rc = 2
        rc = bench.ctrl.allgather(rc)[0]
    finally:
        dist.destroy_process_group()
    return rc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
