"""scripts/compare_collectives.py: a quick run on 2 ranks (results checked, JSON schema),
the floor column, ringcomm's native algorithm and the speed targets file; the cost
model (features counted from the schedules) against textbook counts and synthetic
timings with known parameters; and tuning files that ringcomm's ``auto`` accepts
and follows."""
from __future__ import annotations

import importlib.util
import json
import math
import sys

import numpy as np
import pytest

from conftest import ROOT, mpirun, torchrun

SCRIPTS = ROOT / "scripts"
SCRIPT = str(SCRIPTS / "compare_collectives.py")
sys.path.insert(0, str(SCRIPTS))
import costmodel  # noqa: E402


def _load_script():
    spec = importlib.util.spec_from_file_location("compare_collectives", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


cc = _load_script()
SEG = 512 * 1024

RESULT_FIELDS = {"collective": str, "size": int, "count": int, "dtype": str, "redop": str,
                 "root": int, "column": str, "status": str}
OPTIONAL_FIELDS = {"time_us": float, "algbw": float, "busbw": float, "wrong": int,
                   "iters": int, "auto_choice": str, "reason": str,
                   "rank_median_us": list, "rank_q25_us": list, "rank_q75_us": list,
                   "dispatch_us": float}


# ---------------------------------------------------------------------------
# the script on two ranks
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick run of every collective on 2 ranks, shared by the checks below."""
    d = tmp_path_factory.mktemp("quick")
    files = {k: str(d / f"out.{k}") for k in ("json", "csv", "png", "md")}
    files["tuning"] = str(d / "tuning.json")
    proc = mpirun(2, SCRIPT, "-b", "4", "-e", "64K", "-f", "128", "-n", "3", "-w", "0",
                  "--min-time", "0", "--rounds", "1", "-c", "--coll", "all",
                  "--algos", "auto,tree,ring",  # auto first: its pick must not see ring's setting
                  "--predict-ranks", "8,64",
                  "--json", files["json"], "--csv", files["csv"], "--plot", files["png"], "--markdown", files["md"],
                  "--write-tuning", files["tuning"], timeout=150)
    with open(files["json"]) as f:
        doc = json.load(f)
    return proc, doc, files


def test_quick_run_checks_every_result_and_finds_nothing_wrong(quick_run):
    proc, doc, _ = quick_run
    results = doc["results"]
    ok = [r for r in results if r["status"] == "ok" and r["column"] != "floor"]
    assert ok, "no measurement succeeded"
    # -c was on: every measured point was checked, and against the expected values
    # (except the floor's, which computes nothing: see the floor test).
    assert all(r["wrong"] == 0 for r in ok), [r for r in ok if r["wrong"] != 0]
    assert "wrong values in total: 0 OK" in proc.stdout
    # What ringcomm has today must run; MPI and gloo run every collective.
    measured = {(r["collective"], r["column"]) for r in ok}
    for need in [("allreduce", "ring"), ("allreduce", "tree"), ("allreduce", "auto"),
                 ("broadcast", "ring"), ("broadcast", "tree"), ("allgather", "ring"),
                 *[(c, "mpi") for c in cc.COLLECTIVES], ("allreduce", "gloo")]:
        assert need in measured, f"{need} was not measured"
    # What ringcomm lacks is reported, not a crash.
    for r in results:
        if r["status"] != "ok":
            assert r["status"] in ("unsupported", "skipped"), r
            assert r["reason"], r
    assert any(r["column"] == "tree" and r["collective"] == "allgather" and
               r["status"] == "unsupported" for r in results)


def test_quick_run_floor_is_dispatch_plus_mpi_for_allreduce_only(quick_run):
    _, doc, _ = quick_run
    cells = {(r["collective"], r["column"], r["size"]): r for r in doc["results"]}
    floors = [r for r in doc["results"] if r["column"] == "floor"]
    assert floors
    for fl in floors:
        if fl["collective"] != "allreduce":
            assert fl["status"] == "unsupported" and "allreduce only" in fl["reason"], fl
            continue
        mpi = cells[("allreduce", "mpi", fl["size"])]
        assert fl["status"] == "ok" and mpi["status"] == "ok", (fl, mpi)
        assert fl["wrong"] is None  # computes nothing, so nothing to check
        assert fl["dispatch_us"] > 0
        # per rank: do-nothing dispatch + that rank's MPI median; time = max over ranks
        assert fl["time_us"] == pytest.approx(max(fl["rank_median_us"]))
        assert mpi["time_us"] < fl["time_us"] <= fl["dispatch_us"] + mpi["time_us"] + 1e-6


def test_quick_run_table_has_a_row_per_size(quick_run):
    proc, doc, _ = quick_run
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.strip() and not ln.startswith("#")]
    # -b 4 -e 64K -f 128: 4, 512, 65536
    by_coll = {}
    for r in doc["results"]:
        by_coll.setdefault(r["collective"], set()).add(r["size"])
    assert len(rows) == sum(len(v) for v in by_coll.values())
    assert sorted(by_coll["allreduce"]) == [4, 512, 65536]
    # allgather etc. round to whole elements per rank: 4 B -> 2 floats on 2 ranks
    assert sorted(by_coll["allgather"]) == [8, 512, 65536]
    assert "# world: 2 ranks" in proc.stdout
    assert "MPICH" in proc.stdout or "MPI" in proc.stdout


def test_quick_run_json_schema(quick_run):
    from ringcomm.algorithms import select

    table = select.load_tuning()
    _, doc, _ = quick_run
    assert doc["schema"] == cc.SCHEMA
    meta = doc["meta"]
    assert meta["world_size"] == 2
    assert sum(meta["hosts"].values()) == 2
    for key in ("ringcomm", "torch", "mpi4py", "mpi_library"):
        assert meta["versions"][key]
    assert meta["ringcomm"]["segment_bytes"] > 0
    assert {c["name"] for c in meta["columns"]} >= {"ring", "tree", "auto", "mpi", "gloo"}
    assert meta["gamma_s_per_byte"]["float/sum"] > 0
    for r in doc["results"]:
        for k, typ in RESULT_FIELDS.items():
            assert isinstance(r[k], typ), (k, r)
        for k, typ in OPTIONAL_FIELDS.items():
            assert r[k] is None or isinstance(r[k], typ), (k, r)
        if r["status"] == "ok":
            assert r["time_us"] > 0 and r["iters"] >= 3
            assert len(r["rank_median_us"]) == 2
            assert r["time_us"] == pytest.approx(max(r["rank_median_us"]))
            # busbw from the nccl-tests factors (2 ranks)
            factor = {"allreduce": 1.0, "broadcast": 1.0, "allgather": 0.5,
                      "reduce_scatter": 0.5, "alltoall": 0.5}[r["collective"]]
            assert r["algbw"] == pytest.approx(r["size"] / r["time_us"] / 1e3)
            assert r["busbw"] == pytest.approx(r["algbw"] * factor)
        if r["column"] == "auto" and r["status"] == "ok":
            # what ringcomm's selection table says for this size (one rank's block for
            # allgather and reduce_scatter: what a rank passes in), independent of the script
            per_block = r["collective"] in ("allgather", "reduce_scatter")
            nbytes = r["size"] // 2 if per_block else r["size"]
            assert r["auto_choice"] == select.choose(table, r["collective"], nbytes, 2), r
    model = doc["analysis"]["cost_model"]
    assert {f["column"] for f in model["fits"] if f["collective"] == "allreduce"} >= {"ring", "tree"}
    assert {p["world_size"] for p in model["predictions"]} == {8, 64}


def test_quick_run_writes_csv_plot_and_a_tuning_file_ringcomm_accepts(quick_run):
    from ringcomm.algorithms import REGISTRY, select

    _, doc, files = quick_run
    with open(files["csv"]) as f:
        lines = f.read().splitlines()
    assert lines[0].startswith("collective,size,count,dtype")
    assert len(lines) == 1 + len(doc["results"])
    with open(files["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(files["md"]) as f:
        md = f.read()
    assert "#### allreduce, float, sum, 2 ranks" in md
    assert "| size | auto us | tree us | ring us | mpi us | gloo us | floor us |" in md
    table = select.load_tuning(files["tuning"])
    with open(files["tuning"]) as f:
        written = json.load(f)
    assert set(written) >= {"allreduce", "broadcast", "allgather"}
    for coll, by_p in written.items():
        assert list(by_p) == ["2"]
        rows = by_p["2"]
        assert rows[-1][0] is None
        assert all(algo in REGISTRY[coll] for _, algo in rows)
        for n in (1, 100, 10_000, 1 << 30):
            assert select.choose(table, coll, n, 2) in REGISTRY[coll]


def test_torchrun_launch():
    proc = torchrun(2, SCRIPT, "-b", "1K", "-e", "1K", "-n", "2", "-w", "0", "--min-time", "0",
                    "-c", "--peers", "mpi", "--no-model", timeout=120)
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(rows) == 1 and rows[0][0] == "1024"
    assert "launcher torchrun" in proc.stdout
    assert "wrong values in total: 0 OK" in proc.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_cuda_columns_without_a_gpu_are_skipped_with_the_reason():
    proc = mpirun(2, SCRIPT, "--device", "cuda", "-b", "1K", "-e", "1K", "--no-model",
                  "--targets", "none", timeout=120)
    assert "skipped: ring (no CUDA device); tree (no CUDA device); auto (no CUDA device); " \
           "nccl (no CUDA device)" in proc.stdout


def _targets_file(path, targets):
    path.write_text(json.dumps({"schema": cc.TARGETS_SCHEMA, "targets": targets}))
    return str(path)


def _target(name, **kw):
    t = {"name": name, "collective": "allreduce", "dtype": "float", "redop": "sum",
         "ranks": 2, "min_bytes": 4096, "max_bytes": 4096, "metric": "time_us", "of": ["auto"],
         "versus": None, "bound": "<=", "goal": 1.0}
    t.update(kw)
    return t


def test_floor_native_and_a_targets_file_in_one_run(tmp_path):
    # Targets whose outcome is certain: the floor includes MPI's time (so it is never
    # below it, and its busbw never above); 64 MiB is not measured here.
    tfile = _targets_file(tmp_path / "t.json", [
        _target("floor at least mpi", of=["floor"], versus="mpi", bound=">=", goal=1.0),
        _target("floor busbw at least mpi's", of=["floor"], versus="mpi", metric="busbw",
                bound=">=", goal=1.0),
        _target("not measured here", min_bytes=64 << 20, max_bytes=64 << 20, of=["native"]),
    ])
    out = str(tmp_path / "out.json")
    proc = mpirun(2, SCRIPT, "-b", "4K", "-e", "4K", "-n", "3", "-w", "0", "--min-time", "0",
                  "--rounds", "1", "-c", "--coll", "allreduce", "-d", "float,bf16",
                  "--algos", "auto,native", "--peers", "mpi,floor", "--no-model",
                  "--targets", tfile, "--json", out, timeout=120)
    with open(out) as f:
        doc = json.load(f)
    cell = {(r["dtype"], r["column"]): r for r in doc["results"]}
    # native: ringcomm's own dispatch into MPI's Allreduce, checked like any column
    assert cell[("float", "native")]["status"] == "ok"
    assert cell[("float", "native")]["wrong"] == 0
    # ... which cannot reduce bfloat16: unsupported, with ringcomm's reason, not an error
    nb = cell[("bfloat16", "native")]
    assert nb["status"] == "unsupported" and "bfloat16" in nb["reason"], nb
    assert cell[("bfloat16", "auto")]["status"] == "ok"
    fl = cell[("float", "floor")]
    assert fl["status"] == "ok" and fl["dispatch_us"] > 0
    assert cell[("bfloat16", "floor")]["status"] == "unsupported"
    assert "ERROR" not in proc.stdout and "FAILED" not in proc.stdout
    assert "native: unsupported:" in proc.stdout
    recs = {r["name"]: r for r in doc["analysis"]["targets"]}
    assert list(recs) == ["floor at least mpi", "floor busbw at least mpi's", "not measured here"]
    assert recs["floor at least mpi"]["met"] is True
    assert recs["floor at least mpi"]["ratio"] == pytest.approx(
        fl["time_us"] / cell[("float", "mpi")]["time_us"])
    assert recs["floor busbw at least mpi's"]["met"] is False
    assert recs["not measured here"]["met"] is None
    assert "floor at least mpi (allreduce float sum): floor" in proc.stdout
    assert proc.stdout.count(" MET") == 1 and proc.stdout.count(" MISSED") == 1
    assert "not measured here (allreduce float sum): NOT MEASURED" in proc.stdout


def test_null_backend_registers_once():
    name = cc.register_null_backend()
    assert cc.register_null_backend() == name == cc.NULL_BACKEND


# ---------------------------------------------------------------------------
# cost model: features counted from the registered schedules
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 3, 4, 5, 8, 64])
def test_ring_allreduce_features_are_the_textbook_counts(p):
    fn = costmodel.features_for("allreduce", "ring")
    u = p * SEG  # one segment per chunk
    sizes = [p * 1024, u, 3 * u, 1000 * u] if p <= costmodel.EXACT_RANKS else [4096]
    for n in sizes:
        k = max(1, -(-n // (p * SEG)))  # segments per chunk
        A, B, G = fn(p, n, SEG)
        assert A == 2 * (p - 1) * k, (p, n)
        assert B == pytest.approx(2 * (p - 1) / p * n), (p, n)
        assert G == pytest.approx((p - 1) / p * n), (p, n)


def test_every_registered_schedule_has_a_model_and_native_does_not():
    from ringcomm.algorithms import NATIVE, REGISTRY

    for coll in cc.COLLECTIVES:
        for name, build in REGISTRY[coll].items():
            assert costmodel.has_model(coll, name) == (build is not NATIVE), (coll, name)
    assert costmodel.has_model("allreduce", "recursive_doubling")
    assert not costmodel.has_model("allreduce", "auto")
    assert not costmodel.has_model("allreduce", "pairwise")
    # recursive doubling: log2 p whole-buffer exchanges, each reduced
    rd = costmodel.features_for("allreduce", "recursive_doubling")
    assert rd(2, 4096, SEG) == (1, 4096, 4096)
    assert rd(8, 4096, SEG) == (3, 3 * 4096, 3 * 4096)
    # native is a black box: fitted as o + beta * n
    f = costmodel.fit("allreduce", "native", [(2, n, 1e-5 + n * 1e-9) for n in SIZES],
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
    assert costmodel.has_model("allreduce", "swap_sum")
    assert costmodel.features_for("allreduce", "swap_sum")(2, 1000, SEG) == (1, 1000, 1000)
    samples = synth("allreduce", "swap_sum", (0.0, 30e-6, 0.5e-9, 0.1e-9))
    f = costmodel.fit("allreduce", "swap_sum", samples, segment_bytes=SEG, gamma=0.1e-9)
    assert (f.alpha, f.beta) == pytest.approx((30e-6, 0.5e-9), rel=1e-6)


def test_features_are_cached_and_bounded_on_many_ranks():
    # Above EXACT_RANKS a whole crossover scan from 1 B to 64 GiB simulates each
    # algorithm only at the anchor sizes (powers of 16, p*seg and 2*p*seg); the rest
    # is interpolated or extrapolated from those.
    seg = SEG
    p = 2 * costmodel.EXACT_RANKS
    fits = {a: costmodel.Fit("allreduce", a, 0.0, 50e-6, 0.5e-9, 0.1e-9, ("alpha", "beta"),
                             0.0, 2, (2,), seg) for a in ("ring", "tree")}
    before = costmodel._simulate.cache_info()
    xs = costmodel.crossovers(fits["tree"], fits["ring"], p)
    after = costmodel._simulate.cache_info()
    anchors = costmodel._anchors(seg, p * seg)
    assert after.misses - before.misses <= 2 * len(anchors)
    assert [x[1:] for x in xs] == [("tree", "ring")]
    # interpolation is exact where the counts are linear in n (ring: one segment per chunk)
    n = 3 * 4096 * p
    A, B, G = costmodel.features_for("allreduce", "ring")(p, n, seg)
    assert (A, B, G) == pytest.approx((2 * (p - 1), 2 * (p - 1) / p * n, (p - 1) / p * n))
    again = costmodel._simulate.cache_info()
    costmodel.features_for("allreduce", "ring")(p, n, seg)
    assert costmodel._simulate.cache_info().misses == again.misses


# ---------------------------------------------------------------------------
# cost model on synthetic timings (the oracle: the parameters that generated them)
# ---------------------------------------------------------------------------
SIZES = [4 << i for i in range(25)]  # 4 B .. 64 MiB


def synth(collective, algo, params, world_sizes=(2,), noise=0.0, seed=0):
    o, alpha, beta, gamma = params
    rng = np.random.default_rng(seed)
    fn = costmodel.features_for(collective, algo)
    assert fn is not costmodel.features_for(collective, None), f"{collective}/{algo} has no model"
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
    f = costmodel.fit(collective, algo, samples, segment_bytes=SEG,
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
    f = costmodel.fit("allreduce", "ring", samples, segment_bytes=SEG, gamma=gamma)
    assert f.alpha == pytest.approx(alpha, rel=0.05)
    assert f.beta == pytest.approx(beta, rel=0.05)
    assert 0.005 < f.rms_rel_err < 0.03


def test_fit_separates_overhead_from_latency_across_world_sizes():
    o, alpha, beta, gamma = 20e-6, 8e-6, 0.5e-9, 0.1e-9
    samples = synth("allreduce", "ring", (o, alpha, beta, gamma), world_sizes=(2, 4, 8, 16))
    f = costmodel.fit("allreduce", "ring", samples, segment_bytes=SEG, gamma=gamma)
    assert f.fitted == ("o", "alpha", "beta")
    assert (f.o, f.alpha, f.beta) == pytest.approx((o, alpha, beta), rel=1e-6)
    assert f.predict(64, 4096) == pytest.approx(o + alpha * 2 * 63 + beta * 2 * 63 / 64 * 4096
                                                + gamma * 63 / 64 * 4096, rel=1e-9)


def test_fit_of_a_black_box_is_latency_plus_bandwidth():
    samples = [(2, n, 3e-6 + n * 0.1e-9) for n in SIZES]
    f = costmodel.fit("allreduce", None, samples, segment_bytes=SEG)
    assert f.algorithm is None and f.fitted == ("o", "beta")
    assert (f.o, f.beta) == pytest.approx((3e-6, 0.1e-9), rel=1e-6)


def test_fit_without_gamma_at_one_world_size_does_not_invent_one():
    # beta and gamma both scale with n here: the fit must not split them arbitrarily.
    samples = synth("allreduce", "ring", (0.0, 30e-6, 0.3e-9, 0.2e-9))
    f = costmodel.fit("allreduce", "ring", samples, segment_bytes=SEG)
    assert f.gamma == 0.0 and "gamma" not in f.fitted
    assert f.beta == pytest.approx(0.3e-9 + 0.2e-9 / 2, rel=1e-6)  # B = n, G = n/2 at p=2


def test_fit_rejects_too_few_samples():
    with pytest.raises(ValueError, match="at least two"):
        costmodel.fit("allreduce", "ring", [(2, 4, 1e-5)], segment_bytes=SEG)


def test_crossover_of_known_models():
    # At 2 ranks and n below one segment: tree = 2a_t + 2n b, ring = 2a_r + n b,
    # equal at n* = 2 (a_r - a_t) / b.
    a_r, a_t, b = 60e-6, 40e-6, 1e-9
    ring = costmodel.fit("allreduce", "ring", synth("allreduce", "ring", (0, a_r, b, 0)),
                         segment_bytes=SEG, gamma=0.0)
    tree = costmodel.fit("allreduce", "tree", synth("allreduce", "tree", (0, a_t, b, 0)),
                         segment_bytes=SEG, gamma=0.0)
    xs = costmodel.crossovers(tree, ring, 2)
    n_star = 2 * (a_r - a_t) / b
    assert len(xs) == 1
    n, slower, faster = xs[0]
    assert (slower, faster) == ("tree", "ring")
    assert abs(n - n_star) <= 1


def test_near_identical_models_do_not_cross():
    # broadcast ring and tree are the same chain on 2 ranks: no crossover to report
    params = (0, 50e-6, 0.2e-9, 0)
    tree = costmodel.fit("broadcast", "tree", synth("broadcast", "tree", params),
                         segment_bytes=SEG)
    ring = costmodel.fit("broadcast", "ring", synth("broadcast", "ring", params),
                         segment_bytes=SEG)
    assert costmodel.crossovers(tree, ring, 2) == []
    assert costmodel.crossovers(tree, ring, 64)  # but they differ on 64 ranks


# ---------------------------------------------------------------------------
# tuning rows from measured crossovers
# ---------------------------------------------------------------------------
def test_tuning_rows_put_the_threshold_at_the_crossing():
    sizes = [2 ** i for i in range(2, 27)]
    times = {"tree": [10 + 0.002 * n for n in sizes], "ring": [20 + 0.001 * n for n in sizes]}
    rows = costmodel.tuning_rows(sizes, times)
    assert [r[1] for r in rows] == ["tree", "ring"] and rows[-1][0] is None
    assert 8192 <= rows[0][0] < 16384      # true crossing: 10000 B
    assert abs(rows[0][0] - 10000) < 1500  # log-linear interpolation lands near it


def test_tuning_rows_ignore_noise_but_follow_a_real_change():
    sizes = [2 ** i for i in range(2, 14)]
    tree = [10.0] * len(sizes)
    ring = [12.0] * len(sizes)
    ring[4:6] = [9.9, 9.9]  # 1% faster at two sizes: a tie, not a crossover
    assert costmodel.tuning_rows(sizes, {"tree": tree, "ring": ring}) == [[None, "tree"]]
    ring[4:6] = [12.0, 5.0]  # 2x faster, but at one size only, between two losses: a spike
    assert costmodel.tuning_rows(sizes, {"tree": tree, "ring": ring}) == [[None, "tree"]]
    ring[4:7] = [5.0, 5.0, 5.0]  # faster at three sizes in a row: real
    rows = costmodel.tuning_rows(sizes, {"tree": tree, "ring": ring})
    assert [r[1] for r in rows] == ["tree", "ring", "tree"]
    assert sizes[3] <= rows[0][0] < sizes[5] and sizes[6] <= rows[1][0] < sizes[8]


def _doc(p, columns, points, segment=SEG):
    return {"schema": cc.SCHEMA,
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
    table = cc.measured_tuning([_doc(4, ["ring", "tree"], pts)], 0.03)
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"broadcast": {"default": [[None, "tree"]]}}))
    written, left_out = cc.write_tuning(str(path), table)
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
    written, left_out = cc.write_tuning(str(path), {"allsmash": {"2": [[None, "pairwise"]]},
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
    out = tmp_path / "model.json"
    assert cc.main(["--model-from", *docs, "--json", str(out), "--predict-ranks", "64"]) == 0
    model = json.loads(out.read_text())["cost_model"]
    for f in model["fits"]:
        assert f["world_sizes"] == [2, 4, 8]
        assert (f["o"], f["alpha"], f["beta"]) == pytest.approx((o, alpha, beta), rel=1e-6)
    text = capsys.readouterr().out
    assert "ring/tree crossover at 64 ranks" in text


def _res(column, size, t_us, choice=None):
    # 2 ranks: allreduce busbw factor 2(n-1)/n = 1
    return {"collective": "allreduce", "dtype": "float", "redop": "sum", "column": column,
            "size": size, "status": "ok", "time_us": t_us, "busbw": size / t_us / 1e3,
            "auto_choice": choice}


def test_the_targets_file_states_the_speed_targets():
    spec = {t["name"]: t for t in cc.load_targets(cc.DEFAULT_TARGETS)}
    assert len(spec) == 3
    lat, mid, big = spec.values()
    assert (lat["metric"], lat["of"], lat["versus"], lat["bound"], lat["goal"]) == \
        ("time_us", ["auto"], "floor", "<=", 3.0)
    assert lat["min_bytes"] == lat["max_bytes"] == 4096
    assert (mid["metric"], sorted(mid["of"]), mid["versus"], mid["bound"], mid["goal"]) == \
        ("busbw", ["auto", "recursive_doubling", "ring", "tree"], "mpi", ">=", 0.9)
    assert (mid["min_bytes"], mid["max_bytes"]) == (256 << 10, 16 << 20)
    assert (big["metric"], big["of"], big["versus"], big["bound"], big["goal"]) == \
        ("busbw", ["ring"], None, ">=", 2.3)
    assert big["min_bytes"] == big["max_bytes"] == 64 << 20
    for t in spec.values():
        assert (t["collective"], t["dtype"], t["redop"], t["ranks"]) == \
            ("allreduce", "float", "sum", 2)


def test_speed_targets_are_the_ratios_of_the_targets_file():
    MiB = 1 << 20
    res = [_res("auto", 4096, 105, "recursive_doubling"), _res("floor", 4096, 30),
           _res("ring", 4096, 120), _res("mpi", 4096, 10)]
    # 256 KiB .. 16 MiB: MPI at 1 GB/s; ringcomm's best at 0.95x, except 0.8x at 1 MiB
    for size, best in ((256 << 10, 0.95), (MiB, 0.8), (16 * MiB, 0.95)):
        t_mpi = size / 1e3  # us at 1 GB/s
        res += [_res("mpi", size, t_mpi), _res("ring", size, t_mpi / best),
                _res("tree", size, t_mpi / best * 2), _res("auto", size, t_mpi / best * 1.5)]
    res.append(_res("ring", 64 * MiB, 64 * MiB / 2.76e3))  # 2.76 GB/s = 1.2x the goal
    res.append({**_res("ring", 8 * MiB, 1.0), "status": "error", "busbw": None})
    text, recs = cc.targets(res, 2)
    got = {r["name"]: r for r in recs}
    lat = got["4 KiB latency: auto <= 3x floor"]
    assert (round(lat["ratio"], 6), lat["met"]) == (3.5, False)        # 105 / 30
    mid = got["256 KiB-16 MiB busbw: best >= 0.9x mpi"]
    assert (round(mid["ratio"], 6), mid["met"], mid["worst_size"]) == (0.8, False, MiB)
    assert [e["best"] for e in mid["sizes"]] == ["ring"] * 3          # the best of four
    assert mid["unmeasured_sizes"] == [8 * MiB]                       # ring failed there
    big = got["64 MiB busbw: ring >= 2.3 GB/s"]
    assert big["value"] == pytest.approx(2.76) and big["met"] is True
    assert big["ratio"] == pytest.approx(1.2)
    assert "= 3.50x (target <= 3x) MISSED" in text
    assert "worst at 1 MiB: ring" in text and "2 of 3 sizes" in text
    assert "ring 2.760 GB/s = 1.20x the goal (target >= 2.3 GB/s) MET" in text
    # other world sizes are reported, with a note
    text4, _ = cc.targets(res, 4)
    assert "stated for 2 ranks" in text4


@pytest.mark.parametrize("change,message", [
    ({"metric": "speed"}, "metric must be time_us or busbw"),
    ({"bound": "<"}, "bound must be"),
    ({"goal": "3"}, "field 'goal'"),
    ({"of": []}, "'of' must list column names"),
    ({"min_bytes": 10, "max_bytes": 5}, "min_bytes is above max_bytes"),
])
def test_bad_targets_files_are_refused_naming_the_field(tmp_path, change, message, capsys):
    path = _targets_file(tmp_path / "t.json", [_target("x", **change)])
    with pytest.raises(ValueError, match=message):
        cc.load_targets(path)
    with pytest.raises(SystemExit):
        cc.parse_args(["--targets", path])
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------
# flags
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("text,value", [("4", 4), ("64K", 65536), ("1M", 1 << 20),
                                        ("2GiB", 2 << 30), ("0.5K", 512), ("8 kb", 8192)])
def test_parse_size(text, value):
    assert cc.parse_size(text) == value


@pytest.mark.parametrize("argv,message", [
    (["-b", "1M", "-e", "1K"], "-b/--minbytes (1048576) is larger than -e/--maxbytes (1024)"),
    (["-d", "complex"], "unknown data type (-d) 'complex'"),
    (["-o", "xor"], "unknown reduction op (-o) 'xor'"),
    (["--coll", "gather"], "unknown collective 'gather'"),
    (["-b", "lots"], "'lots' is not a size"),
    (["-f", "1"], "-f/--stepfactor must be larger than 1"),
    (["-f", "2", "-i", "4"], "either -f/--stepfactor or -i/--stepbytes"),
    (["-n", "0"], "-n/--iters must be at least 1"),
    (["--algos", "", "--peers", "none"], "nothing to compare"),
])
def test_bad_flags_exit_with_a_message_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cc.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_message_sizes():
    assert cc.message_sizes(4, 64, 2.0, None) == [4, 8, 16, 32, 64]
    assert cc.message_sizes(4, 70, 4.0, None) == [4, 16, 64]
    assert cc.message_sizes(0, 3, 2.0, None) == [0, 1, 2]
    assert cc.message_sizes(100, 400, None, 100) == [100, 200, 300, 400]
    assert cc.message_sizes(8, 8, 2.0, None) == [8]


def test_shapes_round_to_whole_elements_per_rank():
    s = cc.shape_for("allgather", 4, 4, 2)
    assert (s.size, s.count, s.per_rank) == (8, 2, 1)
    s = cc.shape_for("allreduce", 6, 4, 2)
    assert (s.size, s.count) == (4, 1)
    assert cc.auto_nbytes("allgather", cc.shape_for("allgather", 4096, 4, 4), 4) == 1024
    assert math.isclose(cc.BUSBW_FACTOR["allreduce"](4), 1.5)
