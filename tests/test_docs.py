"""Numbers in the README, docs/benchmarks.md, docs/paper-reproduction.md and
docs/multi-node.md come from the committed benchmark JSON, never by hand (the
README's settings table from ringcomm/settings.py); the other generated docs are
renderings of their JSON; the architecture's worked path matches the code."""
from __future__ import annotations

import importlib.util
import inspect
import json
import subprocess
import sys

import pytest

from conftest import ROOT

# scripts/doc_numbers.py in this process: the cost-model predictions it renders
# take seconds to simulate once and are cached for the later calls
_spec = importlib.util.spec_from_file_location("doc_numbers", ROOT / "scripts" / "doc_numbers.py")
doc_numbers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(doc_numbers)


@pytest.fixture
def run_doc_numbers(capsys):
    """``run_doc_numbers(*args) -> (exit status, stderr)`` of doc_numbers.main."""
    def run(*args: str) -> tuple[int, str]:
        rc = doc_numbers.main(list(args))
        return rc, capsys.readouterr().err

    return run


def test_readme_benchmarks_and_paper_docs_match_committed_json(run_doc_numbers):
    rc, err = run_doc_numbers("--check")
    assert rc == 0, err


def test_stale_readme_is_detected(tmp_path, run_doc_numbers):
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- bench:begin -->\n| 4 KiB | 1 us |\n<!-- bench:end -->\n"
                      "<!-- settings:begin -->\n| `RINGCOMM_OLD` |\n<!-- settings:end -->\n")
    cmd = ["--readme", str(readme), "--paper", "none"]  # the paper doc has its own test
    assert run_doc_numbers(*cmd, "--check")[0] == 1
    assert run_doc_numbers(*cmd)[0] == 0
    text = readme.read_text()
    assert "4 KiB time per call" in text and "| 4 KiB | 1 us |" not in text
    assert "`RINGCOMM_OLD`" not in text and "| `RINGCOMM_SEGMENT_BYTES` |" in text
    assert run_doc_numbers(*cmd, "--check")[0] == 0


def test_stale_benchmarks_doc_is_detected(tmp_path, run_doc_numbers):
    # every generated block of docs/benchmarks.md, each with a made-up number in it
    names = ("example", "shipped-targets", "run", "tables", "targets", "model", "layers",
             "concurrent", "cuda-path", "one-host", "one-host-others", "layers-shm",
             "auto-at-scale", "pause", "pause-targets", "layers-pause", "barrier", "steps")
    doc = tmp_path / "benchmarks.md"
    doc.write_text("".join(f"x\n<!-- generated:{n} begin -->\n| 4 KiB | 1 us |\n"
                           f"<!-- generated:{n} end -->\n" for n in names))
    readme = tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text())
    cmd = ["--readme", str(readme), "--benchmarks", str(doc), "--paper", "none"]
    rc, err = run_doc_numbers(*cmd, "--check")
    assert rc == 1 and "benchmarks.md is stale" in err
    assert run_doc_numbers(*cmd)[0] == 0
    text = doc.read_text()
    assert "| 4 KiB | 1 us |" not in text
    assert "| size | auto us | ring us |" in text                 # the tables
    assert "# cost model: T = o + alpha*A(p,n)" in text           # the model as printed
    assert "# speed targets on 2 ranks" in text                   # the targets as checked
    assert "| dist.all_reduce |" in text                          # the layers
    assert "auto / DeepSpeed SHM" in text                        # the one-host ratios
    assert "| collective | size | shm_direct | best schedule | MPI |" in text  # the others
    assert "| above the program: dispatch and per-call Python |" in text  # shm_direct's layers
    assert "| what the pause adds to a call |" in text              # the pause runs
    assert "after a 100 us pause, 4 KiB: auto <= 2x DeepSpeed" in text  # their targets
    assert "| after a 100 us sleep | added |" in text                # the layers after it
    assert "| 16,384 | rd | rd |" in text                             # auto at scale
    assert "| ringcomm auto, arriving together |" in text            # the barrier
    assert "| the lane's spare Work made complete again |" in text   # the single steps
    assert readme.read_text() == (ROOT / "README.md").read_text()  # current: not rewritten
    assert run_doc_numbers(*cmd, "--check")[0] == 0
    # a block that is missing is named
    doc.write_text("no blocks\n")
    rc, err = run_doc_numbers(*cmd, "--check")
    assert rc == 2 and "<!-- generated:example begin -->" in err


PAPER_BLOCKS = ("paper-run", "paper-breakdown", "paper-overlap", "paper-trace", "paper-buckets",
                "paper-scaling", "paper-nosync", "paper-targets", "paper-predictions",
                "paper-rr-mechanisms", "paper-rr-run", "paper-roundrobin", "paper-rr-targets",
                "paper-rr-trace")


def test_stale_paper_doc_is_detected(tmp_path, run_doc_numbers):
    # every generated block of docs/paper-reproduction.md, each with a made-up number
    doc = tmp_path / "paper.md"
    doc.write_text("".join(f"x\n<!-- generated:{n} begin -->\n| 4 KiB | 1 us |\n"
                           f"<!-- generated:{n} end -->\n" for n in PAPER_BLOCKS))
    cmd = ["--paper", str(doc)]
    rc, err = run_doc_numbers(*cmd, "--check")
    assert rc == 1 and "paper.md is stale" in err, err
    assert run_doc_numbers(*cmd)[0] == 0
    text = doc.read_text()
    assert "| 4 KiB | 1 us |" not in text
    assert "| configuration | forward | backward compute |" in text  # the breakdown
    assert "| bucket_cap_mb |" in text and "Fastest cap:" in text       # the sweep
    assert "| ranks |" in text and "| n |" in text                      # scaling, no_sync
    assert "trace overhead" in text                                   # the trace parts
    assert "| 256 |" in text and "ring allreduce T = alpha*A" in text  # the predictions
    assert "**met**" in text or "**missed**" in text                   # the targets
    assert "| configuration | buckets | K = 1 | K = 3 | K = 5 |" in text  # round robin
    assert "bench_ddp_roundrobin_2ranks.json" in text and "most in flight" in text
    assert "channels" in text and "3 channels" in text                 # its targets
    # the committed doc's blocks are the rendering of the committed JSON
    committed = (ROOT / "docs" / "paper-reproduction.md").read_text()
    for n in PAPER_BLOCKS:
        begin, end = f"<!-- generated:{n} begin -->", f"<!-- generated:{n} end -->"
        block = text[text.index(begin):text.index(end)]
        assert block in committed, n
    # a block that is missing is named
    doc.write_text("no blocks\n")
    rc, err = run_doc_numbers(*cmd, "--check")
    assert rc == 2 and "<!-- generated:paper-run begin -->" in err


def test_stale_multinode_doc_is_detected(tmp_path, run_doc_numbers):
    # docs/multi-node.md's blocks: the measured crossover, the cross-host target, the
    # runs across hosts, and how long a torchrun world takes to form
    doc = tmp_path / "multi-node.md"
    names = ("multinode-crossover", "multinode-target", "multinode-runs", "multinode-ddp",
             "world-formation")
    doc.write_text("".join(f"x\n<!-- generated:{n} begin -->\n| 4 KiB | 1 us |\n"
                           f"<!-- generated:{n} end -->\n" for n in names))
    cmd = ["--multinode", str(doc), "--paper", "none"]
    rc, err = run_doc_numbers(*cmd, "--check")
    assert rc == 1 and "multi-node.md is stale" in err, err
    assert run_doc_numbers(*cmd)[0] == 0
    text = doc.read_text()
    assert "| 4 KiB | 1 us |" not in text
    assert "hierarchical's time over the fastest flat algorithm" in text
    assert "| torchrun 2x1 1gbit |" in text and "| mpiexec 2x1 1gbit |" in text
    assert "Links: within node0:" in text and "node0 <-> node1:" in text
    assert "| size | ring | tree | recursive_doubling | rabenseifner | hierarchical |" in text
    assert "docs/data/multinode.json" in text and "bench_ddp_2hosts.json" in text
    assert "# links (ping-pong" in text and "latency breakdown per iteration" in text
    assert ("| ranks | torchrun | torchrun, tree of merges | mpiexec | torchrun / mpiexec "
            "| rounds of the tree |") in text
    assert "docs/data/world_formation.json" in text
    committed = (ROOT / "docs" / "multi-node.md").read_text()
    for n in names:
        begin = f"<!-- generated:{n} begin -->"
        block = text[text.index(begin):text.index(f"<!-- generated:{n} end -->")]
        assert block in committed, n


def test_reliability_doc_is_the_rendering_of_its_json():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "reliability_report.py"),
                           "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_reliability_json_shows_no_failed_program_and_no_wrong_value():
    import json

    doc = json.loads((ROOT / "docs" / "data" / "reliability.json").read_text())
    assert all(r["exit_status"] == 0 for r in doc["runs"]), [r["program"] for r in doc["runs"]
                                                             if r["exit_status"]]
    soak = next(r["lines"]["soak"] for r in doc["runs"] if "soak" in r["lines"])
    assert soak["wrong"] == 0 and soak["operations"] >= 1000
    assert all(s["ranks_left_running"] == 0 and s["seconds_to_exit"] is not None
               for s in doc["signals"].values())
    assert sum(len(r["cases"]) for r in doc["runs"]) >= 20


def test_conformance_doc_is_current_complete_and_every_skip_explained():
    import json

    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "conformance.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((ROOT / "docs" / "data" / "conformance.json").read_text())
    assert not doc.get("selection"), "docs/conformance.md must come from a run of the whole suite"
    assert not [t["name"] for t in doc["tests"] if t["outcome"] == "failed"]
    assert sum(t["outcome"] == "passed" for t in doc["tests"]) >= 90
    assert "not reviewed yet" not in (ROOT / "docs" / "conformance.md").read_text()


def test_architecture_worked_path_names_what_the_code_does():
    """docs/architecture.md walks a 4 KiB allreduce on 2 ranks through the layers:
    the algorithm it names is the one auto picks, and every module and function it
    names exists."""
    import importlib
    import re

    from ringcomm.algorithms import select
    from ringcomm.front import process_group
    from ringcomm.front.process_group import ProcessGroupRingcomm

    text = (ROOT / "docs" / "architecture.md").read_text()
    path = text[text.index("## Worked path"):]
    path = path[:path.index("\n## ", 1)]
    chosen = select.choose(select.load_tuning(None), "allreduce", 4096, 2)
    if chosen == "shm_direct":  # the path runs with RINGCOMM_SHM=0: MPI has no shm_direct
        chosen = select.choose(select.MODELLED, "allreduce", 4096, 2, ())
    assert f"`{chosen}`" in path and f'"allreduce[{chosen}]"' in path, chosen
    # the path it describes: torch's allreduce goes to the short path, not the generic one
    assert ProcessGroupRingcomm.allreduce is not process_group._generic_allreduce
    assert "allreduce_prepared" in inspect.getsource(ProcessGroupRingcomm.allreduce)
    for module, name in (("front.reductions", "allreduce"),
                         ("front.reductions", "allreduce_prepared"),
                         ("front.reductions", "_Allreduce"), ("front.planner", "Planner"),
                         ("front.lanes", "Lanes"), ("runtime.engine", "Engine"),
                         ("execution.executors", "P2PProgram"), ("ops", "finalize_"),
                         ("runtime.work", "Done"), ("transport.mpi", "MPITransport")):
        assert f"{module.replace('.', '/')}.py" in path or f"{module}" in path, module
        assert hasattr(importlib.import_module(f"ringcomm.{module}"), name), (module, name)
    for method in re.findall(r"`transport\.(\w+)\(", path):
        from ringcomm.transport.mpi import MPITransport
        assert hasattr(MPITransport, method), method


def test_autos_rows_for_two_ranks_are_the_committed_runs_measured_tuning():
    """The shipped 2-rank tuning is what the committed benchmark run measured (every
    algorithm, native included), not numbers typed by hand."""
    from ringcomm.algorithms import select

    run = json.loads((ROOT / "docs" / "data" / "compare_2ranks.json").read_text())
    measured = run["analysis"]["measured_tuning"]
    assert json.loads(select.MEASURED.read_text()) == measured
    for coll, rows in measured.items():
        assert select.DEFAULT_TUNING[coll]["2"] == rows["2"], coll


def test_torch_version_table_is_the_rendering_of_its_json_and_shows_no_failure():
    spec = importlib.util.spec_from_file_location("torch_compat",
                                                  ROOT / "scripts" / "torch_compat.py")
    torch_compat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(torch_compat)
    data = json.loads(torch_compat.DATA.read_text())
    text = torch_compat.DOC.read_text()
    assert torch_compat.rendered(text, data) == text, "run scripts/torch_compat.py --render-only"
    minors = {".".join(r["torch"].split(".")[:2]) for r in data["results"]}
    # the oldest supported torch, the GPU machine's, the default and the newest
    assert {"2.7", "2.11", "2.13", "2.15"} <= minors, minors
    assert all(run["ok"] for r in data["results"] for run in r["runs"]), \
        [(r["torch"], run["program"]) for r in data["results"] for run in r["runs"] if not run["ok"]]
    assert not any("FAILED" in cell for r in data["results"] for cell in r["rows"].values())


# -- the maps: README's Layout and architecture.md's diagram name every module ------
def _fenced_after(text: str, marker: str) -> str:
    """The first fenced block after ``marker``."""
    start = text.index("```", text.index(marker))
    return text[start:text.index("```", start + 3)]


def _modules(*packages: str, skip_dirs: tuple[str, ...] = ()) -> list:
    """Every module file of ``packages`` (not __init__/__main__, nor under ``skip_dirs``)."""
    out = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if path.name in ("__init__.py", "__main__.py") or any(
                    str(rel).startswith(d) for d in skip_dirs):
                continue
            out.append(rel)
    return out


def _unnamed(block: str, modules: list) -> list[str]:
    import re

    return [str(m) for m in modules if not re.search(rf"\b{re.escape(m.stem)}\b", block)]


def test_the_readme_layout_names_every_module_and_script():
    """A module added without a line in README's Layout fails here (the Layout once
    missed shm.py, the largest file, and a dozen others)."""
    block = _fenced_after((ROOT / "README.md").read_text(), "## Layout")
    # the library's modules are named by the table generated from them (below)
    modules = _modules("ringcomm", "ddp", skip_dirs=("ringcomm/library/",)) + sorted(
        p.relative_to(ROOT) for p in (ROOT / "scripts").glob("*.py"))
    assert not _unnamed(block, modules)


def test_the_architecture_diagram_names_every_module_of_its_layers():
    """The diagram names each module of the layers a call goes through, and the
    packages beside them as wholes (algorithms/, library/, bench/, msccl/, testing/)."""
    block = _fenced_after((ROOT / "docs" / "architecture.md").read_text(), "# Architecture")
    whole = ("ringcomm/algorithms/", "ringcomm/library/", "ringcomm/bench/",
             "ringcomm/msccl/", "ringcomm/testing/")
    assert not _unnamed(block, _modules("ringcomm", skip_dirs=whole))
    for package in whole:
        assert package.removeprefix("ringcomm/") in block, package


def test_the_map_check_finds_a_module_left_out():
    block = "ringcomm/   __init__.py settings.py"
    unnamed = _unnamed(block, _modules("ringcomm"))
    assert "ringcomm/backoff.py" in unnamed and "ringcomm/settings.py" not in unnamed


def test_the_library_names_exactly_the_algorithms_auto_picks():
    """ringcomm/library's docstring says which of its algorithms auto picks: exactly
    those named in select.py's rows (it once said all of them)."""
    import re

    import ringcomm.library as library
    from ringcomm.algorithms import select

    def names(rows) -> set[str]:
        if isinstance(rows, str):
            return {rows}
        if isinstance(rows, dict):
            return set().union(*(names(v) for v in rows.values()))
        if isinstance(rows, (list, tuple)):
            return set().union(set(), *(names(v) for v in rows))
        return set()

    picked = names(select.DEFAULT_TUNING) | names(json.loads(select.MEASURED.read_text()))
    doc = " ".join(library.__doc__.split())
    said = set(re.findall(r"``(\w+)``", doc.split("``auto`` picks", 1)[1].split(" where ")[0]))
    ours = {name for _, name in library.ALGORITHMS}
    assert said == ours & picked, (said, ours & picked)


def test_the_library_table_names_every_library_module():
    """A new library algorithm is its module alone: the package registers what the
    module's REGISTERS says, and docs/architecture.md's table (checked current by
    the doc_numbers test above) has a row for each of its ROWS."""
    import ringcomm
    from ringcomm import library

    files = sorted(p.stem for p in (ROOT / "ringcomm" / "library").glob("*.py")
                   if p.stem != "__init__")
    assert sorted(library.MODULES) == files
    table = library.markdown()
    for name, mod in library.MODULES.items():
        assert set(mod.ROWS) == {n for _, n in mod.REGISTERS}, name
        for algo in mod.ROWS:
            assert f"| **{algo}** |" in table and f"`library/{name}.py`" in table
        for key, build in mod.REGISTERS.items():
            assert library.ALGORITHMS[key] is build
            assert ringcomm.REGISTRY[key[0]][key[1]] is build

