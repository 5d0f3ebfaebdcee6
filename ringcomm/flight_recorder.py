"""What the ranks' flight recorder dumps say about a hang.

    python -m ringcomm.flight_recorder DIR [--prefix PREFIX] [--json OUT] [--torch]

``DIR`` holds one dump per rank, as ringcomm writes them
(:mod:`ringcomm.trace.flight`: ``TORCH_FR_DUMP_TEMP_FILE`` followed by the rank) or
as torch's NCCL and gloo groups do: the same pickle. For each group it prints:

* the first collective (by torch's sequence number) that not every rank of the group
  reached, the ranks missing from it and the state it is in on the others;
* the first collective the ranks called differently (op, sizes or dtypes);
* sends that no receive matched, and receives that no send did;
* what each missing rank was doing last: its last call, its state and how long
  before its dump it was made.

A rank without a dump (killed, say) is named, and the rest is analysed without it
(torch's ``--allow-incomplete-ranks``). ``--torch`` also runs torch's own analyzer
(torch >= 2.8) on the same files and prints what it found. Exit code 0 when the
dumps show nothing wrong, 1 when they show a hang or a mismatch, 2 when no dump
could be read.
"""
from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import pickle
import re
import sys
from typing import Any

__all__ = ["load", "analyze", "main"]

_RANK_FILE = re.compile(r"^(.*?)(\d+)$")


def _files(directory: str, prefix: str | None) -> dict[int, str]:
    """rank -> path of the dumps in ``directory`` (and below); the prefix is inferred
    when not given, as torch's analyzer does."""
    found: dict[str, dict[int, str]] = {}
    for root, _, names in os.walk(directory):
        for name in sorted(names):
            m = _RANK_FILE.match(name)
            if m is None or (prefix is not None and m.group(1) != prefix):
                continue
            found.setdefault(m.group(1), {})[int(m.group(2))] = os.path.join(root, name)
    if not found:
        raise ValueError(f"no dump in {directory}: a dump's name is its prefix followed by "
                         "the rank (TORCH_FR_DUMP_TEMP_FILE)")
    if len(found) > 1:
        raise ValueError(f"dumps of several prefixes in {directory} ({sorted(found)}): "
                         "name one with --prefix")
    return next(iter(found.values()))


def load(directory: str, prefix: str | None = None) -> tuple[dict[int, dict], dict[int, str]]:
    """The dumps in ``directory``: rank -> dump, and rank -> why a file could not be
    read."""
    dumps, bad = {}, {}
    for rank, path in sorted(_files(directory, prefix).items()):
        try:
            with open(path, "rb") as f:
                d = pickle.load(f)
            if not isinstance(d, dict) or "entries" not in d or "pg_config" not in d:
                raise ValueError("not a flight recorder dump (no entries or pg_config)")
            dumps[rank] = d
        except Exception as e:  # noqa: BLE001 - any unreadable file is reported
            bad[rank] = f"{path}: {type(e).__name__}: {e}"
    return dumps, bad


def _op(entry: dict) -> str:
    """The op without its library (``nccl:``, ``gloo:``, ``ringcomm:``)."""
    return entry["profiling_name"].rpartition(":")[2]


def _describe(entry: dict) -> str:
    sizes = entry.get("input_sizes")
    dtypes = sorted(set(entry.get("input_dtypes") or []))
    algo = entry.get("algorithm")
    return (f"{_op(entry)} #{entry['collective_seq_id']} of {sizes} {'/'.join(dtypes)}"
            f"{f' [{algo}]' if algo and algo not in ('send', 'recv') else ''}")


def _groups(dumps: dict[int, dict]) -> dict[str, dict]:
    """group name -> {desc, ranks (global), entries: rank -> that rank's entries}."""
    groups: dict[str, dict] = {}
    for rank, d in dumps.items():
        for name, cfg in d["pg_config"].items():
            g = groups.setdefault(name, {"desc": cfg.get("desc", ""), "entries": {},
                                         "ranks": list(ast.literal_eval(cfg.get("ranks", "[]")))})
            g["entries"].setdefault(rank, [])
        for e in d["entries"]:
            name = e["process_group"][0]
            groups.setdefault(name, {"desc": e["process_group"][1], "ranks": [],
                                     "entries": {}})["entries"].setdefault(rank, []).append(e)
    return groups


def _group_findings(name: str, g: dict, dumps: dict[int, dict]) -> dict:
    members = g["ranks"] or sorted(g["entries"])
    present = [r for r in members if r in dumps]
    coll = {r: [e for e in g["entries"].get(r, []) if not e.get("is_p2p")] for r in present}
    # a rank whose ring kept none of the group's collectives tells nothing of them
    last = {r: max(e["collective_seq_id"] for e in es) for r, es in coll.items() if es}
    out: dict[str, Any] = {"group": name, "desc": g["desc"], "ranks": members,
                           "no_dump": [r for r in members if r not in dumps],
                           "none_kept": [r for r in present if not coll[r]]}
    if last and min(last.values()) < max(last.values()):
        low = min(last.values())
        # the first collective past the lowest rank's last that a rank still keeps
        # (low + 1, unless every ring that had it has overwritten it since)
        seq = min(e["collective_seq_id"] for es in coll.values() for e in es
                  if e["collective_seq_id"] > low)
        missing = sorted(r for r, s in last.items() if s < seq)
        at = {r: e for r, es in coll.items() for e in es if e["collective_seq_id"] == seq}
        # what held each rank that reached it: the peers it waited for, its error
        held = {r: e.get("error") or e.get("waiting_for") for r, e in at.items()
                if e.get("error") or e.get("waiting_for")}
        out["first_not_reached"] = {"seq": seq, "call": _describe(next(iter(at.values()))),
                                    "missing": missing,
                                    "states": {r: e["state"] for r, e in sorted(at.items())},
                                    "held": held, "exact": seq == low + 1}
    elif last:
        open_ = {r: es[-1]["state"] for r, es in coll.items()
                 if es and es[-1]["state"] != "completed"}
        if open_:
            high = max(last.values())
            out["all_reached_not_completed"] = {
                "seq": high, "call": _describe(coll[next(iter(open_))][-1]),
                "states": open_}
    # the first collective the ranks called differently
    by_seq: dict[int, dict[int, dict]] = {}
    for r, es in coll.items():
        for e in es:
            by_seq.setdefault(e["collective_seq_id"], {})[r] = e
    for seq in sorted(by_seq):
        calls = {r: (_op(e), e.get("input_sizes"), e.get("input_dtypes"),
                     e.get("output_sizes"), e.get("output_dtypes"))
                 for r, e in by_seq[seq].items()}
        if len(set(map(repr, calls.values()))) > 1:
            out["first_mismatch"] = {"seq": seq, "calls": {
                r: _describe(by_seq[seq][r]) for r in sorted(calls)}}
            break
    out["unmatched_p2p"] = _unmatched_p2p(g, present)
    return out


_ARROW = re.compile(r"(send|recv) (\d+)(->|<-)(\d+)")


def _unmatched_p2p(g: dict, present: list[int]) -> list[str]:
    """Sends with no receive on their peer (and the reverse), counted per direction
    in order, where both ranks left a dump (group ranks, as torch names them)."""
    members = g["ranks"] or sorted(g["entries"])
    counts: dict[tuple, list] = {}
    for r in present:
        for e in g["entries"].get(r, []):
            m = _ARROW.match(_op(e)) if e.get("is_p2p") else None
            if m is None:
                continue
            kind, me, _, peer = m.group(1), int(m.group(2)), m.group(3), int(m.group(4))
            src, dst = (me, peer) if kind == "send" else (peer, me)
            counts.setdefault((src, dst), [[], []])[kind == "recv"].append(e["state"])
    notes = []
    for (src, dst), (sends, recvs) in sorted(counts.items()):
        if src >= len(members) or dst >= len(members):
            continue
        if members[src] not in present or members[dst] not in present:
            continue
        if len(sends) != len(recvs):
            more, fewer = ("sends", "receives") if len(sends) > len(recvs) else \
                ("receives", "sends")
            notes.append(f"rank {src} -> rank {dst}: {max(len(sends), len(recvs))} {more} but "
                         f"{min(len(sends), len(recvs))} {fewer}")
    return notes


def _last_doing(rank: int, d: dict) -> str:
    if not d["entries"]:
        return "no call recorded"
    e = max(d["entries"], key=lambda x: x["record_id"])
    when = d.get("dump_time_ns")
    ago = f", {(when - e['time_created_ns']) / 1e9:.1f} s before its dump" if when else ""
    return (f"{_describe(e)} in group {e['process_group'][0]} "
            f"({e['process_group'][1]}), {e['state']}{ago}")


def analyze(dumps: dict[int, dict], bad: dict[int, str] | None = None) -> dict:
    """The findings, as :func:`main` prints them."""
    groups = _groups(dumps)
    findings = [_group_findings(name, g, dumps) for name, g in sorted(groups.items())]
    missing_ranks = sorted({r for f in findings
                            for r in f.get("first_not_reached", {}).get("missing", [])})
    return {"ranks_with_dumps": sorted(dumps), "unreadable": bad or {},
            "no_dump": sorted({r for f in findings for r in f["no_dump"]}),
            "groups": findings,
            "last_doing": {r: _last_doing(r, dumps[r]) for r in missing_ranks if r in dumps}}


def report(result: dict) -> tuple[str, bool]:
    """The findings in words; and whether they show something wrong."""
    lines, wrong = [], False
    lines.append(f"dumps from ranks {result['ranks_with_dumps']}")
    for rank, why in sorted(result["unreadable"].items()):
        lines.append(f"rank {rank}: unreadable: {why}")
    if result["no_dump"]:
        lines.append(f"no dump from ranks {result['no_dump']} (a rank killed, or one that "
                     "never learned of the failure, leaves none): the rest shows what the "
                     "others did")
    for f in result["groups"]:
        head = f"group {f['group']} ({f['desc'] or 'no description'}, ranks {f['ranks']})"
        nr = f.get("first_not_reached")
        if nr:
            wrong = True
            states = ", ".join(f"rank {r}: {s}" for r, s in sorted(nr["states"].items()))
            first = "first collective" if nr.get("exact", True) else (
                "first collective still kept (the rings overwrote the ones before it)")
            lines.append(f"{head}: {nr['call']} is the {first} not every rank "
                         f"reached: ranks {nr['missing']} never called it ({states})")
            for r, why in sorted(nr.get("held", {}).items()):
                lines.append(f"  rank {r}: {' '.join(why.split())[:300]}")
        arc = f.get("all_reached_not_completed")
        if arc:
            wrong = True
            states = ", ".join(f"rank {r}: {s}" for r, s in sorted(arc["states"].items()))
            lines.append(f"{head}: every rank reached {arc['call']}, which did not complete "
                         f"({states})")
        mm = f.get("first_mismatch")
        if mm:
            wrong = True
            calls = "; ".join(f"rank {r}: {c}" for r, c in mm["calls"].items())
            lines.append(f"{head}: collective #{mm['seq']} differs across ranks: {calls}")
        for note in f["unmatched_p2p"]:
            wrong = True
            lines.append(f"{head}: {note}")
        if f.get("none_kept"):
            lines.append(f"{head}: ranks {f['none_kept']} kept none of its collectives")
        if not (nr or arc or mm or f["unmatched_p2p"] or f.get("none_kept")):
            lines.append(f"{head}: every rank reached and completed the same calls")
    for rank, what in sorted(result["last_doing"].items()):
        lines.append(f"rank {rank} last did: {what}")
    return "\n".join(lines), wrong


def run_torch_analyzer(directory: str, prefix: str | None, incomplete: bool) -> list[str]:
    """What torch's own analyzer logs for the same dumps (torch >= 2.8)."""
    import contextlib
    import gc
    import io

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # "tabulate is not installed"
            from torch.distributed.flight_recorder.components.builder import build_db
            from torch.distributed.flight_recorder.components.config_manager import JobConfig
            from torch.distributed.flight_recorder.components.loader import read_dir
    except ImportError as e:
        return [f"torch's analyzer is not available here ({e})"]
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("Flight Recorder")
    own = list(logger.handlers)  # its own, to stderr: the lines come back here instead
    for h in own:
        logger.removeHandler(h)
    logger.addHandler(handler)
    was = logger.propagate
    logger.propagate = False
    try:
        argv = [directory, *(["-p", prefix] if prefix else []),
                *(["--allow-incomplete-ranks"] if incomplete else [])]
        args = JobConfig().parse_args(argv)
        details, version = read_dir(args)
        build_db(details, args, version)
    except Exception as e:  # noqa: BLE001 - its known failures (lone sends, say)
        lines.append(f"torch's analyzer stopped: {type(e).__name__}: {e}")
    finally:
        logger.removeHandler(handler)
        for h in own:
            logger.addHandler(h)
        logger.propagate = was
        gc.enable()  # torch 2.13's read_dir leaves the collector off
    return [line for line in lines if "tabulate" not in line]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ringcomm.flight_recorder",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("directory")
    p.add_argument("--prefix", help="the dumps' name before the rank (inferred by default)")
    p.add_argument("--json", help="also write the findings to this file")
    p.add_argument("--torch", action="store_true", help="also run torch's own analyzer")
    args = p.parse_args(argv)
    try:
        dumps, bad = load(args.directory, args.prefix)
    except (OSError, ValueError) as e:
        print(f"ringcomm.flight_recorder: {e}", file=sys.stderr)
        return 2
    if not dumps:
        print("ringcomm.flight_recorder: no dump could be read:\n  " + "\n  ".join(bad.values()),
              file=sys.stderr)
        return 2
    result = analyze(dumps, bad)
    text, wrong = report(result)
    print(text)
    if args.torch:
        print("\ntorch's analyzer:")
        for line in run_torch_analyzer(args.directory, args.prefix, bool(result["no_dump"])):
            print(f"  {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
