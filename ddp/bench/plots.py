"""Plots, one PNG per section (matplotlib).

Every configuration's line has its own look (:func:`ringcomm.bench.styles.style`),
the same in every panel and figure: this DDP (``ours/...``) solid and coloured,
torch's (``torch/...``) dashed and grey.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from ringcomm.bench.styles import style

from ddp.bench.report import cap_label

#: the parts of the breakdown's stacked bars and their colours
BREAKDOWN_PARTS = (("forward", "C0"), ("backward compute", "C1"),
                   ("exposed communication", "C3"), ("optimizer", "C2"))


class _Figures:
    """What every figure shares: the run's subtitle, the panels, saving."""

    def __init__(self, doc: dict, out_dir: str, plt: Any):
        meta = doc["meta"]
        self.doc, self.out_dir, self.plt, self.written = doc, out_dir, plt, []
        self.sub = (f"{meta['world_size']} ranks, {meta['cores']} cores"
                    + (" (oversubscribed)" if meta["oversubscribed"] else "")
                    + f", {meta['started']}")

    def panels(self, section: str) -> tuple[Any, list]:
        """One figure with a panel per model of ``section``: ``(fig, [(model, ax)])``."""
        models = list(self.doc[section])
        fig, axes = self.plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5),
                                      squeeze=False)
        return fig, list(zip(models, axes[0]))

    def save(self, fig: Any, section: str, title: str) -> None:
        fig.suptitle(f"{title}\n{self.sub}", fontsize=10)
        fig.tight_layout()
        path = os.path.join(self.out_dir, f"bench_ddp_{section}.png")
        fig.savefig(path, dpi=110)
        self.plt.close(fig)
        self.written.append(path)


def _configs(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["config"] for r in rows))


def _breakdown_stack(r: dict) -> tuple[float, float, float, float]:
    if r["impl"] == "off":
        return r["forward_ms"], r["backward_ms"], r["comm_ms"], r["optimizer_ms"]
    return (r["forward_ms"], r["backward_compute_ms"], max(0.0, r["exposed_comm_ms"]),
            r["optimizer_ms"])


def _breakdown(f: _Figures) -> None:
    fig, ps = f.panels("breakdown")
    for model, ax in ps:
        rows = f.doc["breakdown"][model]["rows"]
        names = list(rows)
        stacks = [_breakdown_stack(rows[n]) for n in names]
        bottom = np.zeros(len(names))
        for j, (label, color) in enumerate(BREAKDOWN_PARTS):
            vals = np.array([s[j] for s in stacks])
            ax.bar(names, vals, bottom=bottom, label=label, color=color)
            bottom += vals
        ax.set_title(model)
        ax.set_ylabel("ms per iteration")
        ax.set_ylim(0, 1.3 * max(bottom))  # room for the legend above the bars
        ax.tick_params(axis="x", rotation=30)
        ax.legend(fontsize=8, ncol=2, loc="upper center")
        ax.grid(True, axis="y", alpha=0.3)
    f.save(fig, "breakdown", "Latency breakdown (off = no overlap: flat allreduce after backward)")


def _lines(f: _Figures, section: str, x_key: str, y_key: str, xlabel: str, ylabel: str,
           title: str, xticks: Callable | None = None, extra: Callable | None = None) -> None:
    """One line per configuration of ``y_key`` against ``x_key``, a panel per model."""
    fig, ps = f.panels(section)
    for model, ax in ps:
        rows = f.doc[section][model]["rows"]
        for i, c in enumerate(_configs(rows)):
            pts = [r for r in rows if r["config"] == c]
            xs = [xticks(r[x_key]) if xticks else r[x_key] for r in pts]
            ax.plot(xs, [r[y_key] for r in pts], label=c, **style(c))
            if extra:
                extra(ax, pts, xs, i, c)
        ax.set_title(model)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    f.save(fig, section, title)


def _buckets(f: _Figures) -> None:
    caps = list(dict.fromkeys(r["bucket_cap_mb"] for m in f.doc["buckets"].values()
                              for r in m["rows"]))
    pos = {c: i for i, c in enumerate(caps)}

    def cap_ticks(ax, pts, xs, i, c):
        ax.set_xticks(range(len(caps)), [cap_label(c) for c in caps])

    _lines(f, "buckets", "bucket_cap_mb", "total_ms", "bucket_cap_mb (one = one bucket)",
           "ms per iteration", "Time per iteration against bucket size",
           xticks=lambda c: pos[c], extra=cap_ticks)


def _scaling(f: _Figures) -> None:
    fig, ps = f.panels("scaling")
    for model, ax in ps:
        rows = f.doc["scaling"][model]["rows"]
        ax2 = ax.twinx()
        for c in _configs(rows):
            pts = [r for r in rows if r["config"] == c]
            ks = [r["world"] for r in pts]
            s = style(c)
            ax.plot(ks, [r["samples_per_s"] for r in pts], linewidth=2, label=c, **s)
            # the fraction: the configuration's colour and marker, thin, dotted, hollow
            ax2.plot(ks, [r["scaling_fraction"] for r in pts], linewidth=1, alpha=0.8,
                     fillstyle="none", **{**s, "linestyle": ":"})
        over = [r["world"] for r in rows if r["oversubscribed"]]
        if over:
            ax.axvspan(min(over) - 0.5, max(over) + 0.5, color="grey", alpha=0.15,
                       label="oversubscribed")
        ax.set_xticks(sorted({r["world"] for r in rows}))
        ax.set_title(model)
        ax.set_xlabel("ranks")
        ax.set_ylabel("samples/s (thick lines)")
        ax2.set_ylabel("fraction of linear scaling (thin dotted, hollow markers)")
        ax2.set_ylim(0, 1.1)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    f.save(fig, "scaling", "Throughput and scaling fraction against world size")


def _nosync(f: _Figures) -> None:
    _lines(f, "nosync", "n", "amortized_ms", "synchronize every n iterations (no_sync the others)",
           "amortized ms per iteration", "Skipping synchronization with no_sync()")


def _roundrobin_panel(ax: Any, part: dict, model: str, cap: Any) -> None:
    """One (model, bucket cap) panel: ms per iteration against K, a line per configuration."""
    configs = _configs(part["rows"])
    for i, c in enumerate(configs):
        pts = sorted((r for r in part["rows"] if r["config"] == c
                      and r["bucket_cap_mb"] == cap), key=lambda r: r["k"])
        if not pts:
            continue
        # a small sideways offset per line, so the error bars stay apart
        dx = 0.08 * (i - (len(configs) - 1) / 2)
        med = np.array([r["total_ms"] for r in pts])
        err = np.array([[m - r["q1_ms"] for m, r in zip(med, pts)],
                        [r["q3_ms"] - m for m, r in zip(med, pts)]])
        ax.errorbar([r["k"] + dx for r in pts], med, yerr=np.clip(err, 0, None),
                    capsize=3, label=c, **style(c))
    nb = sorted({r["buckets"] for r in part["rows"] if r["bucket_cap_mb"] == cap
                 and r["buckets"] is not None})
    ax.set_xticks(part["channels"])
    ax.set_title(f"{model}, bucket_cap_mb {cap_label(cap)} ("
                 + "/".join(map(str, nb)) + " buckets)", fontsize=10)
    ax.set_xlabel("K: communicators used in turn (ringcomm channels; gloo groups)")
    ax.set_ylabel("ms per iteration (median, q1-q3)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")


def _roundrobin(f: _Figures) -> None:
    models = list(f.doc["roundrobin"])
    caps = list(dict.fromkeys(c for m in models for c in f.doc["roundrobin"][m]["caps"]))
    fig, axes = f.plt.subplots(len(caps), len(models),
                               figsize=(6.5 * len(models), 4.2 * len(caps)), squeeze=False)
    for col, model in enumerate(models):
        for row, cap in enumerate(caps):
            _roundrobin_panel(axes[row][col], f.doc["roundrobin"][model], model, cap)
    f.save(fig, "roundrobin", "Round-robin communicators: time per iteration against K\n"
                              "(on ringcomm: K channels; on gloo: K groups in turn; "
                              "solid: this DDP, dashed: torch's)")


#: the sections drawn, in order, and the function that draws each
FIGURES: dict[str, Callable[[_Figures], None]] = {
    "breakdown": _breakdown, "buckets": _buckets, "scaling": _scaling, "nosync": _nosync,
    "roundrobin": _roundrobin}


def plot(doc: dict, out_dir: str) -> list[str]:
    """PNGs in ``out_dir`` (bench_ddp_<section>.png); returns their paths.

    Raises:
        ImportError: no matplotlib.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    f = _Figures(doc, out_dir, plt)
    for section, draw in FIGURES.items():
        if section in doc:
            draw(f)
    return f.written
