"""Which algorithm ``auto`` runs: a rule per collective over message size and
world size. The thresholds are a built-in default; ``RINGCOMM_TUNING`` may
name a JSON file with the same shape to replace them.
"""
from __future__ import annotations

import json
import logging

from .. import settings

log = logging.getLogger("ringcomm")

#: collective -> list of [max_bytes, algorithm] rows, first match wins; a
#: ``max_bytes`` of None matches everything. Rows keyed by world size override
#: the "default" rows for that size.
DEFAULT_TUNING: dict[str, dict[str, list]] = {
    # Recursive doubling needs log2 p exchanges, a tree 2 log2 p steps, a ring
    # 2(p-1): the fewer steps win while latency dominates; the ring's bandwidth
    # optimality pays for large messages.
    "allreduce": {"default": [[16384, "recursive_doubling"], [65536, "tree"], [None, "ring"]],
                  # Measured (scripts/compare_collectives.py, docs/benchmarks.md): on two
                  # ranks one whole-buffer exchange beats the ring up to about 450 KiB.
                  "2": [[458752, "recursive_doubling"], [None, "ring"]]},
    # A binomial tree sends log2 p copies from the root; a chain sends one per rank.
    "broadcast": {"default": [[262144, "tree"], [None, "ring"]],
                  "2": [[None, "tree"]], "3": [[None, "tree"]]},
    "reduce": {"default": [[None, "tree"]]},
    "allgather": {"default": [[None, "ring"]]},
    "reduce_scatter": {"default": [[None, "ring"]]},
    "barrier": {"default": [[None, "dissemination"]]},
    "gather": {"default": [[None, "linear"]]},
    "scatter": {"default": [[None, "linear"]]},
    "alltoall": {"default": [[None, "linear"]]},
}


def load_tuning(path: str | None = None) -> dict[str, dict[str, list]]:
    """The tuning table: DEFAULT_TUNING overlaid with the JSON file at ``path``
    (or ``$RINGCOMM_TUNING``).

    Raises:
        ValueError: the file is unreadable or not of the expected shape.
    """
    from . import REGISTRY  # here: algorithms/__init__ imports this module's neighbours

    table = {k: dict(v) for k, v in DEFAULT_TUNING.items()}
    path = path or settings.get("RINGCOMM_TUNING")
    if not path:
        return table
    try:
        with open(path) as f:
            loaded = json.load(f)
        for coll, rows_by_size in loaded.items():
            if coll not in table:
                raise ValueError(f"unknown collective {coll!r}")
            for key, rows in rows_by_size.items():
                for max_bytes, algo in rows:
                    if not (max_bytes is None or isinstance(max_bytes, int)) or not isinstance(algo, str):
                        raise ValueError(f"bad row {[max_bytes, algo]!r} for {coll}/{key}")
                    if algo not in REGISTRY[coll]:
                        raise ValueError(f"{coll}/{key} names algorithm {algo!r}; registered: "
                                         f"{sorted(REGISTRY[coll])}")
                table[coll][str(key)] = rows
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"ringcomm: cannot use tuning file {path!r}: {e}") from e
    return table


def choose(table: dict, collective: str, nbytes: int, world_size: int) -> str:
    """Algorithm name for a ``collective`` of ``nbytes`` per rank on ``world_size`` ranks."""
    rows_by_size = table[collective]
    rows = rows_by_size.get(str(world_size), rows_by_size["default"])
    for max_bytes, algo in rows:
        if max_bytes is None or nbytes <= max_bytes:
            return algo
    return rows[-1][1]
