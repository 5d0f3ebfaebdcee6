"""A library of collective algorithms, written through the names a user's code
outside ringcomm may use (:mod:`ringcomm.schedule`,
:func:`ringcomm.register_algorithm`, ``ringcomm.REGISTRY``), as a user would
write one; ``hierarchical`` also reads auto's built-in tuning table
(``ringcomm.algorithms.select.DEFAULT_TUNING``) for the crossover of its
leaders' exchange. ``import ringcomm`` registers them.

======================  ============  ==================================================
algorithm               collective    steps (p ranks, k segments per message)
======================  ============  ==================================================
``rabenseifner``        allreduce     2 log2 q, +2 if p > q (q: largest power of 2 <= p)
``double_tree``         allreduce     about k + 2 log2 p rounds (k segments per half)
``hierarchical``        allreduce     binomial within hosts + any allreduce across them
``bruck``               allgather     ceil(log2 p) + a local rotation
``pairwise``            alltoall      p - 1
``one_shot``            allreduce     k: every buffer to every rank, reduced everywhere
``two_shot``            allreduce     k + 1: direct reduce-scatter, then direct allgather
``direct``              allgather,    1 (allgather, broadcast) or k (reduce_scatter):
                        broadcast,    every rank straight to every rank
                        reduce_scatter
======================  ============  ==================================================

The direct ones (``direct.py``) are for one host, where shared memory moves every
pair's message at once and a step costs a hand-over, not a trip over a link.

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

from typing import Callable

from ringcomm.algorithms import register_algorithm
from ringcomm.library import bruck, direct, double_tree, hierarchical, pairwise, rabenseifner

#: (collective, name) -> builder, for every algorithm this package registers
ALGORITHMS: dict[tuple[str, str], Callable] = {
    ("allreduce", "rabenseifner"): rabenseifner.allreduce,
    ("allreduce", "double_tree"): double_tree.allreduce,
    ("allreduce", "hierarchical"): hierarchical.allreduce,
    ("allgather", "bruck"): bruck.allgather,
    ("alltoall", "pairwise"): pairwise.alltoall,
    ("allreduce", "one_shot"): direct.one_shot,
    ("allreduce", "two_shot"): direct.two_shot,
    ("allgather", "direct"): direct.allgather,
    ("broadcast", "direct"): direct.broadcast,
    ("reduce_scatter", "direct"): direct.reduce_scatter,
}

for (_collective, _name), _build in ALGORITHMS.items():
    register_algorithm(_collective, _name, _build, verify=False)

__all__ = ["ALGORITHMS", "bruck", "direct", "double_tree", "hierarchical", "pairwise", "rabenseifner"]
