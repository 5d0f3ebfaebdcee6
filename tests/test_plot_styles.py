"""The plots' look per implementation (ringcomm.bench.styles): one colour and marker
per name, peers (greys, dashed) apart from ringcomm's own code (coloured, solid),
and a name's look the same whatever columns a panel has and in what order, in
compare_collectives' plot (ringcomm.bench.report.plot) and bench_ddp's
(ddp.bench.plots.plot). Drawn with matplotlib's Agg backend, nothing saved."""
from __future__ import annotations

import json

import pytest

from conftest import ROOT
from ringcomm.bench import styles
from ringcomm.bench.columns import PEER_NAMES

from ddp.bench.constants import BACKENDS, IMPLS

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
from matplotlib.colors import to_hex, to_rgb  # noqa: E402
from matplotlib.container import Container  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

FIXED = {**styles.ALGORITHMS, **styles.PEERS}


def look(name: str) -> tuple[str, str, str]:
    s = styles.style(name)
    return to_hex(s["color"]), s["marker"], s["linestyle"]


def is_grey(colour: str) -> bool:
    r, g, b = to_rgb(colour)
    return max(r, g, b) - min(r, g, b) < 0.02


def test_the_fixed_names_each_have_their_own_colour_and_marker():
    assert not set(styles.ALGORITHMS) & set(styles.PEERS)
    pairs = {n: look(n)[:2] for n in FIXED}
    assert len(set(pairs.values())) == len(pairs), pairs
    colours = [c for c, _ in pairs.values()]
    assert len(set(colours)) == len(colours), "a colour used by two names"


def test_peers_are_grey_and_dashed_and_ringcomm_coloured_and_solid():
    for n in styles.ALGORITHMS:
        colour, _, ls = look(n)
        assert not is_grey(colour) and ls == "-" and not styles.is_peer(n), n
    for n in styles.PEERS:
        colour, _, ls = look(n)
        assert is_grey(colour) and ls != "-" and styles.is_peer(n), n
    algo_looks = {look(n)[:2] for n in styles.ALGORITHMS}
    assert not algo_looks & {look(n)[:2] for n in styles.PEERS}


def test_every_name_the_tools_draw_has_a_fixed_look():
    import ringcomm

    names = {"auto", "rc-nccl", *PEER_NAMES,
             *(n for algos in ringcomm.REGISTRY.values() for n in algos),
             *(f"{i}/{b}" for i in (*IMPLS, "off") for b in BACKENDS)}
    doc = json.loads((ROOT / "docs" / "data" / "compare_2ranks.json").read_text())
    names |= {c["name"] for c in doc["meta"]["columns"]}
    for f in ("bench_ddp_2ranks.json", "bench_ddp_roundrobin_2ranks.json"):
        d = json.loads((ROOT / "docs" / "data" / f).read_text())
        names |= set(d["meta"]["configurations"])
    assert names - set(FIXED) == set()
    assert {n for n in names if n.startswith("torch/")} <= set(styles.PEERS)
    assert set(PEER_NAMES) <= set(styles.PEERS)


def test_no_spare_colour_is_a_fixed_names_colour():
    """Every colour an unknown name can hash to, not only those the sample names
    below reach (a spare once was shm_direct's deep orange)."""
    fixed = {to_hex(c[0]) for c in FIXED.values()}
    spares = [to_hex(c) for c in styles.SPARE_COLOURS + styles.SPARE_GREYS]
    assert not fixed & set(spares) and len(set(spares)) == len(spares)


@pytest.mark.parametrize("name", ["msccl_ring2", "allpairs2", "my_ring", "x", "torch/nccl"])
def test_other_names_get_a_stable_look_no_fixed_name_has(name):
    assert styles.style(name) == styles.style(name)
    colour, _, ls = look(name)
    assert colour not in {to_hex(c[0]) for c in FIXED.values()}
    assert styles.is_peer(name) == name.startswith("torch/")
    assert is_grey(colour) == styles.is_peer(name)
    assert ls == ("--" if styles.is_peer(name) else "-")


# ---------------------------------------------------------------------------
# the looks drawn, per panel
# ---------------------------------------------------------------------------
@pytest.fixture
def drawn(monkeypatch):
    """Each figure saved: a list per axes of {label: (colour, marker, linestyle)}."""
    figures: list[list[dict]] = []

    def savefig(fig, *args, **kwargs):
        panels = []
        for ax in fig.axes:
            got = {}
            for h, label in zip(*ax.get_legend_handles_labels()):
                line = h[0] if isinstance(h, Container) else h
                if isinstance(line, Line2D):
                    got[label] = (to_hex(line.get_color()), line.get_marker(),
                                  line.get_linestyle())
            if got:
                panels.append(got)
        figures.append(panels)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def merged(panels: list[dict]) -> dict:
    """name -> look over every panel of a figure; each name looks the same in every
    panel, and no two names in a panel look the same."""
    seen: dict = {}
    for got in panels:
        assert len(set(got.values())) == len(got), got
        for name, lk in got.items():
            assert seen.setdefault(name, lk) == lk, (name, seen[name], lk)
    return seen


def check_looks(looks: dict) -> None:
    """The looks drawn are styles.style's, peers' colours apart from the others'."""
    for name, lk in looks.items():
        assert lk == look(name), name
    peers = {lk[0] for n, lk in looks.items() if styles.is_peer(n)}
    assert not peers & {lk[0] for n, lk in looks.items() if not styles.is_peer(n)}, looks


def compare_doc(columns: list[str]) -> dict:
    """A compare_collectives document: allreduce has every column, broadcast some."""
    results = []
    for coll, cols in (("allreduce", columns), ("broadcast", columns[1::2])):
        for c in cols:
            for size in (4, 1024, 1 << 20):
                results.append(dict(collective=coll, dtype="float", redop="sum", column=c,
                                    size=size, status="ok", time_us=10.0 + size / 1e3,
                                    busbw=size / 1e4))
    return {"results": results,
            "meta": {"columns": [{"name": c, "skipped": None} for c in columns],
                     "world_size": 2, "device": {"cpu": "test"}, "started": "now"}}


def test_compare_plot_looks_do_not_depend_on_the_column_order(drawn, tmp_path):
    from ringcomm.bench.report import plot

    columns = ["auto", "ring", "tree", "native", "my_algo", "mpi", "gloo", "floor"]
    plot(str(tmp_path / "a.png"), compare_doc(columns))
    plot(str(tmp_path / "b.png"), compare_doc(columns[::-1]))
    plot(str(tmp_path / "c.png"), compare_doc(["gloo", "ring", "mpi"]))
    looks = [merged(panels) for panels in drawn]
    assert len(looks) == 3 and looks[0] == looks[1]
    assert all(looks[0][n] == lk for n, lk in looks[2].items())
    check_looks(looks[0])


def ddp_doc(configs: list[str]) -> dict:
    rows = {"buckets": [dict(config=c, bucket_cap_mb=cap, total_ms=100.0 + i + j)
                        for i, c in enumerate(configs) for j, cap in enumerate((0, 25, "all"))],
            "nosync": [dict(config=c, n=n, amortized_ms=50.0 + i + n)
                       for i, c in enumerate(configs) for n in (1, 2, 4)],
            "scaling": [dict(config=c, world=k, samples_per_s=10.0 * k + i,
                             scaling_fraction=0.9, oversubscribed=k > 2)
                        for i, c in enumerate(configs) for k in (1, 2, 4)]}
    rr = [dict(config=c, backend=c.split("/")[1], bucket_cap_mb=cap, k=k, total_ms=10.0 + i,
               q1_ms=9.0 + i, q3_ms=11.0 + i, buckets=2)
          for i, c in enumerate(configs) for cap in (25, 1) for k in (1, 3)]
    return {"meta": {"world_size": 2, "cores": 2, "oversubscribed": False, "started": "now"},
            **{s: {m: {"rows": r} for m in ("resnet", "bert")} for s, r in rows.items()},
            "roundrobin": {m: {"rows": rr, "caps": [25, 1], "channels": [1, 3]}
                           for m in ("resnet", "bert")}}


def test_ddp_plot_looks_do_not_depend_on_the_configuration_order(drawn, tmp_path):
    from ddp.bench.plots import plot

    configs = ["ours/ringcomm", "torch/ringcomm", "ours/gloo", "torch/gloo"]
    plot(ddp_doc(configs), str(tmp_path / "a"))
    plot(ddp_doc(configs[::-1]), str(tmp_path / "b"))
    plot(ddp_doc(configs[2:]), str(tmp_path / "c"))
    assert len(drawn) == 12  # buckets, scaling, nosync, roundrobin, three times
    looks = [merged(panels) for panels in drawn]
    assert all(lk == looks[0] for lk in looks[:8]), looks
    assert all(looks[0][n] == lk for d in looks[8:] for n, lk in d.items())
    check_looks(looks[0])
