"""Plots, one PNG per section (matplotlib)."""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from ddp.bench.report import cap_label

def plot(doc: dict, out_dir: str) -> list[str]:
    """PNGs in ``out_dir`` (bench_ddp_<section>.png); returns their paths.

    Raises:
        ImportError: no matplotlib.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    meta, written = doc["meta"], []
    sub = (f"{meta['world_size']} ranks, {meta['cores']} cores"
           + (" (oversubscribed)" if meta["oversubscribed"] else "") + f", {meta['started']}")

    def panels(section: str) -> tuple[Any, Any]:
        models = list(doc[section])
        fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
        return fig, list(zip(models, axes[0]))

    def save(fig: Any, section: str, title: str) -> None:
        fig.suptitle(f"{title}\n{sub}", fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"bench_ddp_{section}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if "breakdown" in doc:
        fig, ps = panels("breakdown")
        parts = (("forward", "C0"), ("backward compute", "C1"),
                 ("exposed communication", "C3"), ("optimizer", "C2"))
        for model, ax in ps:
            rows = doc["breakdown"][model]["rows"]
            names = list(rows)
            stacks = []
            for n in names:
                r = rows[n]
                if r["impl"] == "off":
                    stacks.append((r["forward_ms"], r["backward_ms"], r["comm_ms"],
                                   r["optimizer_ms"]))
                else:
                    stacks.append((r["forward_ms"], r["backward_compute_ms"],
                                   max(0.0, r["exposed_comm_ms"]), r["optimizer_ms"]))
            bottom = np.zeros(len(names))
            for j, (label, color) in enumerate(parts):
                vals = np.array([s[j] for s in stacks])
                ax.bar(names, vals, bottom=bottom, label=label, color=color)
                bottom += vals
            ax.set_title(model)
            ax.set_ylabel("ms per iteration")
            ax.set_ylim(0, 1.3 * max(bottom))  # room for the legend above the bars
            ax.tick_params(axis="x", rotation=30)
            ax.legend(fontsize=8, ncol=2, loc="upper center")
            ax.grid(True, axis="y", alpha=0.3)
        save(fig, "breakdown", "Latency breakdown (off = no overlap: flat allreduce after backward)")

    def lines(section: str, x_key: str, y_key: str, xlabel: str, ylabel: str, title: str,
              xticks: Callable | None = None, extra: Callable | None = None) -> None:
        fig, ps = panels(section)
        for model, ax in ps:
            rows = doc[section][model]["rows"]
            for i, c in enumerate(dict.fromkeys(r["config"] for r in rows)):
                pts = [r for r in rows if r["config"] == c]
                xs = [xticks(r[x_key]) if xticks else r[x_key] for r in pts]
                ax.plot(xs, [r[y_key] for r in pts], marker="o", color=f"C{i}", label=c)
                if extra:
                    extra(ax, pts, xs, i, c)
            ax.set_title(model)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        save(fig, section, title)

    if "buckets" in doc:
        caps = list(dict.fromkeys(r["bucket_cap_mb"] for m in doc["buckets"].values()
                                  for r in m["rows"]))
        pos = {c: i for i, c in enumerate(caps)}

        def cap_ticks(ax, pts, xs, i, c):
            ax.set_xticks(range(len(caps)), [cap_label(c) for c in caps])

        lines("buckets", "bucket_cap_mb", "total_ms", "bucket_cap_mb (one = one bucket)",
              "ms per iteration", "Time per iteration against bucket size",
              xticks=lambda c: pos[c], extra=cap_ticks)
    if "scaling" in doc:
        fig, ps = panels("scaling")
        for model, ax in ps:
            rows = doc["scaling"][model]["rows"]
            ax2 = ax.twinx()
            for i, c in enumerate(dict.fromkeys(r["config"] for r in rows)):
                pts = [r for r in rows if r["config"] == c]
                ks = [r["world"] for r in pts]
                ax.plot(ks, [r["samples_per_s"] for r in pts], marker="o", color=f"C{i}", label=c)
                ax2.plot(ks, [r["scaling_fraction"] for r in pts], marker="x", linestyle="--",
                         color=f"C{i}")
            over = [r["world"] for r in rows if r["oversubscribed"]]
            if over:
                ax.axvspan(min(over) - 0.5, max(over) + 0.5, color="grey", alpha=0.15,
                           label="oversubscribed")
            ax.set_xticks(sorted({r["world"] for r in rows}))
            ax.set_title(model)
            ax.set_xlabel("ranks")
            ax.set_ylabel("samples/s (solid)")
            ax2.set_ylabel("fraction of linear scaling (dashed)")
            ax2.set_ylim(0, 1.1)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        save(fig, "scaling", "Throughput and scaling fraction against world size")
    if "nosync" in doc:
        lines("nosync", "n", "amortized_ms", "synchronize every n iterations (no_sync the others)",
              "amortized ms per iteration", "Skipping synchronization with no_sync()")
    if "roundrobin" in doc:
        models = list(doc["roundrobin"])
        caps = list(dict.fromkeys(c for m in models for c in doc["roundrobin"][m]["caps"]))
        fig, axes = plt.subplots(len(caps), len(models), figsize=(6.5 * len(models),
                                                                  4.2 * len(caps)),
                                 squeeze=False)
        for col, model in enumerate(models):
            part = doc["roundrobin"][model]
            configs = list(dict.fromkeys(r["config"] for r in part["rows"]))
            for row, cap in enumerate(caps):
                ax = axes[row][col]
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
                                marker="o", capsize=3, color=f"C{i}",
                                linestyle="-" if pts[0]["backend"] == "ringcomm" else "--",
                                label=c)
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
        save(fig, "roundrobin", "Round-robin communicators: time per iteration against K\n"
                                "(ringcomm, solid: K channels; gloo, dashed: K groups in turn)")
    return written
