"""The command line: flags, main (every rank), finish (rank 0: targets, JSON, plots)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Sequence

import torch.distributed as dist

import ringcomm  # noqa: F401  (registers the backend; under mpiexec it fills in RANK etc.)
from ringcomm.bench.cli import Parser, launch_alone, names

import ddp.bench
from ddp.bench.configs import World
from ddp.bench.constants import (BACKEND_OPTIONS, BACKENDS, BUCKET_CAPS, DEFAULT_TARGETS,
                                 IMPLS, MODELS, PAPER_MODELS, PROG, QUICK_BUCKET_CAPS,
                                 RR_CAPS, RR_CHANNELS, SECTIONS)
from ddp.bench.experiments import Bench
from ddp.bench.plots import plot
from ddp.bench import tracing
from ddp.bench.targets import check_targets, comm_heavy_model, load_targets
from ddp.bench.tracing import Tracer

ROOT = Path(__file__).resolve().parent.parent.parent

def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=(ddp.bench.__doc__ or "").split("\n\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sections", default="all",
                   help=f"comma list of {', '.join(SECTIONS)}, or all")
    p.add_argument("--model", default=None,
                   help="resnet, bert, mlp (a 9.4M-parameter MLP: 512-2048-2048-2048-10, "
                        "the short path's DDP measurement), both (resnet and bert) or all "
                        "(default: both; resnet with --quick)")
    p.add_argument("--impls", default="ours,torch", help="DDP implementations: ours, torch")
    p.add_argument("--backends", default="ringcomm,gloo",
                   help="backends; the first is the default group's, the others come from "
                        "dist.new_group")
    p.add_argument("--quick", action="store_true",
                   help="smaller models, fewer iterations and bucket sizes (under a minute "
                        "on 2 ranks)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations per configuration (default 8, 3 with --quick)")
    p.add_argument("--warmup", type=int, default=2, help="synchronized iterations first")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds that visit the configurations in turn, rotating the order "
                        "(default: one per timed iteration, the finest interleaving, so that "
                        "bursts of load from other processes fall on every configuration)")
    p.add_argument("--channels", default=",".join(map(str, RR_CHANNELS)),
                   help="roundrobin section: communicators per group K (ringcomm's "
                        "num_channels; gloo groups in turn), comma list; speed-ups are "
                        "against the smallest")
    p.add_argument("--rr-caps", default=",".join(map(str, RR_CAPS)),
                   help="roundrobin section: bucket_cap_mb values, comma list (25 is both "
                        "DDPs' default, the paper's setting; smaller caps put more "
                        "allreduces in flight at once)")
    p.add_argument("--threads", default="auto",
                   help="torch threads per rank; auto = $OMP_NUM_THREADS if set, else "
                        "cores / ranks")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds any collective may take (process group timeout)")
    p.add_argument("--json", metavar="FILE", help="write every measured number as JSON")
    p.add_argument("--plot", metavar="DIR",
                   help="write one PNG per section, and the timeline of one traced iteration "
                        "of ours/ringcomm (and of overlap off) (matplotlib)")
    p.add_argument("--trace", metavar="PATH",
                   help="record the run with ringcomm.trace: each rank writes PATH with "
                        ".rank<r> before the suffix, rank 0 merges them into PATH (Chrome "
                        "trace format; open in ui.perfetto.dev)")
    p.add_argument("--targets", metavar="JSON", default=DEFAULT_TARGETS,
                   help="speed targets to check; 'none' for none")
    p.add_argument("--progress", nargs="?", const="on", choices=("auto", "on", "off"),
                   default="auto", help="progress bar on rank 0's stderr (auto: when it is "
                                        "a terminal; --progress alone: on)")
    return p


def parse_args(argv: Sequence[str] | None = None, prog: str = PROG) -> argparse.Namespace:
    """Parse and check the command line; a bad flag exits 2 naming it (rank 0 prints)."""
    parser = build_parser(prog)
    a = parser.parse_args(argv)
    try:
        a.section_list = names(a.sections, SECTIONS, "section (--sections)")
        model = a.model if a.model is not None else ("resnet" if a.quick else "both")
        choice = model.strip().lower()
        a.model_list = (list(PAPER_MODELS) if choice == "both" else list(MODELS)
                        if choice == "all" else names(model, MODELS, "model (--model)"))
        a.impl_list = names(a.impls, IMPLS, "DDP implementation (--impls)")
        a.backend_list = names(a.backends, BACKENDS, "backend (--backends)")
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    if a.backend_list[0] in BACKEND_OPTIONS:
        parser.error(f"--backends: {a.backend_list[0]} cannot come first (the default "
                     f"group's backend): list it after ringcomm or gloo")
    a.iters = a.iters if a.iters is not None else (3 if a.quick else 8)
    a.rounds = a.rounds if a.rounds is not None else a.iters
    a.caps = QUICK_BUCKET_CAPS if a.quick else BUCKET_CAPS
    try:
        a.channel_list = _numbers(a.channels, int, "--channels", 1)
        a.rr_caps = _numbers(a.rr_caps, float, "--rr-caps", 0)
    except ValueError as e:
        parser.error(str(e))
    for flag, v, low in (("--iters", a.iters, 1), ("--rounds", a.rounds, 1),
                         ("--warmup", a.warmup, 1)):
        if v < low:
            parser.error(f"{flag} must be at least {low}, got {v}")
    if a.timeout <= 0:
        parser.error(f"--timeout must be positive, got {a.timeout:g}")
    if a.threads != "auto" and not (a.threads.isdigit() and int(a.threads) > 0):
        parser.error(f"--threads must be a positive number or auto, got {a.threads!r}")
    if a.targets.strip().lower() in ("", "none"):
        a.targets = None
    else:
        try:
            a.target_list = load_targets(a.targets)
        except ValueError as e:
            parser.error(str(e))
    return a


def _numbers(text: str, kind: type, flag: str, low: float) -> list:
    """The comma list ``text`` as distinct numbers >= ``low``, in order (floats that
    are whole become ints, so 25.0 prints as 25).

    Raises:
        ValueError: not a number, too small, or none (the flag is named).
    """
    out: list = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            v = kind(item)
        except ValueError:
            raise ValueError(f"{flag} takes a comma list of numbers, got {item!r}") from None
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not v >= low:
            raise ValueError(f"{flag} values must be at least {low}, got {item}")
        if v not in out:
            out.append(v)
    if not out:
        raise ValueError(f"{flag}: no value given")
    return out


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Run the benchmark; returns 0, 1 (verification failed or an error), 2 (bad flags)."""
    args = parse_args(argv, prog)
    if launch_alone():
        print("bench_ddp: note: no launcher found; running 1 rank (world size 1). Launch with "
              "`mpiexec -n 2 python -m ddp.bench` or `torchrun --nproc-per-node 2 -m "
              "ddp.bench` to compare across ranks.", file=sys.stderr)
    dist.init_process_group(args.backend_list[0],
                            timeout=datetime.timedelta(seconds=args.timeout))
    rc = 0
    try:
        world = World(args)
        tracer = Tracer(args.trace)
        tracer.start()
        err = None
        try:
            bench = Bench(args, world, tracer)
            doc = bench.run()
        except RuntimeError as e:  # verification failed (on every rank), or a backend error
            err = str(e)
        try:
            traced = tracer.finish(world.ctrl)
        except (OSError, ValueError) as e:
            err, traced = err or f"--trace {args.trace}: {e}", None
        err = world.agree(err)
        if err:
            if world.rank == 0:
                print(f"bench_ddp: error: {err}", file=sys.stderr, flush=True)
            return 1
        if world.rank == 0:
            if traced:
                print(traced, flush=True)
            rc = finish(doc, args, bench.traces, bench.rr_traces)
        rc = world.gather(rc)[0]
    finally:
        dist.destroy_process_group()
    return rc


def finish(doc: dict, args: argparse.Namespace, traces: dict | None = None,
           rr_traces: dict | None = None) -> int:
    """Rank 0 after the run: targets, JSON, plots (with ``traces``, model -> configuration
    -> merged trace of one iteration: the timeline; with ``rr_traces``, model -> K ->
    merged trace of the round-robin section's traced iterations: their timelines).
    Returns the exit status."""
    print("# load average at end: " + " ".join(
        f"{x:.2f}" for x in doc["meta"]["load_average"]["end"] or []), flush=True)
    if args.targets:
        text, recs = check_targets(doc, args.target_list)
        doc["targets"] = {"file": os.path.relpath(args.targets, ROOT)
                          if args.targets.startswith(str(ROOT)) else args.targets,
                          "results": recs}
        print(text, flush=True)
    try:
        if args.plot:
            try:
                paths = plot(doc, args.plot)
                if traces:
                    model = comm_heavy_model(doc) if comm_heavy_model(doc) in traces else \
                        next(iter(traces))
                    paths += tracing.draw(traces[model], model, args.plot)
                if rr_traces:
                    model = comm_heavy_model(doc) if comm_heavy_model(doc) in rr_traces else \
                        next(iter(rr_traces))
                    paths += tracing.draw_roundrobin(rr_traces[model],
                                                     doc["roundrobin"][model]["trace"], model,
                                                     args.plot)
                for path in paths:
                    print(f"# plot: {path}", flush=True)
            except ImportError as e:
                print(f"# plots skipped: matplotlib is not installed ({e}); "
                      "pip install matplotlib", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
            print(f"# json: {args.json}", flush=True)
    except OSError as e:
        print(f"bench_ddp: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0
