"""``python -m ringcomm.msccl``: check an MSCCL algorithm, or export a schedule as one.

    python -m ringcomm.msccl check FILE.xml [--bytes 1M]
    python -m ringcomm.msccl export ring allreduce 8 [--chunks 8] > ring8.xml

``check`` prints the collective, ranks, chunks, steps, the rounds of messages and
the bytes on the busiest link for a call of ``--bytes`` (float32, from the
checker's counts), or why the file is refused (exit 1). ``export`` writes the
XML of a registered algorithm (``--import MODULE`` registers a user's first).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from ringcomm import msccl
from ringcomm.msccl.translate import counts


def _bytes(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B")
    unit = t[-1:] if t[-1:] in units else ""
    try:
        return int(float(t[:len(t) - len(unit)]) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64K, 1M)") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringcomm.msccl", description=__doc__.split(
        "\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="load, translate and prove an MSCCL XML file")
    c.add_argument("file")
    c.add_argument("--bytes", type=_bytes, default=1 << 20,
                   help="the call size the busiest link's bytes are counted for (float32)")
    e = sub.add_parser("export", help="write a registered schedule as MSCCL XML")
    e.add_argument("algorithm")
    e.add_argument("collective", choices=sorted(msccl.export.COLL_NAMES))
    e.add_argument("ranks", type=int)
    e.add_argument("--chunks", type=int, default=None,
                   help="nchunksperloop (default: the number of ranks)")
    e.add_argument("--name", default=None, help="the XML's name (default ALGO_COLL_RANKS)")
    e.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (one that registers your algorithm)")
    a = ap.parse_args(argv)
    if a.command == "export":
        for m in a.imports:
            importlib.import_module(m)
        try:
            sys.stdout.write(msccl.to_xml(a.collective, a.algorithm, a.ranks, a.chunks, a.name))
        except ValueError as err:
            print(f"export: {err}", file=sys.stderr)
            return 1
        return 0
    try:
        alg = msccl.load(a.file)
    except ValueError as err:
        print(f"refused: {err}", file=sys.stderr)
        return 1
    prog = alg.program
    # --bytes is the full-size buffer (allreduce's, or all ranks' blocks together)
    per_chunk = max(1, a.bytes // 4 // alg.chunks)
    stats = alg.prove(multiple=per_chunk) if alg.ranks > 1 else None
    steps = counts(prog)
    print(f"{alg.name}: {alg.collective} on {alg.ranks} ranks, {alg.chunks} chunks per loop, "
          f"{prog.nchannels} channel(s), proto {prog.proto}, "
          f"{'in place' if prog.inplace else 'out of place'}")
    print(f"steps: {sum(steps)} in {sum(len(g.tbs) for g in prog.gpus)} thread blocks "
          f"(per gpu {min(steps)}-{max(steps)})")
    if stats is not None:
        nbytes = per_chunk * alg.chunks * 4
        print(f"proven: every rank's result is right (checked at {nbytes} B per rank's "
              f"{'buffer' if alg.collective == 'allreduce' else 'full buffer'})")
        print(f"rounds of messages: {stats.rounds}; ringcomm steps per rank: at most "
              f"{stats.steps_max}")
        print(f"busiest link: {stats.busiest * 4} B for that call; most sent by one rank: "
              f"{stats.sent_max * 4} B")
    if prog.min_bytes or prog.max_bytes:
        print(f"byte range: {prog.min_bytes}..{prog.max_bytes or 'unbounded'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
