"""One trace from the ranks' traces (:func:`merge`, clocks aligned across hosts),
and ``python -m ringcomm.trace merge OUT IN...`` (:func:`main`)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

def merge(docs: list[dict], align: bool | None = None,
          names: list[str] | None = None) -> dict:
    """One trace from the ranks' traces.

    Ranks on one host share its clock, so their events are kept as recorded.
    Across hosts (or with ``align=True``), each rank's clock is shifted so that
    the end of its first barrier (or, without one, of its first collective) meets
    rank 0's: a barrier ends at nearly the same moment on every rank, closer than
    the clocks of two hosts usually agree. ``align=False`` keeps every clock.

    ``names`` (the documents' files) name the documents in errors.

    Raises:
        ValueError: a document is not a ringcomm trace, or two are of one rank.
    """
    seen: dict[int, dict] = {}
    names = names or [f"document {i}" for i in range(len(docs))]
    first: dict[int, str] = {}
    for d, name in zip(docs, names):
        other = d.get("otherData", {}) if isinstance(d, dict) else {}
        if other.get("schema") != "ringcomm.trace/1" or "rank" not in other:
            raise ValueError(f"ringcomm.trace.merge: {name} is not a ringcomm trace (no "
                             "otherData.schema ringcomm.trace/1)")
        if other["rank"] in seen:
            raise ValueError(f"ringcomm.trace.merge: {first[other['rank']]} and {name} are "
                             f"both traces of rank {other['rank']}")
        seen[other["rank"]] = d
        first[other["rank"]] = name
    shifts = {r: 0.0 for r in seen}
    if align is None:
        align = len({d["otherData"].get("host") for d in seen.values()}) > 1
    if align and len(seen) > 1:
        marks = {r: _sync_mark(d["traceEvents"]) for r, d in seen.items()}
        if all(m is not None for m in marks.values()):
            ref = marks[min(marks)]
            shifts = {r: ref - m for r, m in marks.items()}  # type: ignore[operator]
    events = []
    for r in sorted(seen):
        for e in seen[r]["traceEvents"]:
            if "ts" in e and shifts[r]:
                e = {**e, "ts": e["ts"] + shifts[r]}
            events.append(e)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schema": "ringcomm.trace/1", "ranks": sorted(seen),
                          "clock_shift_us": {str(r): s for r, s in shifts.items()}}}


def _sync_mark(events: list[dict]) -> float | None:
    colls = [e for e in events if e.get("cat") == "collective" and e.get("ph") == "X"]
    barriers = [e for e in colls if e["name"].startswith("barrier")]
    first = min(barriers or colls, key=lambda e: e["ts"], default=None)
    return None if first is None else first["ts"] + first["dur"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringcomm.trace",
                                 description="Merge the ranks' trace files into one.")
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge per-rank traces into one Chrome trace")
    m.add_argument("output")
    m.add_argument("inputs", nargs="+")
    how = m.add_mutually_exclusive_group()
    how.add_argument("--align", action="store_true", default=None,
                     help="align the ranks' clocks on their first barrier even on one host "
                     "(the default only across hosts)")
    how.add_argument("--no-align", dest="align", action="store_false",
                     help="keep each rank's clock as recorded")
    a = ap.parse_args(argv)
    out_path = Path(a.output).resolve()
    if any(Path(p).resolve() == out_path for p in a.inputs):
        # merge OUT IN...: a forgotten output name makes the first input the output,
        # which the merge would overwrite
        print(f"ringcomm.trace merge: the output {a.output} is also an input; the first "
              "argument is the merged file's name (merge OUT IN...)", file=sys.stderr)
        return 2
    docs = []
    for path in a.inputs:
        try:
            docs.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            print(f"ringcomm.trace merge: cannot read {path}: {e}", file=sys.stderr)
            return 2
    try:
        out = merge(docs, align=a.align, names=a.inputs)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    Path(a.output).write_text(json.dumps(out))
    print(f"{a.output}: {len(out['traceEvents'])} events of ranks {out['otherData']['ranks']}")
    return 0
