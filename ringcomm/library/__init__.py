"""A library of collective algorithms, written through the names a user's code
outside ringcomm may use (:mod:`ringcomm.schedule`,
:func:`ringcomm.register_algorithm`, ``ringcomm.REGISTRY``), as a user would
write one; ``hierarchical`` also reads auto's built-in tuning table
(``ringcomm.algorithms.select.DEFAULT_TUNING``) for the crossover of its
leaders' exchange. ``import ringcomm`` registers them.

Each module says what it registers (``REGISTERS``: (collective, name) -> builder)
and how each of its algorithms works and where it wins (``ROWS``); this package
registers every module's algorithms and renders their table
(:func:`markdown`, which ``scripts/doc_numbers.py`` writes into docs/architecture.md). A new algorithm is a module here:
nothing else names it.

They are registered with ``verify=False``: like the built-ins they are proved by
the test suite (``tests/test_library.py`` checks them with
:func:`ringcomm.execution.checker.check` over world sizes, layouts and host layouts, and
runs them under both executors and against gloo), so they skip the first-use
check, which at 256 ranks costs up to 2 s per all-to-all shape. A user's algorithm
registered without ``verify=False`` is checked at first use.

``auto`` picks ``rabenseifner``, ``double_tree``, ``hierarchical``, ``bruck`` and
``pairwise`` where the cost model or a measurement says they win (the rows of
``ringcomm/algorithms/select.py``; ``pairwise`` on 2 ranks, as measured).
``one_shot``, ``two_shot`` and ``direct`` are never its pick: name them
(``RINGCOMM_ALGO``, ``ringcomm.set_algorithm``) where they help. The tutorial
``docs/writing-an-algorithm.md`` rebuilds Rabenseifner step by step.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

from ringcomm.algorithms import register_algorithm

#: the library's modules, by name: every module of this package that registers
#: algorithms (``REGISTERS``)
MODULES = {m.name: importlib.import_module(f"{__name__}.{m.name}")
           for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)}
MODULES = {name: mod for name, mod in MODULES.items() if hasattr(mod, "REGISTERS")}

#: (collective, name) -> builder, for every algorithm this package registers
ALGORITHMS: dict[tuple[str, str], Callable] = {
    key: build for mod in MODULES.values() for key, build in mod.REGISTERS.items()}

for (_collective, _name), _build in ALGORITHMS.items():
    register_algorithm(_collective, _name, _build, verify=False)

def markdown() -> str:
    """The library's table: one row per algorithm, from its module's ``ROWS``, with
    the collectives it registers."""
    rows = ["| algorithm | collective | module | steps | wins (by the cost model, "
            "`scripts/library_tuning.py`) |", "|---|---|---|---|---|"]
    for mod_name, mod in MODULES.items():
        for name, (steps, wins) in mod.ROWS.items():
            colls = ", ".join(c for c, n in mod.REGISTERS if n == name)
            rows.append(f"| **{name}** | {colls} | `library/{mod_name}.py` | {steps} | {wins} |")
    return "\n".join(rows)


__all__ = ["ALGORITHMS", "MODULES", "markdown", *MODULES]
