#!/usr/bin/env python3
"""Run torch's own distributed test suite against ringcomm and report it.

    python scripts/conformance.py                 # all of it (make conformance)
    python scripts/conformance.py -k "broadcast"  # a part (pytest -k expression)
    python scripts/conformance.py --sizes 4,8     # what 3 ranks skip for size, at 4 and 8
    python scripts/conformance.py --render        # docs from the saved JSON only
    python scripts/conformance.py --check         # exit 1 unless the docs are current

Runs tests/conformance/torch_suite.py under pytest (world size 3, CPU, a time
limit per test), writes docs/data/conformance.json (every test's outcome, skip
reasons) and docs/conformance.md (the counts, each failure, and every skip
reason grouped and counted, with why it remains).

``--sizes`` runs, at each world size given, the tests the saved 3-rank run
skipped because the world was too small for them (``SIZE_SKIPS``), and adds
each run to the JSON under ``more_sizes``; ``make conformance`` does both.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "tests" / "conformance" / "torch_suite.py"
JSON_PATH = ROOT / "docs" / "data" / "conformance.json"
MD_PATH = ROOT / "docs" / "conformance.md"
PER_TEST_TIMEOUT_S = 240

#: why a skip remains: (pattern of the suite's skip message, the reason in our words);
#: the first pattern that matches wins
WHY = [
    (r"monitored_barrier", "torch refuses `monitored_barrier` by name for every backend but "
     "gloo (`dist.monitored_barrier`), whatever the backend can do"),
    (r"github\.com/pytorch/pytorch/(issues|pull)", "disabled by torch itself (the linked "
     "issue), for every backend"),
    (r"Only Nccl supports (all_gather_v|reduce_scatter_v)", "the test puts its tensors on "
     "CUDA devices (`.cuda(device_id)`), so no gate opens it on CPU; ringcomm's uneven "
     "`all_gather` and `reduce_scatter` on CPU tensors are checked against gloo in "
     "`tests/ranks/collectives_check.py` and `more_collectives_check.py`"),
    (r"CUDA|GPU|cuda|high priority stream|NCCL Batch|NCCL Send Recv|Nccl supports|NCCL supports"
     r"|Coalescing manager currently tests with NCCL|one of \{'nccl'\}",
     "needs CUDA devices (NCCL); there are none here. ringcomm's CUDA path is checked by "
     "`scripts/gpu_check.sh` ([gpu-results.md](gpu-results.md))"),
    (r"small world size", "the suite runs these with 8 ranks or more "
     "(`skip_if_small_worldsize`): run at 8 ranks below"),
    (r"world size of 4", "need a world of exactly or at least 4 ranks: run at 4 ranks below"),
    (r"sparse all reduce", "sparse tensors: only gloo implements a sparse allreduce; ringcomm "
     "refuses sparse tensors with a clear error"),
    (r"torchvision", "needs torchvision, which ringcomm does not depend on"),
    (r"file:// initialization", "runs only when the suite's INIT_METHOD is file://; this run "
     "uses the suite's default, env://"),
]


#: world size -> the skip messages of the 3-rank run that a run at that size lifts
SIZE_SKIPS = {4: ("world size of 4",), 8: ("small world size",)}


def run(k: str | None, xml_path: Path, world: int | None = None,
        names: list[str] | None = None) -> int:
    """pytest over the suite (``names``: exactly these tests) at ``world`` ranks (default
    ``$WORLD_SIZE`` or 3); its exit code."""
    size = str(world) if world else os.environ.get("WORLD_SIZE", "3")
    env = dict(os.environ, WORLD_SIZE=size, BACKEND="ringcomm",
               OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")])))
    env.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="ringcomm-conformance-"))
    targets = ([f"{SUITE}::TestDistBackendWithSpawn::{n}" for n in names] if names
               else [str(SUITE)])
    cmd = [sys.executable, "-m", "pytest", *targets, "-q", "-p", "no:cacheprovider",
           f"--timeout={PER_TEST_TIMEOUT_S}", "-rs", f"--junitxml={xml_path}"]
    if k:
        cmd += ["-k", k]
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def parse(xml_path: Path) -> list[dict]:
    tests = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "failed", "skipped": "skipped"}[tag]
                detail = (el.get("message") or el.text or "").strip()
                break
        tests.append({"name": case.get("name"), "outcome": outcome,
                      "seconds": round(float(case.get("time") or 0), 1),
                      "detail": detail[:600]})
    return tests


def skip_reason(detail: str) -> str:
    """The suite's skip message without pytest's prefix."""
    return re.sub(r"^(Skipped: |got skip reason: )", "", detail.splitlines()[0] if detail else "")


def why(reason: str) -> str:
    for pattern, text in WHY:
        if re.search(pattern, reason):
            return text
    return "**not reviewed yet**"


def render(doc: dict) -> str:
    counts = Counter(t["outcome"] for t in doc["tests"])
    lines = [
        "# Conformance: torch's distributed test suite on ringcomm",
        "",
        f"`torch.testing._internal.distributed.distributed_test` "
        f"(`DistributedTest._DistTestBase`, the suite gloo, nccl and mpi run), world size "
        f"{doc['world_size']}, CPU, torch {doc['torch']}; generated by "
        f"`scripts/conformance.py` ({doc['generated']}, {doc['seconds']:.0f} s"
        + (f", tests matching `{doc['selection']}`" if doc.get("selection") else "") + ").",
        "",
        f"**{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped** "
        f"of {len(doc['tests'])}.",
        "",
        "Run it with `make conformance` (all of it, then the tests gated on a larger world "
        "at 4 and 8 ranks; CI runs the part listed in `tests/test_conformance.py`).",
    ]
    failed = [t for t in doc["tests"] if t["outcome"] == "failed"]
    if failed:
        lines += ["", "## Failures", "", "| test | what failed |", "|---|---|"]
        for t in failed:
            lines.append(f"| `{t['name']}` | {_cell(t['detail'])} |")
    skipped = Counter(skip_reason(t["detail"]) for t in doc["tests"] if t["outcome"] == "skipped")
    if skipped:
        lines += ["", "## Skips, by the suite's reason", "",
                  "| tests | the suite's reason | why it remains |", "|---:|---|---|"]
        for reason, n in skipped.most_common():
            lines.append(f"| {n} | {_cell(reason, 200)} | {why(reason)} |")
    more = doc.get("more_sizes") or {}
    if more:
        lines += ["", "## At larger world sizes", "",
                  "The tests the 3-rank run skips because its world is too small, run at the "
                  "size they ask for (`scripts/conformance.py --sizes 4,8`; on 2 cores, "
                  "oversubscribed):", "",
                  "| world size | generated | seconds | passed | failed | skipped |",
                  "|---:|---|---:|---:|---:|---:|"]
        for size, part in sorted(more.items(), key=lambda kv: int(kv[0])):
            c = Counter(t["outcome"] for t in part["tests"])
            lines.append(f"| {size} | {part['generated']} | {part['seconds']:.0f} | "
                         f"{c['passed']} | {c['failed']} | {c['skipped']} |")
        lines += ["", "| world size | test | outcome | the suite's reason, where skipped or "
                  "failed | why it remains |", "|---:|---|---|---|---|"]
        for size, part in sorted(more.items(), key=lambda kv: int(kv[0])):
            for t in part["tests"]:
                if t["outcome"] == "passed":
                    lines.append(f"| {size} | `{t['name']}` | passed | | |")
                else:
                    reason = skip_reason(t["detail"]) if t["outcome"] == "skipped" else \
                        t["detail"]
                    lines.append(f"| {size} | `{t['name']}` | {t['outcome']} | "
                                 f"{_cell(reason, 200)} | "
                                 f"{why(reason) if t['outcome'] == 'skipped' else ''} |")
    return "\n".join(lines) + "\n"


def more_sizes(sizes: list[int]) -> int:
    """Run, at each size, the tests the saved run skipped for being too small; save
    each run in the JSON's ``more_sizes`` and render the docs."""
    import torch

    doc = json.loads(JSON_PATH.read_text())
    failed = 0
    for size in sizes:
        if size not in SIZE_SKIPS:
            print(f"conformance: no tests are gated on world size {size}; sizes: "
                  f"{', '.join(map(str, SIZE_SKIPS))}", file=sys.stderr)
            return 2
        names = [t["name"] for t in doc["tests"] if t["outcome"] == "skipped"
                 and any(m in t["detail"] for m in SIZE_SKIPS[size])]
        if not names:
            continue
        start = datetime.datetime.now(datetime.timezone.utc)
        xml_path = Path(tempfile.mkdtemp()) / f"conformance{size}.xml"
        rc = run(None, xml_path, world=size, names=names)
        tests = parse(xml_path)
        doc.setdefault("more_sizes", {})[str(size)] = {
            "generated": start.isoformat(timespec="seconds"), "torch": torch.__version__,
            "seconds": sum(t["seconds"] for t in tests), "tests": tests}
        c = Counter(t["outcome"] for t in tests)
        print(f"conformance at {size} ranks: {c['passed']} passed, {c['failed']} failed, "
              f"{c['skipped']} skipped")
        failed += c["failed"] + (rc not in (0, 5)) + (len(tests) != len(names))
    JSON_PATH.write_text(json.dumps(doc, indent=1) + "\n")
    MD_PATH.write_text(render(doc))
    return 1 if failed else 0


def _cell(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", help="pytest -k expression: run part of the suite")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--render", action="store_true", help="only render the saved JSON")
    g.add_argument("--check", action="store_true",
                   help="exit 1 unless docs/conformance.md is the rendering of the JSON")
    g.add_argument("--from-xml", metavar="FILE", help="report an existing junit XML run")
    g.add_argument("--sizes", metavar="N,N",
                   help="run what the saved run skipped for world size at these sizes "
                        f"({', '.join(map(str, SIZE_SKIPS))}) and add them to the JSON")
    args = ap.parse_args()
    if args.sizes:
        return more_sizes([int(n) for n in args.sizes.split(",")])
    if args.check:
        if MD_PATH.read_text() != render(json.loads(JSON_PATH.read_text())):
            print(f"{MD_PATH} is not the rendering of {JSON_PATH}; run "
                  "scripts/conformance.py --render", file=sys.stderr)
            return 1
        return 0
    rc = 0
    if not args.render:
        import torch

        start = datetime.datetime.now(datetime.timezone.utc)
        if args.from_xml:
            xml_path = Path(args.from_xml)
        else:
            xml_path = Path(tempfile.mkdtemp()) / "conformance.xml"
            rc = run(args.k, xml_path)
        tests = parse(xml_path)
        doc = {"generated": start.isoformat(timespec="seconds"), "torch": torch.__version__,
               "python": platform.python_version(),
               "world_size": int(os.environ.get("WORLD_SIZE", "3")),
               "selection": args.k, "seconds": sum(t["seconds"] for t in tests),
               "tests": tests}
        JSON_PATH.parent.mkdir(parents=True, exist_ok=True)
        JSON_PATH.write_text(json.dumps(doc, indent=1) + "\n")
    doc = json.loads(JSON_PATH.read_text())
    MD_PATH.write_text(render(doc))
    counts = Counter(t["outcome"] for t in doc["tests"])
    print(f"conformance: {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped; wrote {MD_PATH}")
    return 1 if counts["failed"] or rc not in (0, 5) else 0


if __name__ == "__main__":
    sys.exit(main())
