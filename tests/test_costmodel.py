"""The cost model of ringcomm.bench (features counted from the schedules, checked
against textbook counts; fits to synthetic timings with known parameters;
predictions and crossovers), the tuning rows made from measured times, tuning
files that ringcomm's ``auto`` accepts and follows, and ``--model-from``."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ringcomm.bench import analysis, cli, cost_model, tuning
from ringcomm.bench.results import SCHEMA
from ringcomm.bench.sizes import COLLECTIVES

SEG = 512 * 1024


# ---------------------------------------------------------------------------
# cost model: features counted from the registered schedules
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 3, 4, 5, 8, 64])
def test_ring_allreduce_features_are_the_textbook_counts(p):
    fn = cost_model.features_for("allreduce", "ring")
    u = p * SEG  # one segment per chunk
    sizes = [p * 1024, u, 3 * u, 1000 * u] if p <= cost_model.EXACT_RANKS else [4096]
    for n in sizes:
        k = max(1, -(-n // (p * SEG)))  # segments per chunk
        A, B, G = fn(p, n, SEG)
        assert A == 2 * (p - 1) * k, (p, n)
        assert B == pytest.approx(2 * (p - 1) / p * n), (p, n)
        assert G == pytest.approx((p - 1) / p * n), (p, n)


def test_every_registered_schedule_has_a_model_and_native_does_not():
    from ringcomm.algorithms import REGISTRY, is_schedule

    for coll in COLLECTIVES:
        for name, build in REGISTRY[coll].items():
            assert cost_model.has_model(coll, name) == is_schedule(build), (coll, name)
    assert cost_model.has_model("allreduce", "recursive_doubling")
    assert not cost_model.has_model("allreduce", "auto")
    assert not cost_model.has_model("allreduce", "pairwise")
    # recursive doubling: log2 p whole-buffer exchanges, each reduced
    rd = cost_model.features_for("allreduce", "recursive_doubling")
    assert rd(2, 4096, SEG) == (1, 4096, 4096)
    assert rd(8, 4096, SEG) == (3, 3 * 4096, 3 * 4096)
    # native is a black box: fitted as o + beta * n
    f = cost_model.fit("allreduce", "native", [(2, n, 1e-5 + n * 1e-9) for n in SIZES],
                      segment_bytes=SEG)
    assert f.algorithm is None and f.fitted == ("o", "beta")


def test_a_user_registered_builder_gets_a_model(monkeypatch):
    from ringcomm.algorithms import REGISTRY
    from ringcomm.schedule import Builder, Reduce

    def swap_sum(ctx):  # two ranks: exchange the whole buffer and add
        b = Builder(ctx)
        n = ctx.layout[0]
        tmp = b.scratch(n)
        peer = 1 - ctx.rank
        b.step(sends=[(peer, (0, 0, n))], recvs=[(peer, (tmp, 0, n))],
               local=[Reduce((0, 0, n), (tmp, 0, n))])
        return b.build()

    monkeypatch.setitem(REGISTRY["allreduce"], "swap_sum", swap_sum)
    assert cost_model.has_model("allreduce", "swap_sum")
    assert cost_model.features_for("allreduce", "swap_sum")(2, 1000, SEG) == (1, 1000, 1000)
    samples = synth("allreduce", "swap_sum", (0.0, 30e-6, 0.5e-9, 0.1e-9))
    f = cost_model.fit("allreduce", "swap_sum", samples, segment_bytes=SEG, gamma=0.1e-9)
    assert (f.alpha, f.beta) == pytest.approx((30e-6, 0.5e-9), rel=1e-6)


def test_features_are_cached_and_bounded_on_many_ranks():
    # Above EXACT_RANKS a whole crossover scan from 1 B to 64 GiB simulates each
    # algorithm only at the anchor sizes (powers of 16, p*seg and 2*p*seg); the rest
    # is interpolated or extrapolated from those.
    seg = SEG
    p = 2 * cost_model.EXACT_RANKS
    fits = {a: cost_model.Fit("allreduce", a, 0.0, 50e-6, 0.5e-9, 0.1e-9, ("alpha", "beta"),
                             0.0, 2, (2,), seg) for a in ("ring", "tree")}
    before = cost_model._simulate.cache_info()
    xs = cost_model.crossovers(fits["tree"], fits["ring"], p)
    after = cost_model._simulate.cache_info()
    anchors = cost_model._anchors(seg, p * seg)
    assert after.misses - before.misses <= 2 * len(anchors)
    assert [x[1:] for x in xs] == [("tree", "ring")]
    # interpolation is exact where the counts are linear in n (ring: one segment per chunk)
    n = 3 * 4096 * p
    A, B, G = cost_model.features_for("allreduce", "ring")(p, n, seg)
    assert (A, B, G) == pytest.approx((2 * (p - 1), 2 * (p - 1) / p * n, (p - 1) / p * n))
    again = cost_model._simulate.cache_info()
    cost_model.features_for("allreduce", "ring")(p, n, seg)
    assert cost_model._simulate.cache_info().misses == again.misses


# ---------------------------------------------------------------------------
# cost model on synthetic timings (the oracle: the parameters that generated them)
# ---------------------------------------------------------------------------
SIZES = [4 << i for i in range(25)]  # 4 B .. 64 MiB


def synth(collective, algo, params, world_sizes=(2,), noise=0.0, seed=0):
    o, alpha, beta, gamma = params
    rng = np.random.default_rng(seed)
    fn = cost_model.features_for(collective, algo)
    assert fn is not cost_model.features_for(collective, None), f"{collective}/{algo} has no model"
    out = []
    for p in world_sizes:
        for n in SIZES:
            A, B, G = fn(p, n, SEG)
            t = o + alpha * A + beta * B + gamma * G
            out.append((p, n, t * (1 + noise * rng.uniform(-1, 1))))
    return out


@pytest.mark.parametrize("collective,algo", [("allreduce", "ring"), ("allreduce", "tree"),
                                             ("allreduce", "recursive_doubling"),
                                             ("broadcast", "tree"), ("broadcast", "ring"),
                                             ("allgather", "ring"), ("reduce_scatter", "ring"),
                                             ("alltoall", "linear")])
def test_fit_recovers_alpha_beta_at_one_world_size(collective, algo):
    alpha, beta = 35e-6, 0.4e-9                  # 35 us per message, 2.5 GB/s
    gamma = 0.1e-9 if collective in ("allreduce", "reduce_scatter") else 0.0
    samples = synth(collective, algo, (0.0, alpha, beta, gamma))
    f = cost_model.fit(collective, algo, samples, segment_bytes=SEG,
                      gamma=gamma if gamma else None)
    assert f.alpha == pytest.approx(alpha, rel=1e-6)
    assert f.beta == pytest.approx(beta, rel=1e-6)
    assert f.gamma == pytest.approx(gamma)
    assert f.rms_rel_err < 1e-9
    measured = {n: t for _, n, t in samples}
    assert f.predict(2, 1 << 20) == pytest.approx(measured[1 << 20], rel=1e-9)


def test_fit_with_noise_stays_close():
    alpha, beta, gamma = 50e-6, 0.3e-9, 0.08e-9
    samples = synth("allreduce", "ring", (0.0, alpha, beta, gamma), noise=0.03, seed=7)
    f = cost_model.fit("allreduce", "ring", samples, segment_bytes=SEG, gamma=gamma)
    assert f.alpha == pytest.approx(alpha, rel=0.05)
    assert f.beta == pytest.approx(beta, rel=0.05)
    assert 0.005 < f.rms_rel_err < 0.03


def test_fit_separates_overhead_from_latency_across_world_sizes():
    o, alpha, beta, gamma = 20e-6, 8e-6, 0.5e-9, 0.1e-9
    samples = synth("allreduce", "ring", (o, alpha, beta, gamma), world_sizes=(2, 4, 8, 16))
    f = cost_model.fit("allreduce", "ring", samples, segment_bytes=SEG, gamma=gamma)
    assert f.fitted == ("o", "alpha", "beta")
    assert (f.o, f.alpha, f.beta) == pytest.approx((o, alpha, beta), rel=1e-6)
    assert f.predict(64, 4096) == pytest.approx(o + alpha * 2 * 63 + beta * 2 * 63 / 64 * 4096
                                                + gamma * 63 / 64 * 4096, rel=1e-9)


def test_fit_of_a_black_box_is_latency_plus_bandwidth():
    samples = [(2, n, 3e-6 + n * 0.1e-9) for n in SIZES]
    f = cost_model.fit("allreduce", None, samples, segment_bytes=SEG)
    assert f.algorithm is None and f.fitted == ("o", "beta")
    assert (f.o, f.beta) == pytest.approx((3e-6, 0.1e-9), rel=1e-6)


def test_fit_without_gamma_at_one_world_size_does_not_invent_one():
    # beta and gamma both scale with n here: the fit must not split them arbitrarily.
    samples = synth("allreduce", "ring", (0.0, 30e-6, 0.3e-9, 0.2e-9))
    f = cost_model.fit("allreduce", "ring", samples, segment_bytes=SEG)
    assert f.gamma == 0.0 and "gamma" not in f.fitted
    assert f.beta == pytest.approx(0.3e-9 + 0.2e-9 / 2, rel=1e-6)  # B = n, G = n/2 at p=2


def test_fit_rejects_too_few_samples():
    with pytest.raises(ValueError, match="at least two"):
        cost_model.fit("allreduce", "ring", [(2, 4, 1e-5)], segment_bytes=SEG)


def test_crossover_of_known_models():
    # At 2 ranks and n below one segment: tree = 2a_t + 2n b, ring = 2a_r + n b,
    # equal at n* = 2 (a_r - a_t) / b.
    a_r, a_t, b = 60e-6, 40e-6, 1e-9
    ring = cost_model.fit("allreduce", "ring", synth("allreduce", "ring", (0, a_r, b, 0)),
                         segment_bytes=SEG, gamma=0.0)
    tree = cost_model.fit("allreduce", "tree", synth("allreduce", "tree", (0, a_t, b, 0)),
                         segment_bytes=SEG, gamma=0.0)
    xs = cost_model.crossovers(tree, ring, 2)
    n_star = 2 * (a_r - a_t) / b
    assert len(xs) == 1
    n, slower, faster = xs[0]
    assert (slower, faster) == ("tree", "ring")
    assert abs(n - n_star) <= 1


def test_near_identical_models_do_not_cross():
    # broadcast ring and tree are the same chain on 2 ranks: no crossover to report
    params = (0, 50e-6, 0.2e-9, 0)
    tree = cost_model.fit("broadcast", "tree", synth("broadcast", "tree", params),
                         segment_bytes=SEG)
    ring = cost_model.fit("broadcast", "ring", synth("broadcast", "ring", params),
                         segment_bytes=SEG)
    assert cost_model.crossovers(tree, ring, 2) == []
    assert cost_model.crossovers(tree, ring, 64)  # but they differ on 64 ranks


# ---------------------------------------------------------------------------
# tuning rows from measured crossovers
# ---------------------------------------------------------------------------
def test_tuning_rows_put_the_threshold_at_the_crossing():
    sizes = [2 ** i for i in range(2, 27)]
    times = {"tree": [10 + 0.002 * n for n in sizes], "ring": [20 + 0.001 * n for n in sizes]}
    rows = tuning.tuning_rows(sizes, times)
    assert [r[1] for r in rows] == ["tree", "ring"] and rows[-1][0] is None
    assert 8192 <= rows[0][0] < 16384      # true crossing: 10000 B
    assert abs(rows[0][0] - 10000) < 1500  # log-linear interpolation lands near it


def test_tuning_rows_ignore_noise_but_follow_a_real_change():
    sizes = [2 ** i for i in range(2, 14)]
    tree = [10.0] * len(sizes)
    ring = [12.0] * len(sizes)
    ring[4:6] = [9.9, 9.9]  # 1% faster at two sizes: a tie, not a crossover
    assert tuning.tuning_rows(sizes, {"tree": tree, "ring": ring}) == [[None, "tree"]]
    ring[4:6] = [12.0, 5.0]  # 2x faster, but at one size only, between two losses: a spike
    assert tuning.tuning_rows(sizes, {"tree": tree, "ring": ring}) == [[None, "tree"]]
    ring[4:7] = [5.0, 5.0, 5.0]  # faster at three sizes in a row: real
    rows = tuning.tuning_rows(sizes, {"tree": tree, "ring": ring})
    assert [r[1] for r in rows] == ["tree", "ring", "tree"]
    assert sizes[3] <= rows[0][0] < sizes[5] and sizes[6] <= rows[1][0] < sizes[8]


def _doc(p, columns, points, segment=SEG):
    return {"schema": SCHEMA,
            "meta": {"world_size": p, "ringcomm": {"segment_bytes": segment},
                     "gamma_s_per_byte": {"float/sum": 0.0},
                     "columns": [{"name": c, "kind": "ringcomm", "algo": c, "skipped": None}
                                 for c in columns]},
            "results": [{"collective": coll, "size": n, "dtype": "float", "redop": "sum",
                         "column": c, "status": "ok", "time_us": t}
                        for coll, c, n, t in points]}


def test_written_tuning_file_is_loaded_and_followed_by_ringcomm(tmp_path):
    from ringcomm.algorithms import select

    sizes = [2 ** i for i in range(2, 27)]
    pts = [("allreduce", "tree", n, 10 + 0.002 * n) for n in sizes]
    pts += [("allreduce", "ring", n, 20 + 0.001 * n) for n in sizes]
    pts += [("allgather", "ring", n, 5 + 0.001 * n) for n in sizes]
    table = tuning.measured_tuning([_doc(4, ["ring", "tree"], pts)], 0.03)
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"broadcast": {"default": [[None, "tree"]]}}))
    written, left_out = tuning.write_tuning(str(path), table)
    assert sorted(written) == ["allgather/4", "allreduce/4"] and not left_out
    loaded = select.load_tuning(str(path))
    assert loaded["broadcast"]["default"] == [[None, "tree"]]  # kept what was there
    assert select.choose(loaded, "allreduce", 4096, 4) == "tree"
    assert select.choose(loaded, "allreduce", 1 << 20, 4) == "ring"
    # allgather: auto is asked with one rank's block, a quarter of the measured size
    assert loaded["allgather"]["4"] == [[None, "ring"]]
    # other world sizes keep the built-in default
    assert select.choose(loaded, "allreduce", 1 << 20, 2) == select.choose(
        select.DEFAULT_TUNING, "allreduce", 1 << 20, 2)


def test_unknown_collectives_are_left_out_of_the_tuning_file(tmp_path):
    from ringcomm.algorithms import select

    path = tmp_path / "t.json"
    written, left_out = tuning.write_tuning(str(path), {"allsmash": {"2": [[None, "pairwise"]]},
                                                    "allreduce": {"2": [[None, "ring"]]}})
    assert written == ["allreduce/2"] and left_out == ["allsmash"]
    select.load_tuning(str(path))


def test_model_from_saved_results_of_several_world_sizes(tmp_path, capsys):
    o, alpha, beta = 20e-6, 10e-6, 0.5e-9
    docs = []
    for p in (2, 4, 8):
        pts = []
        for algo in ("ring", "tree"):
            for _, n, t in synth("allreduce", algo, (o, alpha, beta, 0.0), world_sizes=(p,)):
                pts.append(("allreduce", algo, n, t * 1e6))
        path = tmp_path / f"r{p}.json"
        path.write_text(json.dumps(_doc(p, ["ring", "tree"], pts)))
        docs.append(str(path))
    out = tmp_path / "cost_model.json"
    assert cli.main(["--model-from", *docs, "--json", str(out), "--predict-ranks", "64"]) == 0
    model = json.loads(out.read_text())["cost_model"]
    for f in model["fits"]:
        assert f["world_sizes"] == [2, 4, 8]
        assert (f["o"], f["alpha"], f["beta"]) == pytest.approx((o, alpha, beta), rel=1e-6)
    text = capsys.readouterr().out
    assert "ring/tree crossover at 64 ranks" in text


def test_a_saved_model_report_renders_as_the_live_one():
    # docs/benchmarks.md shows analysis.cost_model of a saved run through model_text:
    # it must print exactly what the run printed (fits, predictions, crossovers).
    docs = []
    for p in (2, 4):
        pts = []
        for algo, alpha in (("ring", 60e-6), ("tree", 40e-6)):
            for _, n, t in synth("allreduce", algo, (0.0, alpha, 1e-9, 0.0), world_sizes=(p,)):
                pts.append(("allreduce", algo, n, t * 1e6))
        docs.append(_doc(p, ["ring", "tree"], pts))
    fits = analysis.fit_models(docs)
    text, summary = analysis.model_report(fits, [8, 64], [4096, 1 << 20])
    assert "predicted time (us)" in text and "ring/tree crossover at 64 ranks" in text
    assert analysis.model_text(json.loads(json.dumps(summary))) == text


def test_native_and_a_registered_algorithm_join_the_measured_tuning():
    """Every ringcomm column but auto competes: MPI's own collective and a
    user's algorithm measured with --import take the sizes where they are fastest."""
    sizes = [2 ** i for i in range(2, 24)]
    pts = [("allreduce", "native", n, 5 + 0.004 * n) for n in sizes]
    pts += [("allreduce", "mine", n, 30 + 0.001 * n) for n in sizes]
    pts += [("allreduce", "auto", n, 1.0) for n in sizes]  # never a winner: auto is the mix
    table = tuning.measured_tuning([_doc(2, ["native", "mine", "auto"], pts)], 0.03)
    rows = table["allreduce"]["2"]
    assert [name for _, name in rows] == ["native", "mine"], rows
    assert 4096 <= rows[0][0] < 1 << 16


def test_auto_falls_back_from_native_where_mpi_cannot_take_the_call(tmp_path):
    """A tuning that picks native for every size still runs a bfloat16 allreduce (MPI
    has no bfloat16): auto takes the built-in choice for it; float32 runs native."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ringcomm import Options
    from ringcomm.algorithms import select
    from ringcomm.front.process_group import ProcessGroupRingcomm
    from ringcomm.testing.local import LocalFabric, LocalTransport

    class LikeMPI(LocalTransport):
        """Native collectives for every dtype but bfloat16, as MPI."""

        def check_native(self, collective, dtype, op):
            if dtype == torch.bfloat16:
                raise ValueError("MPI has no bfloat16")

        def native_init(self, collective, layout, dtype, op, root):
            return object()

    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"allreduce": {"2": [[None, "native"]]}}))
    pg = ProcessGroupRingcomm(0, 2, LikeMPI(LocalFabric(2), 0), timedelta(seconds=20),
                              Options(tuning_file=str(path)))
    lane = pg.lanes.for_tensor(torch.ones(1), "allreduce")
    names = [pg.planner.prepare(lane, "allreduce", (8,), dtype, nbytes=8 * dtype.itemsize,
                                op=dist.ReduceOp.SUM)[0]
             for dtype in (torch.bfloat16, torch.float32)]
    assert names == [select.choose(select.MODELLED, "allreduce", 16, 2), "native"], names
    assert names[0] != "native"
    pg.set_algorithm("allreduce", "native")  # chosen by name, it is refused as before
    with pytest.raises(ValueError, match="bfloat16"):
        pg.planner.prepare(lane, "allreduce", (8,), torch.bfloat16, nbytes=16,
                           op=dist.ReduceOp.SUM)


# ---------------------------------------------------------------------------
# auto at scale (scripts/auto_at_scale.py, docs/data/auto_at_scale.json)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 3, 5, 8, 13, 16])
def test_the_ring_in_closed_form_is_the_simulated_ring(p):
    """cost_model.ring_allreduce against the ring's schedules under NCCL's rules: rounds
    and reduced bytes equal everywhere; the busiest bytes equal where the chunks are
    equal or whole segments, and at most 25% above the closed form elsewhere (ranks a
    step apart share a round)."""
    from ringcomm.algorithms import REGISTRY
    from ringcomm.execution import checker
    for n in (1, 7, 16, 100, 1000, 4096, 4097):
        for seg in (4, 64, 1 << 20):
            st = checker.check(REGISTRY["allreduce"]["ring"], "allreduce", p, (n,), seg=seg,
                               symbolic=False)
            A, B, G = cost_model.ring_allreduce(p, n, seg)
            assert (A, G) == (st.rounds, st.reduced_max), (p, n, seg)
            chunk = -(-n // p)
            if n % p == 0 or chunk <= seg:
                assert B == st.busiest, (p, n, seg)
            else:
                assert B <= st.busiest <= 1.25 * B, (p, n, seg, st.busiest, B)


@pytest.mark.parametrize("name", sorted(cost_model.PIPELINED))
def test_the_pipelined_features_follow_their_line(name):
    """features_at's straight line against the simulation, on 64 ranks, at 8 times
    the line's end: rounds and reduced bytes equal, the busiest bytes within 4%."""
    from ringcomm.algorithms import REGISTRY
    from ringcomm.execution import checker
    seg = 1 << 16
    n = 16 * cost_model.PIPELINED[name] * seg
    st = checker.check(REGISTRY["allreduce"][name], "allreduce", 64, (n,), seg=seg,
                       symbolic=False)
    A, B, G = cost_model.features_at(name, 64, n, seg)
    assert (A, G) == (st.rounds, st.reduced_max)
    assert B == pytest.approx(st.busiest, rel=0.04)


def _auto_at_scale():
    import importlib.util

    from conftest import ROOT
    spec = importlib.util.spec_from_file_location("auto_at_scale",
                                                  ROOT / "scripts" / "auto_at_scale.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    doc = json.loads((ROOT / "docs" / "data" / "auto_at_scale.json").read_text())
    return script, doc


def test_auto_at_scale_is_the_models_cheapest_or_the_measured_row_for_hosts():
    """Every cell of docs/data/auto_at_scale.json (8 to 16,384 ranks, 4 KiB to 1 GiB,
    1 and 8 ranks a host), with auto's pick taken from the shipped tuning now: within
    the margin of the model's cheapest, except where auto follows its row for several
    hosts (hierarchical, measured across hosts; the model knows one kind of link);
    and the committed picks are the shipped tuning's (the docs' table is current)."""
    from ringcomm.algorithms import select
    script, doc = _auto_at_scale()
    committed = {(c["ranks"], c["per_host"], c["bytes"]): c["auto"] for c in doc["cells"]}
    script.repick(doc, select.load_tuning(None))
    assert len(doc["cells"]) == len(script.RANKS) * len(script.PER_HOST) * len(script.SIZES)
    off = [c for c in doc["cells"] if c["ratio"] > 1 + doc["margin"]
           and not (c["per_host"] > 1 and c["ranks"] > c["per_host"]
                    and c["auto"] == "hierarchical")]
    assert not off, off
    assert {(c["ranks"], c["per_host"], c["bytes"]): c["auto"] for c in doc["cells"]} == \
        committed


def test_the_committed_cells_are_what_the_model_gives_now():
    """Cells on 8, 16 and 64 ranks computed afresh equal the committed ones."""
    from ringcomm.algorithms import select
    script, doc = _auto_at_scale()
    table = select.load_tuning(None)
    at = {(c["ranks"], c["per_host"], c["bytes"]): c for c in doc["cells"]}
    for p in (8, 16, 64):
        for per_host in script.PER_HOST:
            for n in script.SIZES:
                assert script.cell(doc["params"], table, p, per_host, n) == \
                    at[p, per_host, n], (p, per_host, n)


@pytest.mark.parametrize("p", [8, 64, 256])
def test_rabenseifner_in_closed_form_is_the_simulated_one(p):
    """cost_model.rabenseifner_allreduce against the schedules on a power-of-two world
    dividing the size, in one segment and in many; refused elsewhere."""
    from ringcomm.algorithms import REGISTRY
    from ringcomm.execution import checker
    for n, seg in ((p * 16, 1 << 20), (p * 1000, 4096), (p * 4096, 1 << 14)):
        st = checker.check(REGISTRY["allreduce"]["rabenseifner"], "allreduce", p, (n,),
                           seg=seg, symbolic=False)
        assert cost_model.rabenseifner_allreduce(p, n, seg) == (st.rounds, st.busiest,
                                                           st.reduced_max), (p, n, seg)
    with pytest.raises(ValueError, match="power-of-two p dividing n"):
        cost_model.rabenseifner_allreduce(p + 1, 4 * p, 64)


@pytest.mark.parametrize("p,per_host", [(64, 8), (256, 8), (96, 4)])
def test_hierarchical_by_phases_is_the_simulated_one(p, per_host):
    """cost_model.hierarchical_allreduce (its phases added) against the whole schedule
    simulated with its hosts, from the leaders' recursive doubling to their ring:
    equal on a power-of-two number of hosts; on 24, where the leaders' recursive
    doubling folds, phases of different hosts share rounds and the bytes come out
    within 15%."""
    from ringcomm.algorithms import REGISTRY
    from ringcomm.execution import checker
    hosts = tuple(r // per_host for r in range(p))
    for n in (4096, 65536, 1 << 20, 16 << 20):
        st = checker.check(REGISTRY["allreduce"]["hierarchical"], "allreduce", p, (n,),
                           seg=1 << 20, symbolic=False, hosts=hosts)
        A, B, G = cost_model.hierarchical_allreduce(p, n, 1 << 20, per_host)
        assert (A, G) == (st.rounds, st.reduced_max), (p, n)
        hosts_pow2 = not (p // per_host) & (p // per_host - 1)
        assert B == st.busiest if hosts_pow2 else B == pytest.approx(st.busiest, rel=0.15)
