"""Which algorithm ``auto`` runs: a rule per collective over message size and
world size. The thresholds are a built-in default; ``RINGCOMM_TUNING`` may
name a JSON file with the same shape to replace them.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from ringcomm.algorithms import ON_UNREGISTER, REGISTRY

log = logging.getLogger("ringcomm")

MiB = 1 << 20


def _allreduce_rows(rabenseifner: int, double_tree: int = 0) -> list:
    """The built-in allreduce rows with the library's algorithms taking over the ring's
    band: rabenseifner up to ``rabenseifner`` bytes, then double_tree up to
    ``double_tree`` (0: not at all), then the ring."""
    rows: list = [[16384, "recursive_doubling"], [65536, "tree"], [rabenseifner, "rabenseifner"]]
    if double_tree:
        rows.append([double_tree, "double_tree"])
    return rows + [[None, "ring"]]


#: collective -> {key: list of [max_bytes, algorithm] rows}; in a list the first
#: row whose ``max_bytes`` is at least the call's bytes wins (None matches
#: everything). ``nbytes`` is the whole buffer for allreduce, broadcast and
#: reduce, one rank's chunk for allgather and reduce_scatter, 0 (size unknown to
#: the other ranks) for alltoall, gather and scatter. Keys, most specific first:
#: ``"hosts"`` (the group spans several hosts and some host holds several of its
#: ranks), an exact world size (``"4"``), a range ``">=N"`` (world sizes from N on,
#: the largest such N that fits wins), ``"default"``.
DEFAULT_TUNING: dict[str, dict[str, list]] = {
    # Recursive doubling needs log2 p exchanges, a tree 2 log2 p steps, a ring
    # 2(p-1): the fewer steps win while latency dominates; the ring's bandwidth
    # optimality pays for large messages.
    "allreduce": {"default": [[16384, "recursive_doubling"], [65536, "tree"], [None, "ring"]],
                  # 2 ranks: measured, from MEASURED below
                  # The library's allreduces where the cost model says they beat the
                  # built-in row above: scripts/library_tuning.py's bands (in
                  # docs/data/library_tuning.json), the model fitted jointly to the
                  # measured ring, tree and recursive doubling of docs/data/compare_2ranks.json.
                  # Rabenseifner sends what the ring sends in 2 log2 p steps instead of
                  # 2(p-1); on a power of two it wins up to several MiB, more with p.
                  # The rows of 9, 48 and 96 ranks and up are the previous model's (of a
                  # slower per-message cost: larger bands), the script computing none there.
                  "4": [[16384, "recursive_doubling"], [741455, "rabenseifner"], [None, "ring"]],
                  "8": [[16384, "recursive_doubling"], [2965821, "rabenseifner"], [None, "ring"]],
                  "16": [[16384, "recursive_doubling"], [7053950, "rabenseifner"], [None, "ring"]],
                  "32": [[16384, "recursive_doubling"], [14107901, "rabenseifner"], [None, "ring"]],
                  "64": [[16384, "recursive_doubling"], [33554432, "rabenseifner"], [None, "ring"]],
                  "128": [[16384, "recursive_doubling"], [67108864, "rabenseifner"],
                           [None, "ring"]],
                  "256": [[16384, "recursive_doubling"], [134217728, "rabenseifner"],
                           [None, "ring"]],
                  ">=5": [[16384, "recursive_doubling"], [65536, "tree"], [None, "ring"]],
                  ">=6": [[16384, "recursive_doubling"], [65536, "tree"], [110218, "rabenseifner"],
                           [None, "ring"]],
                  ">=7": [[16384, "recursive_doubling"], [38968, "tree"], [185364, "rabenseifner"],
                           [None, "ring"]],
                  ">=9": _allreduce_rows(1 * MiB),     # 9: 76 KiB-1 MiB; 10: -1.2 MiB
                  ">=12": [[16384, "recursive_doubling"], [32768, "tree"],
                            [440872, "rabenseifner"],
                            [None, "ring"]],
                  ">=24": [[16384, "recursive_doubling"], [19484, "tree"],
                            [1048576, "rabenseifner"],
                            [None, "ring"]],
                  ">=48": _allreduce_rows(5 * MiB, 16 * MiB),   # 48: -5.7 MiB; dt 6.7-19 MiB
                  ">=96": _allreduce_rows(6 * MiB, 64 * MiB),   # 96: -6.7 MiB; dt 8-90 MiB
                  # From 512 ranks on, the model with every algorithm's features counted
                  # at the world size itself (scripts/auto_at_scale.py,
                  # docs/data/auto_at_scale.json; powers of two to 16,384): the tree
                  # pays log2 p children at its root, double_tree 2x its bytes, and
                  # the ring's 2(p-1) steps come to outweigh Rabenseifner's 2 log2 p
                  # at ever larger sizes (at 8,192 ranks 2.5x at 256 MiB).
                  ">=512": [[16384, "recursive_doubling"], [64 * MiB, "rabenseifner"],
                            [None, "ring"]],
                  ">=2048": [[16384, "recursive_doubling"], [256 * MiB, "rabenseifner"],
                             [None, "ring"]],
                  ">=8192": [[16384, "recursive_doubling"], [None, "rabenseifner"]],
                  # Several ranks per host on several hosts: reduce within hosts, only
                  # the hosts' first ranks talk across, so each inter-host link carries
                  # the buffer once per host, not once per rank. Measured across
                  # namespace hosts (scripts/bench_hosts.py; the ratios are in
                  # docs/multi-node.md): on 2 hosts x 2 ranks with 1 Gbit/s between hosts
                  # it is the fastest from 128 KiB on; below 16 KiB recursive doubling's
                  # log2 p steps (its first ones within hosts) beat its 2 log2 L + log2 H.
                  "hosts": [[16384, "recursive_doubling"], [None, "hierarchical"]]},
    # A binomial tree sends log2 p copies from the root; a chain sends one per rank.
    "broadcast": {"default": [[262144, "tree"], [None, "ring"]],
                  "3": [[None, "tree"]]},  # 2 ranks: measured, from MEASURED below
    "reduce": {"default": [[None, "tree"]]},
    # Bruck: ceil(log2 p) steps against the ring's p-1, the same bytes, plus a copy of
    # the whole output (its rotation). By the model above (alpha 130 us, beta 0.251
    # ns/B from the measured ring allgather; copies at gamma) it wins up to the bytes
    # per chunk below; on 3 ranks (2 steps either way) never. Its scratch is the
    # whole output (p chunks), which these thresholds keep below p * 512 KiB.
    "allgather": {"default": [[None, "ring"]],
                  ">=4": [[196608, "bruck"], [None, "ring"]],   # 4, 5: up to 215 KiB
                  ">=6": [[327680, "bruck"], [None, "ring"]],   # 6: 340 KiB; 7: 410 KiB
                  ">=8": [[524288, "bruck"], [None, "ring"]]},  # 8: 512 KiB; 64: 1 MiB
    "reduce_scatter": {"default": [[None, "ring"]]},
    "barrier": {"default": [[None, "dissemination"]]},
    "gather": {"default": [[None, "linear"]]},
    "scatter": {"default": [[None, "linear"]]},
    # No pairwise row: alltoall is chosen without a size (ranks may send different
    # amounts), and the model, which counts the busiest rank's bytes but not
    # congestion, never has pairwise (p-1 steps) beat linear (1 step, same bytes).
    # Select it for large exchanges on a congested network:
    # ringcomm.set_algorithm("alltoall", "pairwise").
    "alltoall": {"default": [[None, "linear"]]},
}

#: the rows for 2 ranks are measured, not modelled: the committed benchmark run's
#: ``analysis.measured_tuning`` (docs/data/compare_2ranks.json, every algorithm,
#: native included), written by ``python -m ringcomm.bench --model-from
#: docs/data/compare_2ranks.json --write-tuning ringcomm/algorithms/measured_2ranks.json``
MEASURED = Path(__file__).with_name("measured_2ranks.json")
#: the rows before the measured ones: what auto falls back to where a measured row
#: names the communication library's own collective and it cannot take the call (bfloat16 on MPI)
MODELLED: dict[str, dict[str, list]] = {k: dict(v) for k, v in DEFAULT_TUNING.items()}
for _coll, _rows in json.loads(MEASURED.read_text()).items():
    DEFAULT_TUNING[_coll].update(_rows)
#: A barrier carries no data: where every rank of the group shares one host, the
#: shared-memory transport's own round (each rank writes one word and reads its
#: peers') releases the ranks sooner and closer together than a schedule's
#: messages, at every world size (``scripts/bench_barrier.py``,
#: docs/data/barrier_2ranks.json). Where it cannot run (several hosts, no shared
#: memory, a device's lane) auto takes the modelled row: dissemination.
DEFAULT_TUNING["barrier"] = {"default": [[None, "shm_direct"]]}

_KEY = re.compile(r"default|hosts|\d+|>=\d+")


def measured_keys(path: str | None = None) -> dict[str, set[str]]:
    """collective -> the world sizes whose rows were measured, not modelled: the
    committed 2-rank rows (:data:`MEASURED`) and the exact world sizes of the tuning
    file at ``path`` (a user's own table counts as measured).

    Raises:
        ValueError: as :func:`load_tuning`.
    """
    out = {c: {k for k in rows if k.isdigit()}
           for c, rows in json.loads(MEASURED.read_text()).items()}
    if path:
        load_tuning(path)  # the same checks and errors
        with open(path) as f:
            for coll, rows in json.load(f).items():
                out.setdefault(coll, set()).update(k for k in rows if str(k).isdigit())
    return out


def load_tuning(path: str | None = None) -> dict[str, dict[str, list]]:
    """The tuning table: DEFAULT_TUNING overlaid with the JSON file at ``path``
    (None: none; the planner passes ``RINGCOMM_TUNING``'s, resolved by
    :class:`ringcomm.Options`), key by key; a file that sets a collective's
    ``"default"`` replaces all the built-in rows of that collective but ``"hosts"``
    (the built-in world-size rows refine the built-in default, not the file's).

    Raises:
        ValueError: the file is unreadable or not of the expected shape.
    """
    table = {k: dict(v) for k, v in DEFAULT_TUNING.items()}
    if not path:
        return table
    try:
        with open(path) as f:
            loaded = json.load(f)
        for coll, rows_by_size in loaded.items():
            if coll not in table:
                raise ValueError(f"unknown collective {coll!r}")
            if "default" in rows_by_size:
                table[coll] = {k: v for k, v in table[coll].items() if k == "hosts"}
            for key, rows in rows_by_size.items():
                if not _KEY.fullmatch(str(key)):
                    raise ValueError(f"{coll}: bad key {key!r} (a world size, '>=N', "
                                     "'hosts' or 'default')")
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


#: (collective, world size) -> [(lowest bytes, highest bytes or None, algorithm)]:
#: bands of message sizes that ``auto`` gives to an algorithm ahead of its table
#: (:func:`add_band`; ringcomm.msccl: an MSCCL file's minBytes..maxBytes)
BANDS: dict[tuple[str, int], list] = {}


def add_band(collective: str, world_size: int, low: int, high: int | None,
             algorithm: str) -> None:
    """Let ``auto`` run ``algorithm`` for calls of ``low``..``high`` bytes (as auto
    counts them, see :data:`DEFAULT_TUNING`; ``high`` None: no upper bound) on
    ``world_size`` ranks. An algorithm that does not serve such a call (it raises
    ``ShapeNotServed``) leaves it to the table."""
    BANDS.setdefault((collective, world_size), []).append((low, high, algorithm))


def remove_bands(collective: str, algorithm: str) -> None:
    """Drop every band of ``algorithm`` (unregistered, or its registration replaced)."""
    for key in [k for k in BANDS if k[0] == collective]:
        BANDS[key] = [b for b in BANDS[key] if b[2] != algorithm]
        if not BANDS[key]:
            del BANDS[key]


def multi_host(hosts: tuple) -> bool:
    """Whether a group with this host layout (:class:`ringcomm.schedule.Context`)
    spans several hosts and holds several ranks on at least one of them."""
    return bool(hosts) and len(set(hosts)) < len(hosts)


def choose(table: dict, collective: str, nbytes: int, world_size: int,
           hosts: tuple = (), bands: bool = True) -> str:
    """Algorithm name for a ``collective`` of ``nbytes`` on ``world_size`` ranks laid
    out on ``hosts`` (see :data:`DEFAULT_TUNING` for which rows apply); a band of
    :data:`BANDS` first, unless ``bands`` is False."""
    if bands:
        for low, high, algo in BANDS.get((collective, world_size), ()):
            if low <= nbytes and (high is None or nbytes <= high):
                return algo
    rows_by_size = table[collective]
    rows = rows_by_size.get("hosts") if multi_host(hosts) else None
    if rows is None:
        rows = rows_by_size.get(str(world_size))
    if rows is None:
        ranges = [int(k[2:]) for k in rows_by_size if k.startswith(">=")]
        fits = [lo for lo in ranges if lo <= world_size]
        rows = rows_by_size[f">={max(fits)}"] if fits else rows_by_size["default"]
    for max_bytes, algo in rows:
        if max_bytes is None or nbytes <= max_bytes:
            return algo
    return rows[-1][1]


def _unregistering(collective: str, algorithm: str) -> None:
    """Before ``algorithm`` is unregistered: refuse one that auto's built-in tuning
    names, else drop its bands.

    Raises:
        ValueError: ``DEFAULT_TUNING`` names ``algorithm`` for ``collective``.
    """
    if any(algo == algorithm for rows in DEFAULT_TUNING.get(collective, {}).values()
           for _, algo in rows):
        raise ValueError(f"ringcomm.unregister_algorithm: {collective} algorithm "
                         f"{algorithm!r} is in auto's built-in tuning")
    remove_bands(collective, algorithm)


ON_UNREGISTER.append(_unregistering)
