"""Imports run one way: every import in ``ringcomm/`` and ``ddp/`` (function-level
ones included) goes to the module's own layer or to one the layer may use.

The layers, bottom up, as docs/architecture.md draws them:

* bottom: settings, reduce ops, the schedule model, the trace (a recorder
  every layer may call) and the mismatch error every layer words alike; they import nothing of ringcomm above them;
* transport: point-to-point only, driven and driving nothing;
* builders: the algorithms and the library, pure schedule builders (the schedule
  model, ops and the registry);
* execution: the checker, NCCL's rules, the simulator and the executors;
* runtime: engines, streams and Work, never the front;
* launch: bootstrap and the network;
* sim: the simulator (topologies, routes, timing), over the builders and the
  execution layer; its command line is top;
* front: the process group and what serves it (prepared calls, argument checks, algorithm choice,
  lanes);
* top: the package's public surface, the demo, testing helpers and the benchmark;
* ``ddp/`` uses ``torch.distributed`` and ``ringcomm.trace`` only; ``ddp.bench``
  also ringcomm's public surface and its benchmark.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: layer -> the module prefixes in it (a prefix covers its submodules)
LAYERS = {
    "bottom": ("ringcomm.settings", "ringcomm.ops", "ringcomm.schedule", "ringcomm.trace",
               "ringcomm.backoff", "ringcomm.mpi_serial", "ringcomm.machine", "ringcomm.mismatch"),
    "transport": ("ringcomm.transport",),
    "builders": ("ringcomm.algorithms", "ringcomm.library"),
    "execution": ("ringcomm.execution",),
    "runtime": ("ringcomm.runtime",),
    "launch": ("ringcomm.launch",),
    "sim": ("ringcomm.sim",),
    "front": ("ringcomm.front",),
    "top": ("ringcomm.demo", "ringcomm.testing", "ringcomm.bench", "ringcomm.msccl", "ringcomm",
            "ringcomm.sim.cli", "ringcomm.sim.__main__"),
    "ddp.bench": ("ddp.bench",),
    "ddp": ("ddp",),
}
#: layer -> the layers it may import, besides its own
MAY_USE = {
    "bottom": (),
    "transport": ("bottom",),
    "builders": (),  # and only the schedule model and ops of the bottom: BUILDER_BOTTOM
    "execution": ("bottom",),
    "runtime": ("bottom", "transport"),
    "launch": ("bottom",),
    "sim": ("bottom", "builders", "execution"),
    "front": ("bottom", "transport", "builders", "execution", "runtime", "launch", "sim"),
    "top": ("bottom", "transport", "builders", "execution", "runtime", "launch", "sim", "front"),
    "ddp": (),  # and ringcomm.trace: DDP_RINGCOMM
    "ddp.bench": ("ddp",),
}
BUILDER_BOTTOM = ("ringcomm.schedule", "ringcomm.ops")
DDP_RINGCOMM = ("ringcomm.trace",)
#: what ddp.bench may use of ringcomm: the public surface (the package itself),
#: the trace and the benchmark
DDP_BENCH_RINGCOMM = ("ringcomm.trace", "ringcomm.bench")


def _covers(prefix: str, module: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> str:
    """The layer of a ringcomm or ddp module (the longest prefix that covers it)."""
    best = max((p for ps in LAYERS.values() for p in ps if _covers(p, module)),
               key=len, default=None)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return next(name for name, ps in LAYERS.items() if best in ps)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(module: str, source: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) of every ringcomm or ddp import in ``source``: ``from X import
    y`` counts as X.y where that is a module, else as X."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base
                       for a in node.names]
        else:
            continue
        out += [(node.lineno, t) for t in targets if t.split(".")[0] in ("ringcomm", "ddp")]
    return out


def allowed(importer: str, target: str) -> bool:
    mine, theirs = layer_of(importer), layer_of(target)
    if mine == "builders":
        return theirs == "builders" or any(_covers(p, target) for p in BUILDER_BOTTOM)
    if mine == "ddp":
        return theirs == "ddp" or any(_covers(p, target) for p in DDP_RINGCOMM)
    if mine == "ddp.bench":
        return (theirs in ("ddp", "ddp.bench") or target == "ringcomm"
                or any(_covers(p, target) for p in DDP_BENCH_RINGCOMM))
    return theirs == mine or theirs in MAY_USE[mine]


def module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def violations(files: list[Path]) -> list[str]:
    out = []
    for path in files:
        module, is_package = module_name(path)
        for line, target in imports(module, path.read_text(), is_package):
            if not allowed(module, target):
                out.append(f"{path.relative_to(ROOT)}:{line}: {module} ({layer_of(module)}) "
                           f"imports {target} ({layer_of(target)})")
    return out


def _sources() -> list[Path]:
    return sorted(p for d in ("ringcomm", "ddp") for p in (ROOT / d).rglob("*.py"))


def test_imports_run_one_way():
    found = violations(_sources())
    assert not found, "imports against the layers:\n" + "\n".join(found)


def test_every_module_is_in_a_layer():
    for path in _sources():
        layer_of(module_name(path)[0])


def test_the_rules_catch_what_they_forbid():
    # the check itself can fail: imports against the layers, written as the code would
    cases = {
        "ringcomm/transport/mpi.py": "from ..execution.executors import Plan\n",
        "ringcomm/settings.py": "def f():\n    from .algorithms import REGISTRY\n",
        "ringcomm/algorithms/ring.py": "from .. import settings\n",
        "ringcomm/runtime/engine.py": "from ..front.calls import Call\n",
        "ringcomm/execution/executors.py": "from ringcomm.runtime import work\n",
        "ddp/reducer.py": "from ringcomm.front import process_group\n",
        "ddp/bench/cli.py": "from ringcomm.launch.launchers import MPI_LAUNCHER_VARS\n",
    }
    for rel, text in cases.items():
        module, is_package = module_name(ROOT / rel)
        found = [t for _, t in imports(module, text, is_package) if not allowed(module, t)]
        assert found, f"{rel}: {text!r} should be refused"
    fine = {
        "ringcomm/transport/mpi.py": "from .. import settings\nfrom .base import Handle\n",
        "ringcomm/library/bruck.py": "from ringcomm.schedule import Builder\n",
        "ringcomm/front/planner.py": ("from ..execution.executors import Plan\n"
                                   "from ringcomm.algorithms import REGISTRY\n"),
        "ddp/reducer.py": "from ringcomm import trace\n",
        "ddp/bench/cli.py": "import ringcomm\nfrom ringcomm.bench.cli import Parser\n",
    }
    for rel, text in fine.items():
        module, is_package = module_name(ROOT / rel)
        found = [t for _, t in imports(module, text, is_package) if not allowed(module, t)]
        assert not found, f"{rel}: {text!r} should be allowed, refused {found}"


def import_graph(files: list[Path]) -> dict[str, set[str]]:
    """module -> the ringcomm and ddp modules it imports (function-level imports
    included; ``from package import name`` counts as the package where ``name`` is
    no module)."""
    graph = {}
    for path in files:
        module, is_package = module_name(path)
        graph[module] = {t for _, t in imports(module, path.read_text(), is_package)}
    known = set(graph)
    return {m: {t if t in known else t.rpartition(".")[0] for t in ts} & known - {m}
            for m, ts in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    found = cycles(import_graph(_sources()))
    assert not found, "modules that import each other (directly or round a loop):\n  " + \
        "\n  ".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_finds_a_cycle_through_a_lazy_import():
    graph = import_graph(_sources())
    # a function-level import back from slurm to hosts (which imports slurm), as
    # there once was from slurm to bootstrap
    graph["ringcomm.launch.slurm"] = graph["ringcomm.launch.slurm"] | {"ringcomm.launch.hosts"}
    assert ["ringcomm.launch.hosts", "ringcomm.launch.slurm"] in cycles(graph)
    lazy = "def f():\n    from ringcomm.algorithms import select\n"
    assert "ringcomm.algorithms.select" in {t for _, t in imports("ringcomm.algorithms", lazy, True)}


#: the most lines a module of ringcomm/ or ddp/ holds, unless LONG_MODULES says why
MAX_LINES = 600
#: modules over MAX_LINES, each with why it stays one file
LONG_MODULES = {
    "ringcomm/testing/fake_nccl.py":
        "one stand-in, NCCL's API as CuPy exposes it: the library, its communicators, "
        "its streams and a recording variant share the failure rules the docstring "
        "lists, and a split would put each half's state in the other's imports",
    "ringcomm/transport/tcp.py":
        "one transport whose connections, message matching and progress are one state "
        "under one lock (a user's thread and the collectives' both move it), and the "
        "whole transport docs/architecture.md shows a newcomer",
    "ddp/reducer.py":
        "the paper's Algorithm 1 as one state machine over one iteration: a gradient's "
        "hook fills its slot (or divides it where it lies), launches buckets in order, "
        "and the end of backward waits and writes back; each step reads what the others "
        "left, and the parts that stand alone are modules already (buckets, iteration, "
        "graph, join, delayed, mixed_precision)",
    "ringcomm/msccl/translate.py":
        "one algorithm, MSCCL's program played in rounds: the layout, the connections, "
        "the rounds and the temporaries are the parts of one pass (_Play) over them",
}


def test_no_module_is_over_the_limit_unless_it_says_why():
    """A file of one idea stays short enough to read; those that are longer say why
    here (and an entry whose file came back under the limit goes)."""
    long = {str(p.relative_to(ROOT)): n for d in ("ringcomm", "ddp")
            for p in sorted((ROOT / d).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert set(long) == set(LONG_MODULES), long
