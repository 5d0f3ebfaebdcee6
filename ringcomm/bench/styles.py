"""One look (colour, marker, line style) per implementation, shared by every plot
the benchmark tools draw: :func:`ringcomm.bench.report.plot` (compare_collectives)
and :func:`ddp.bench.plots.plot` (bench_ddp); and one axis of message sizes
(:func:`size_axis`), labelled in bytes, for every plot against size.

A name always gets the same look, in every panel and every figure, whatever else a
panel shows: the look comes from the name alone, never from a column's position.

* ringcomm's own code (its algorithms: ``auto``, ``ring``, ``tree``, ...; this
  project's DDP, ``ours/<backend>`` and ``off/<backend>``) is drawn in solid,
  coloured lines (:data:`ALGORITHMS`).
* The peers it is measured against (the MPI library's collective ``mpi``, torch's
  ``gloo`` and ``nccl``, the ``floor``, ``deepspeed``, torch's DDP ``torch/<backend>``) are drawn
  in greys and black, dashed (the floor, a lower bound, dotted) (:data:`PEERS`).
* Any other name (an algorithm a user registered, an MSCCL XML's) gets a stable
  look hashed from the name (not Python's salted ``hash``) into spare colours
  that no fixed name uses: coloured and solid, or grey and dashed for a
  ``torch/...`` name.
"""
from __future__ import annotations

import zlib

from ringcomm.bench.sizes import format_size

#: at most this many labelled sizes on a size axis
MAX_SIZE_TICKS = 10

#: ringcomm's algorithms and DDP: name -> (colour, marker), drawn solid
ALGORITHMS: dict[str, tuple[str, str]] = {
    "auto": ("#1f77b4", "o"),                # blue
    "ring": ("#d62728", "s"),                # red
    "tree": ("#2ca02c", "^"),                # green
    "recursive_doubling": ("#9467bd", "v"),  # purple
    "native": ("#8c564b", "D"),              # brown
    "rabenseifner": ("#e377c2", "P"),        # pink
    "double_tree": ("#bcbd22", "X"),         # olive
    "hierarchical": ("#17becf", "h"),        # cyan
    "bruck": ("#ff7f0e", "<"),               # orange
    "linear": ("#393b79", ">"),              # navy
    "pairwise": ("#e7ba52", "p"),            # gold
    "dissemination": ("#7b4173", "d"),       # plum
    "one_shot": ("#9edae5", "*"),            # pale cyan: the library's direct ones
    "two_shot": ("#c5b0d5", "H"),            # lavender
    "direct": ("#8c6d31", "8"),              # dark gold
    "shm_direct": ("#e6550d", "d"),          # deep orange: the shared-memory transport's own
    "rc-nccl": ("#637939", "*"),             # moss: ringcomm's auto on CUDA tensors
    "ours/ringcomm": ("#08519c", "o"),       # dark blue: this DDP on ringcomm
    "ours/gloo": ("#a63603", "s"),           # rust: this DDP on gloo
    "off/ringcomm": ("#6baed6", "^"),        # light blue: overlap off
    "off/gloo": ("#fd8d3c", "v"),            # light orange
    "ours/ringcomm-mpi": ("#3182bd", "D"),   # mid blue: ringcomm without shared memory
    "off/ringcomm-mpi": ("#9ecae1", "<"),    # pale blue
}
#: the peers: name -> (grey, marker, line style)
PEERS: dict[str, tuple[str, str, str]] = {
    "mpi": ("#000000", "s", "--"),
    "gloo": ("#7f7f7f", "^", "--"),
    "nccl": ("#404040", "v", "--"),
    "floor": ("#b0b0b0", "x", ":"),
    "deepspeed": ("#606060", "D", "-."),         # DeepSpeed's shared-memory allreduce
    "torch/ringcomm": ("#252525", "D", "--"),  # torch's DDP on ringcomm
    "torch/gloo": ("#969696", "P", "--"),      # torch's DDP on gloo: all torch
    "torch/ringcomm-mpi": ("#4d4d4d", "X", "--"),  # torch's DDP, ringcomm without shm
}
#: colours no fixed name uses, for other names (coloured ones, then greys for peers)
SPARE_COLOURS = ("#843c39", "#5254a3", "#8ca252", "#bd9e39", "#a55194", "#31a354",
                 "#756bb1", "#e7969c", "#ad494a", "#6b6ecf", "#b5cf6b", "#ce6dbd")
SPARE_GREYS = ("#5a5a5a", "#8a8a8a", "#c4c4c4")
SPARE_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "h", "<", ">")


def is_peer(name: str) -> bool:
    """Whether ``name`` is a peer (drawn grey and dashed), not ringcomm's own code."""
    return name in PEERS or (name not in ALGORITHMS and name.split("/")[0] == "torch")


def style(name: str) -> dict[str, str]:
    """The look of ``name``: ``color``, ``marker`` and ``linestyle`` for matplotlib
    (``plot`` and ``errorbar`` take them as keyword arguments)."""
    if name in ALGORITHMS:
        color, marker = ALGORITHMS[name]
        return dict(color=color, marker=marker, linestyle="-")
    if name in PEERS:
        color, marker, linestyle = PEERS[name]
        return dict(color=color, marker=marker, linestyle=linestyle)
    peer = is_peer(name)
    colours = SPARE_GREYS if peer else SPARE_COLOURS
    h = zlib.crc32(name.encode())
    return dict(color=colours[h % len(colours)],
                marker=SPARE_MARKERS[(h // len(colours)) % len(SPARE_MARKERS)],
                linestyle="--" if peer else "-")


def size_axis(ax, sizes) -> None:
    """A log-2 x axis of message sizes on ``ax``, ticks at the measured ``sizes``
    (every k-th, at most :data:`MAX_SIZE_TICKS`) labelled in B, KiB, MiB, GiB."""
    sizes = sorted(set(sizes))
    ax.set_xscale("log", base=2)
    if sizes:
        ticks = sizes[::-(-len(sizes) // MAX_SIZE_TICKS)]
        ax.set_xticks(ticks, [format_size(n) for n in ticks], rotation=30)
        ax.minorticks_off()
    ax.set_xlabel("message size")
