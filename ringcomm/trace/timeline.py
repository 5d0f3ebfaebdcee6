"""Draw a window of a (merged) trace as a PNG: one row per rank and thread,
spans as bars coloured by category, instants as ticks. Needs matplotlib.

    from ringcomm.trace import timeline
    timeline.draw(doc, "iteration.png", timeline.iteration_window(doc, 2))
"""
from __future__ import annotations

from typing import Sequence

#: bar colour per event category
COLOURS = {"collective": "tab:blue", "step": "tab:cyan", "ddp": "tab:orange",
           "train": "tab:green", "enqueue": "tab:gray"}


def iteration_window(doc: dict, index: int = 1, rank: int = 0) -> tuple[float, float]:
    """(start, end) in microseconds of iteration ``index`` on ``rank``: from the
    end of the previous optimizer step to the end of this one (the first
    iteration starts at its backward's start).

    Raises:
        ValueError: the trace has fewer optimizer steps.
    """
    steps = sorted((e for e in doc["traceEvents"]
                    if e.get("name") == "optimizer step" and e.get("pid") == rank),
                   key=lambda e: e["ts"])
    if len(steps) <= index:
        raise ValueError(f"timeline: rank {rank} has {len(steps)} optimizer steps; "
                         f"iteration {index} needs {index + 1}")
    end = steps[index]["ts"] + steps[index]["dur"]
    if index:
        prev = steps[index - 1]
        return prev["ts"] + prev["dur"], end
    backs = [e["ts"] for e in doc["traceEvents"]
             if e.get("name") == "backward" and e.get("pid") == rank and e["ts"] < end]
    return (min(backs) if backs else steps[0]["ts"]), end


def draw(doc: dict, path: str, window: tuple[float, float],
         title: str = "one iteration", categories: Sequence[str] = tuple(COLOURS)) -> None:
    """Write the events of ``doc`` that overlap ``window`` to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0, t1 = window
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    events = [e for e in doc["traceEvents"]
              if e.get("ph") in ("X", "i") and e.get("cat") in categories
              and e["ts"] <= t1 and e["ts"] + e.get("dur", 0) >= t0]
    rows = sorted({(e["pid"], e["tid"]) for e in events})
    if not rows:
        raise ValueError("timeline: no event in the window")
    y = {row: i for i, row in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.6))
    ms = 1000.0
    for e in events:
        row, colour = y[(e["pid"], e["tid"])], COLOURS.get(e["cat"], "black")
        start = (max(e["ts"], t0) - t0) / ms
        if e["ph"] == "X":
            width = (min(e["ts"] + e["dur"], t1) - max(e["ts"], t0)) / ms
            lane = 0.15 if e["cat"] == "step" else 0.3  # steps drawn inside their collective
            ax.barh(row, width, left=start, height=2 * lane, color=colour,
                    edgecolor="black", linewidth=0.3, zorder=3 if e["cat"] == "step" else 2)
            if width > (t1 - t0) / ms / 40 and e["cat"] != "step":
                ax.text(start + width / 2, row, e["name"], ha="center", va="center",
                        fontsize=6, clip_on=True)
        else:
            ax.plot([start, start], [row - 0.4, row + 0.4], color=colour, linewidth=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {p}: {names.get((p, t), f'thread {t}')}" for p, t in rows],
                       fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) / ms)
    ax.set_xlabel("ms")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[c]) for c in categories if c in COLOURS]
    ax.legend(handles, [c for c in categories if c in COLOURS], fontsize=7, loc="upper right",
              ncol=len(handles))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
