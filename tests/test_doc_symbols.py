"""Every project name the docs put in backticks exists: a dotted name that starts
with one of ringcomm's or ddp's modules or classes (``front.calls.Call``,
``Planner.signature``, ``ringcomm.trace.merge``) resolves to a module, a class
member or an attribute the class sets, and a file name the docs give
(``front/calls.py``, ``docs/data/compare_2ranks.json``) is a file of the repo.

Names of other projects (``torch.*``, ``dist.*``, MPI's, NCCL's, a user's
``model``) are not this test's to check; :data:`ELSEWHERE` lists the few that
look like the project's own."""
from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT

#: spans that look like a project name or file but name something else: the doc
#: they are in, and why
ELSEWHERE = {
    "model.module.state_dict": "ddp.md: the user's model wrapped by DDP, not ringcomm.bench.cost_model",
    "program.name": "msccl-format.md: an attribute of MSCCL's XML <algo>, not msccl/ code",
    "LICENSE.txt": "msccl-format.md: msccl-executor's licence file",
    "train.py": "multi-node.md: the user's training script",
    "docs/data/gpu_check.json": "gpu-results.md: written by the first run on a GPU",
}
#: file extensions whose names are checked as paths of the repo
FILE_SUFFIXES = ("py", "md", "json", "png", "sh", "xml", "toml")
#: folders of other repositories the docs cite (NCCL's src/, msccl-tools' language/
#: and its tools/)
FOREIGN_ROOTS = ("src/", "msccl/language/", "tools/")


def doc_files() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def backticked(text: str) -> list[str]:
    """The inline code spans of a Markdown text (fenced blocks left out)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", text)


def _tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()


class Index:
    """ringcomm's and ddp's modules by every dotted suffix of their names, and
    their top-level classes and functions by name."""

    def __init__(self):
        self.modules: dict[str, set[str]] = {}
        self.defs: dict[str, set[tuple[str, str]]] = {}
        for path in sorted(p for d in ("ringcomm", "ddp") for p in (ROOT / d).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__main__":
                continue
            if parts[-1] == "__init__":
                parts.pop()
            full = ".".join(parts)
            for i in range(len(parts)):
                self.modules.setdefault(".".join(parts[i:]), set()).add(full)
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                    self.defs.setdefault(node.name.lower(), set()).add((full, node.name))

    def starts(self, parts: list[str]) -> list[tuple[object, list[str]]]:
        """What the first parts of a dotted name may be, each with the rest."""
        out: list[tuple[object, list[str]]] = []
        for i in range(len(parts), 0, -1):
            mods = self.modules.get(".".join(parts[:i]))
            if mods:
                out += [(importlib.import_module(m), parts[i:]) for m in sorted(mods)]
                break
        # a class by its name, or by the name of its instances (`engine.fence`)
        for module, name in sorted(self.defs.get(parts[0].lower(), ())):
            if parts[0] == name or parts[0] == name.lower():
                out.append((getattr(importlib.import_module(module), name), parts[1:]))
        return out


def _sets(obj: object, name: str) -> bool:
    """Whether a class (or a base) sets or declares ``name``: ``self.name = ...`` in a
    method, an entry of its ``__slots__``, or a name assigned or annotated in its body
    (a field)."""
    for klass in getattr(obj, "__mro__", ())[:-1]:  # object itself sets nothing
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (TypeError, OSError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node in body:  # the class body: fields, __slots__
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, ast.AnnAssign) else [])
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name)
                                                    and t.id == "__slots__" for t in node.targets):
                try:
                    if name in ast.literal_eval(node.value):
                        return True
                except ValueError:  # slots computed: the self.name check below decides
                    pass
        for node in ast.walk(tree):  # self.name = ... in any method
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and node.attr == name and isinstance(node.value, ast.Name)
                    and node.value.id == "self"):
                return True
    return False


def _has(obj: object, rest: list[str]) -> bool:
    """Whether ``obj.rest[0].rest[1]...`` exists; its last part may be an attribute
    its class sets on instances."""
    for i, part in enumerate(rest):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            return i == len(rest) - 1 and inspect.isclass(obj) and _sets(obj, part)
    return True


def resolves(index: Index, name: str) -> bool | None:
    """True: ``name`` exists; False: it names the project but does not; None: not
    the project's."""
    starts = index.starts(name.split("."))
    if not starts:
        return None
    return any(_has(obj, rest) for obj, rest in starts)


def _where(doc: Path) -> str:
    return str(doc.relative_to(ROOT)) if doc.is_relative_to(ROOT) else doc.name


def dead_names(docs: list[Path]) -> tuple[list[str], int]:
    """(the dotted names that name nothing, the number that resolved)."""
    index, dead, found = Index(), [], 0
    for doc in docs:
        for span in backticked(doc.read_text()):
            name = span[:-2] if span.endswith("()") else span
            if (name in ELSEWHERE or re.search(rf"\.({'|'.join(FILE_SUFFIXES)})$", name)
                    or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", name)):
                continue
            ok = resolves(index, name)
            found += ok is True
            if ok is False:
                dead.append(f"{_where(doc)}: `{span}`")
    return dead, found


def missing_files(docs: list[Path]) -> tuple[list[str], int]:
    """(the file names that are no file of the repo, the number found)."""
    files = _tracked()
    missing, found = [], 0
    for doc in docs:
        for span in backticked(doc.read_text()):
            if (span in ELSEWHERE or span.startswith(FOREIGN_ROOTS)
                    or not re.fullmatch(rf"[\w./-]+\.({'|'.join(FILE_SUFFIXES)})", span)):
                continue
            if any(f == span or f.endswith("/" + span) for f in files):
                found += 1
            else:
                missing.append(f"{_where(doc)}: `{span}`")
    return missing, found


def test_every_dotted_project_name_in_the_docs_exists():
    dead, found = dead_names(doc_files())
    assert not dead, "the docs name what the code does not have:\n  " + "\n  ".join(dead)
    assert found > 50, f"only {found} names resolved: the test is not reading the docs"


def test_every_file_the_docs_name_is_in_the_repo():
    missing, found = missing_files(doc_files())
    assert not missing, "the docs name files the repo does not have:\n  " + "\n  ".join(missing)
    assert found > 50, f"only {found} files found: the test is not reading the docs"


@pytest.mark.parametrize("text, dead", [
    ("`ProcessGroupRingcomm._submit` records the enqueue", ["ProcessGroupRingcomm._submit"]),
    ("`execution.executors.run_grouped`", ["execution.executors.run_grouped"]),
    ("`ringcomm.trace.merge` and `engine.fence()`", []),
    ("`Planner.signature`, `calls.Call.owned`, `ops.Averaging`", []),
    ("`Planner.key` and `Engine.value`", ["Planner.key", "Engine.value"]),  # locals
    ("`torch.distributed.nothing_here` and `dist.Work`", []),  # not the project's
    ("`front/calls.py`", []),
    ("```\n`front.nothing`\n```", []),  # fenced: an example, not a claim
])
def test_the_check_finds_a_dead_name_and_only_that(tmp_path, text, dead):
    doc = tmp_path / "doc.md"
    doc.write_text(text + "\n")
    assert [d.split("`")[1].removesuffix("()") for d in dead_names([doc])[0]] == dead


def test_the_check_finds_a_missing_file(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("`front/calls.py`, `front/requests.py`, `src/graph/topo.cc.py`\n")
    assert [m.split("`")[1] for m in missing_files([doc])[0]] == ["front/requests.py"]


#: a cross-reference in a docstring or comment: :mod:`ringcomm.x`, :func:`~.y`
_XREF = re.compile(r":(?:mod|func|class|meth|data|attr|exc):`~?\.?([\w.]+)`")


def dead_references(paths: list[Path]) -> tuple[list[str], int]:
    """(the cross-references in ringcomm's and ddp's sources that name nothing, the
    number that resolved). A name of the project resolves from the package root; any
    other from the module it is written in (its classes, functions, attributes)."""
    dead, found = [], 0
    for path in paths:
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for name in _XREF.findall(path.read_text()):
            parts = name.split(".")
            if parts[0] in ("ringcomm", "ddp"):
                ok = _importable(parts)
            elif parts[0] in ("torch", "dist", "numpy", "cupy", "mpi4py", "MPI", "threading"):
                continue
            else:
                ok = _in_scope(module, parts)
            found += ok
            if not ok:
                dead.append(f"{path.relative_to(ROOT)}: {name}")
    return dead, found


def _importable(parts: list[str]) -> bool:
    """Whether the longest importable prefix of ``parts`` has the rest as attributes
    (the last may be one a class sets on its instances)."""
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return _has(obj, parts[i:])
    return False


def _in_scope(module: str, parts: list[str]) -> bool:
    """Whether a relative reference written in ``module`` names something of it, of
    one of its classes (a method referred to from its class), or of its package."""
    mod = importlib.import_module(module)
    classes = [c for c in vars(mod).values()
               if inspect.isclass(c) and c.__module__ == module]
    package = module if ROOT.joinpath(*module.split("."), "__init__.py").exists() \
        else module.rpartition(".")[0]
    return (_has(mod, parts) or any(_has(c, parts) for c in classes)
            or _importable(package.split(".") + parts))


def test_every_cross_reference_in_the_code_exists():
    sources = sorted(p for d in ("ringcomm", "ddp") for p in (ROOT / d).rglob("*.py"))
    dead, found = dead_references(sources)
    assert not dead, "docstrings refer to what does not exist:\n  " + "\n  ".join(dead)
    assert found > 100, f"only {found} references resolved"
