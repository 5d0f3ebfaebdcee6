"""The command line of the benchmark and its entry points.

``python -m ringcomm.bench`` and ``scripts/compare_collectives.py`` both call
:func:`main`: it parses and checks the flags (:func:`parse_args`; a bad flag
exits with status 2 and a message naming it, printed by rank 0 only), then
either runs the comparison under the launcher (mpiexec or torchrun; one rank
without one) or, with ``--model-from``, only analyses saved JSON results.

Flags follow nccl-tests (-b -e -f -i -n -w -o -d -c -r).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Sequence

import torch.distributed as dist

import ringcomm  # registers the backend; under mpiexec it has filled in RANK etc.
from ringcomm.bench.analysis import analyse
from ringcomm.bench.columns import LAUNCH_HINT, PEER_NAMES, host_id_per_rank
from ringcomm.bench.report import finish, plot, write_markdown
from ringcomm.bench.results import SCHEMA
from ringcomm.bench.session import Session
from ringcomm.bench.sizes import COLLECTIVES, DTYPE_ALIASES, DTYPE_NAMES, OP_NAMES, parse_size
from ringcomm.bench.targets import DEFAULT_TARGETS, load_targets
from ringcomm.bench.timing import Bench
from ringcomm.launch.launchers import MPI_LAUNCHER_VARS

#: the program name in usage and error messages when run as the script
PROG = "compare_collectives.py"
DEFAULT_ALGOS = "ring,tree,auto"
#: the peers of a CPU run unless --peers names others: the quick ones (DeepSpeed's
#: column builds its op on first use, so it runs when asked for by name)
DEFAULT_PEERS = ("mpi", "gloo", "floor")


def _env_rank() -> int:
    """This process's rank from the environment (``import ringcomm`` has filled in
    RANK under an MPI launcher; torchrun sets it); 0 without a launcher."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class Parser(argparse.ArgumentParser):
    """Prints usage errors on rank 0 only (every rank parses the same argv). Public: other
    benchmarks (ddp.bench) parse their flags with it too."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if _env_rank() == 0:
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def names(text: str, valid: Sequence[str], what: str, aliases: dict | None = None) -> list[str]:
    """The comma list ``text`` as names of ``valid`` (``all`` for all of them, ``aliases``
    mapped), in order, without repeats.

    Raises:
        argparse.ArgumentTypeError: an unknown name (the choices are named), or none.
    """
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


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The command-line interface (flags in the style of nccl-tests)."""
    p = Parser(
        prog=prog,
        description="Time ringcomm's collective algorithms against the MPI library's own "
                    "collectives, gloo and NCCL, in one run. " + LAUNCH_HINT[0].upper()
                    + LAUNCH_HINT[1:] + ".",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _size_flags(p.add_argument_group("sizes and iterations"))
    _what_flags(p.add_argument_group("what to run"))
    _ringcomm_flags(p.add_argument_group("ringcomm settings"))
    _output_flags(p.add_argument_group("output"))
    return p


def _size_flags(g: argparse._ArgumentGroup) -> None:
    """The flags of the group "sizes and iterations"."""
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
    g.add_argument("--barrier-each", action="store_true",
                   help="a barrier (MPI's, not timed) before each timed call, as the OSU "
                        "benchmarks do: each call then pays its own start-up, which calls "
                        "back to back overlap")
    g.add_argument("--gap", type=parse_gap, default=None, metavar="US|busy:US|compute[:N]",
                   help="before each timed call, an untimed MPI barrier and then a pause, as "
                        "a training loop's compute puts one before each collective: US "
                        "microseconds asleep; busy:US, as long in a busy loop (the core "
                        "stays awake); or compute, an NxN fp32 matmul on the caller's "
                        f"thread (N {GAP_MATMUL} unless given as compute:N)")


def _what_flags(g: argparse._ArgumentGroup) -> None:
    """The flags of the group "what to run"."""
    g.add_argument("--collective", "--coll", default="allreduce",
                   help=f"comma list of {', '.join(COLLECTIVES)}, or all")
    g.add_argument("-o", "--op", default="sum",
                   help=f"reduction op(s) for reducing collectives: {', '.join(OP_NAMES)}, or all")
    g.add_argument("-d", "--dtype", default="float",
                   help=f"data type(s): {', '.join(DTYPE_NAMES)} (aliases fp32, bf16, ...), or all")
    g.add_argument("-r", "--root", type=int, default=0, help="broadcast root rank")
    g.add_argument("-c", "--check", type=int, nargs="?", const=1, default=0, choices=(0, 1),
                   help="check results (-c or -c 1) and count wrong elements")
    g.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE on every rank first, e.g. one that registers your "
                        "own algorithms with ringcomm.register_algorithm (repeatable)")
    g.add_argument("--msccl", action="append", default=[], metavar="FILE",
                   help="an MSCCL algorithm XML to register on every rank "
                        "(ringcomm.register_msccl) and time next to the others (repeatable)")
    g.add_argument("--algos", default=DEFAULT_ALGOS,
                   help="ringcomm algorithms to compare (ring, tree, auto, native, any "
                        "registered name), or all")
    g.add_argument("--peers", default=None,
                   help="other implementations to compare: mpi (the MPI library's own "
                        "collective), gloo, nccl (only with CUDA), floor (allreduce: "
                        "dispatch into a do-nothing process group + mpi's time; needs mpi), "
                        "deepspeed (allreduce: DeepSpeed's shared-memory inference_all_reduce "
                        "with DS_ACCELERATOR=cpu; its op is built on first use); "
                        "'none' for none (default: " + ",".join(DEFAULT_PEERS) + " with --device "
                        "cpu, nccl with cuda; deepspeed only when named)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where ringcomm's algorithms run: CPU tensors over MPI, or CUDA "
                        "tensors over NCCL (one GPU per rank, or one shared GPU with "
                        "NCCL_MULTI_RANK_GPU_ENABLE=1)")
    g.add_argument("--concurrent", type=int, default=1, metavar="N",
                   help="issue N collectives at once (asynchronously, each on its own "
                        "buffers) per timed call and wait for all: the time is that of the "
                        "N, the bandwidths are aggregate")
    g.add_argument("--links", choices=("auto", "on", "off"), default="auto",
                   help="first measure each link (ping-pong latency and bandwidth within "
                        "each host and between each pair of hosts); auto: when the ranks "
                        "span hosts")


def _ringcomm_flags(g: argparse._ArgumentGroup) -> None:
    """The flags of the group "ringcomm settings"."""
    g.add_argument("--channels", type=int, default=None, metavar="K",
                   help="communicators of ringcomm's group, used in turn "
                        "(Options(num_channels=K)); the gloo column then round-robins over "
                        "K gloo groups, as torch's _round_robin_process_groups does "
                        "(default: RINGCOMM_NUM_CHANNELS, else 1)")
    g.add_argument("--segment-bytes", type=parse_size, default=None,
                   help="ringcomm pipeline segment size (default: ringcomm's)")
    g.add_argument("--tuning", default=None,
                   help="tuning file for ringcomm's auto (default: $RINGCOMM_TUNING or built-in)")
    g.add_argument("--threads", default="auto",
                   help="torch intra-op threads per rank; auto = cores per node / ranks per node")
    g.add_argument("--timeout", type=float, default=300.0,
                   help="seconds any single collective may take before it fails")


def _output_flags(g: argparse._ArgumentGroup) -> None:
    """The flags of the group "output" (files, the model, targets, --model-from)."""
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
    g.add_argument("--targets", metavar="JSON", default="none",
                   help="speed targets to check after the run (or, with --model-from, on the "
                        "last file's results); the project's own are "
                        f"{Path(DEFAULT_TARGETS).relative_to(Path(DEFAULT_TARGETS).parents[2])}, "
                        "which make test-bench checks on the committed runs")
    g.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress on rank 0's stderr (auto: when it is a terminal)")
    g.add_argument("--model-from", nargs="+", metavar="JSON",
                   help="no run: fit the cost model (and --write-tuning) from saved --json "
                        "results, possibly of several world sizes")


#: the matmul of ``--gap compute`` (N of an NxN fp32 product)
GAP_MATMUL = 256


def parse_gap(text: str) -> dict:
    """``--gap``: ``{"sleep_us": US}``, ``{"busy_us": US}`` or ``{"matmul": N}``.

    Raises:
        argparse.ArgumentTypeError: neither a number of at least 0, busy:US, nor
            compute[:N] with N of at least 1.
    """
    t = text.strip().lower()
    kind, _, value = t.partition(":")
    if kind == "compute":
        n = value or str(GAP_MATMUL)
        if not n.isdigit() or int(n) < 1:
            raise argparse.ArgumentTypeError(
                f"--gap {text!r}: compute:N takes a whole N of at least 1 (the matmul's size)")
        return {"matmul": int(n)}
    key, number = ("busy_us", value) if kind == "busy" else ("sleep_us", t)
    try:
        us = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--gap {text!r}: give microseconds (a number of at least 0), busy:US or "
            "compute[:N]") from None
    if not 0 <= us < float("inf"):
        raise argparse.ArgumentTypeError(
            f"--gap {text!r}: the pause must be a finite number of microseconds of at least 0")
    return {key: us}


def parse_args(argv: Sequence[str] | None = None, prog: str = PROG) -> argparse.Namespace:
    """Parse and validate the command line; bad flags exit with a message naming them."""
    parser = build_parser(prog)
    a = parser.parse_args(argv)
    _import_modules(parser, a)
    try:
        _parse_lists(a)
    except (argparse.ArgumentTypeError, ValueError) as e:
        parser.error(str(e))
    if not a.algo_list and not a.peer_list:
        parser.error("nothing to compare: --algos and --peers are both empty")
    _check_sizes(parser, a)
    _check_iterations(parser, a)
    _check_settings(parser, a)
    _check_files(parser, a)
    return a


def _import_modules(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """``--import``: import each module (a failure exits 2 naming it)."""
    for module in a.imports:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any failure of the user's module
            parser.error(f"--import {module}: {type(e).__name__}: {e}")


def _parse_lists(a: argparse.Namespace) -> None:
    """The comma lists as names and numbers (``--msccl`` files registered on the way).

    Raises:
        argparse.ArgumentTypeError, ValueError: an unknown name or a bad number.
    """
    a.collectives = names(a.collective, COLLECTIVES, "collective",
                          {"all_reduce": "allreduce", "all_gather": "allgather",
                           "reducescatter": "reduce_scatter", "all_to_all": "alltoall",
                           "bcast": "broadcast"})
    a.ops = names(a.op, OP_NAMES, "reduction op (-o)", {"product": "prod"})
    a.dtypes = names(a.dtype, DTYPE_NAMES, "data type (-d)", DTYPE_ALIASES)
    a.algo_list = [s.strip() for s in a.algos.split(",") if s.strip()]
    for path in a.msccl:
        name = ringcomm.register_msccl(path, replace=True)
        if name not in a.algo_list and "all" not in a.algo_list:
            a.algo_list.append(name)
    if a.peers is None:
        a.peers = "nccl" if a.device == "cuda" else ",".join(DEFAULT_PEERS)
    if a.peers.strip().lower() in ("", "none"):
        a.peer_list = []
    else:
        a.peer_list = names(a.peers, PEER_NAMES, "peer (--peers)")
    a.predict_rank_list = [int(x) for x in a.predict_ranks.split(",") if x.strip()]
    a.predict_size_list = [parse_size(x) for x in a.predict_sizes.split(",") if x.strip()]


def _check_sizes(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """-b, -e, -f, -i (defaults -f to 2 when neither step is given)."""
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


def _check_iterations(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """-n, -w, --rounds, --concurrent, --channels, --min-time, --max-iters."""
    if a.iters < 1:
        parser.error(f"-n/--iters must be at least 1, got {a.iters}")
    if a.warmup < 0:
        parser.error(f"-w/--warmup must not be negative, got {a.warmup}")
    if a.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {a.rounds}")
    if a.concurrent < 1:
        parser.error(f"--concurrent must be at least 1, got {a.concurrent}")
    if a.channels is not None and a.channels < 1:
        parser.error(f"--channels must be at least 1, got {a.channels}")
    if a.min_time < 0:
        parser.error(f"--min-time must not be negative, got {a.min_time:g}")
    if a.max_iters < a.iters:
        parser.error(f"--max-iters ({a.max_iters}) is below -n/--iters ({a.iters})")


def _check_settings(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--timeout, --segment-bytes, --threads, --predict-ranks, --tuning-tolerance."""
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


def _check_files(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--targets (``none`` -> None), --tuning, --model-from: the files exist (and the
    targets file is valid)."""
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


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Run the comparison (under mpiexec or torchrun) or, with ``--model-from``, the
    analysis. Returns the exit status: 0, 1 (wrong values or errors), 2 (bad input)."""
    args = parse_args(argv, prog)
    if args.model_from:
        return main_offline(args)
    if launch_alone():
        print("compare_collectives: note: no launcher found; running 1 rank. To compare "
              "collectives, " + LAUNCH_HINT, file=sys.stderr)
    host_id_per_rank()
    opts = ringcomm.Options(segment_bytes=args.segment_bytes, tuning_file=args.tuning,
                            num_channels=args.channels)
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=args.timeout),
                            pg_options=opts)
    rc = 0
    try:
        session = Session(args)
        bench = Bench(session)
        bench.run()
        doc = bench.document()
        if session.rank == 0:
            # Rank 0 alone writes; the others wait for its exit status below.
            try:
                rc = finish(doc, args)
            except (OSError, ValueError, ImportError) as e:
                print(f"compare_collectives: error: {e}", file=sys.stderr, flush=True)
                rc = 2
        rc = session.ctrl.allgather(rc)[0]
    finally:
        dist.destroy_process_group()
    return rc


def main_offline(args: argparse.Namespace) -> int:
    """``--model-from``: refit and report from saved JSON results."""
    docs = []
    for path in args.model_from:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            print(f"compare_collectives: error: --model-from {path}: cannot read it as JSON "
                  f"({e})", file=sys.stderr)
            return 2
        schema = doc.get("schema") if isinstance(doc, dict) else None
        if schema != SCHEMA:
            print(f"compare_collectives: error: {path} is not a compare_collectives result "
                  f"(schema {schema!r}, expected {SCHEMA!r})", file=sys.stderr)
            return 2
        docs.append(doc)
    try:
        analysis = analyse(docs, args, print)
        # Tables and plots of the last file: regenerate a report without rerunning.
        if args.markdown:
            write_markdown(args.markdown, docs[-1])
        if args.plot:
            plot(args.plot, docs[-1])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"schema": SCHEMA + "/model", "inputs": args.model_from, **analysis},
                          f, indent=1)
    except (OSError, ValueError, ImportError) as e:  # e.g. --write-tuning over a bad file
        print(f"compare_collectives: error: {e}", file=sys.stderr)
        return 2
    return 0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for MASTER_PORT without a launcher)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher() -> str:
    """What started this process: ``"torchrun"``, ``"mpiexec"`` or ``"none"``."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    return "mpiexec" if any(v in os.environ for v in MPI_LAUNCHER_VARS) else "none"


def launch_alone() -> bool:
    """With no launcher and no ``RANK`` set by hand: set the environment for a group
    of one rank and return True; otherwise False (the launcher's environment)."""
    if launcher() != "none" or "RANK" in os.environ:
        return False
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    return True
