"""docs/writing-an-algorithm.md stays true: its Python blocks run, in order, in one
namespace, each printing exactly the ``text`` block under it; its benchmark
command lines parse and name registered algorithms."""
from __future__ import annotations

import contextlib
import io
import re
import shlex

import pytest

from conftest import ROOT

DOC = ROOT / "docs" / "writing-an-algorithm.md"


def blocks(text: str) -> list[tuple[str, str]]:
    """``(language, code)`` of every fenced block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.S | re.M)


@pytest.fixture
def registry():
    """The tutorial registers an algorithm: take it out again afterwards, so other
    tests (which iterate over every registered algorithm) do not see it."""
    from ringcomm.algorithms import REGISTRY

    saved = {c: dict(algos) for c, algos in REGISTRY.items()}
    yield REGISTRY
    for c, algos in saved.items():
        REGISTRY[c].clear()
        REGISTRY[c].update(algos)


def test_tutorial_python_blocks_run_and_print_what_it_shows(registry):
    found = blocks(DOC.read_text())
    assert sum(lang == "python" for lang, _ in found) >= 8
    namespace: dict = {"__name__": "tutorial"}
    last_output, shown = None, True
    for i, (lang, code) in enumerate(found):
        if lang == "python":
            assert shown, f"block {i - 1} printed output the document does not show"
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code, f"{DOC.name} block {i}", "exec"), namespace)  # noqa: S102
            last_output, shown = out.getvalue(), not out.getvalue()
        elif lang == "text":
            assert last_output is not None and not shown, f"block {i}: no output to compare"
            assert last_output.strip() == code.strip(), f"block {i}:\n{last_output}"
            shown = True
    assert shown
    assert "my_rabenseifner" in registry["allreduce"]


def test_tutorial_benchmark_commands_parse(registry):
    from ringcomm.bench import cli

    from ringcomm.library import rabenseifner  # noqa: F401  (the library is registered)

    registry["allreduce"].setdefault("my_rabenseifner", rabenseifner.allreduce)
    commands = [line for lang, code in blocks(DOC.read_text()) if lang == "bash"
                for line in code.splitlines() if "ringcomm.bench" in line]
    assert len(commands) >= 2
    for line in commands:
        words = shlex.split(line)
        args = [w for w in words[words.index("-m") + 2:]]
        if "--import" in args:  # the tutorial's own module stands for my_algorithms
            args[args.index("--import") + 1] = "ringcomm.library"
        parsed = cli.parse_args(args)
        for name in parsed.algo_list:
            assert name in registry["allreduce"], (line, name)
