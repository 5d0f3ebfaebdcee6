"""The simulator (ringcomm.sim): topology files and their refusals, routes, max-min
fair sharing, closed forms on uncontended topologies, contention, the two program
sources and the two engines against each other, and the command line."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ringcomm import msccl
from ringcomm.algorithms import REGISTRY
from ringcomm.algorithms.common import binomial
from ringcomm.execution import checker
from ringcomm.schedule import Builder, Region
from ringcomm.sim import engine, topology
from ringcomm.sim.network import Network
from ringcomm.sim.program import FullProgram, RotatedProgram, skeleton
from ringcomm.sim.cell import simulate
from ringcomm.sim.topology import TopologyError, load, parse

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples" / "topologies").glob("*.json"))
#: software that costs nothing, so that closed forms of the network alone hold
FREE = {"call_us": 0, "step_us": 0, "message_us": 0, "reduce_gbps": 1e12, "copy_gbps": 1e12}


def cluster(**kw) -> dict:
    doc = {"hosts": {"count": 4, "ranks_per_host": 1},
           "intra_host": {"bandwidth": "10 GB/s", "latency": "1 us"},
           "nics": {"bandwidth": "1 Gbit/s", "latency": "10 us"},
           "fabric": {"kind": "switch"}, "software": FREE}
    doc.update(kw)
    return doc


# -- topology files ---------------------------------------------------------------------
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_loads(path):
    t = load(path)
    assert t.size == sum(t.ranks_per_host) and t.size >= 4
    assert len(t.rank_nic) == t.size


def test_quantities():
    assert topology.bandwidth("200 Mbit/s", "k") == 25e6
    assert topology.bandwidth("12.5 GB/s", "k") == 12.5e9
    assert topology.bandwidth("100gbit", "k") == 12.5e9
    assert topology.bandwidth("1 GiB/s", "k") == 1 << 30
    assert topology.latency("5 us", "k") == pytest.approx(5e-6)
    assert topology.latency("1.5 ms", "k") == pytest.approx(1.5e-3)
    for bad in (200, "fast", "10 parsecs", "0 Gbit/s"):
        with pytest.raises(TopologyError, match="k:"):
            topology.bandwidth(bad, "k")
    with pytest.raises(TopologyError, match="needs its unit"):
        topology.latency(5, "nics.latency")


def _refusal(tmp_path, doc, *words, line=None):
    f = tmp_path / "t.json"
    f.write_text(json.dumps(doc, indent=1))
    with pytest.raises(TopologyError) as e:
        load(f)
    for w in words:
        assert w in str(e.value), str(e.value)
    if line is not None:
        assert f"line {line}:" in str(e.value), str(e.value)
    return str(e.value)


def test_a_host_on_no_switch_is_refused(tmp_path):
    doc = cluster(switches=[{"name": "s0", "hosts": "h0-h2"}])
    del doc["fabric"]
    _refusal(tmp_path, doc, "host h3 is attached to no switch")


def test_a_link_without_bandwidth_is_refused_naming_its_line(tmp_path):
    doc = cluster(switches=[{"name": "s0", "hosts": "h0-h1"}, {"name": "s1", "hosts": "h2-h3"}],
                  links=[{"between": ["s0", "s1"], "latency": "1 us"}])
    del doc["fabric"]
    text = json.dumps(doc, indent=1)
    line = text[:text.index('"links"')].count("\n") + 1
    _refusal(tmp_path, doc, "links[0].bandwidth: missing", line=line)


def test_a_disconnected_network_is_refused(tmp_path):
    doc = cluster(switches=[{"name": "s0", "hosts": "h0-h1"}, {"name": "s1", "hosts": "h2-h3"}])
    del doc["fabric"]
    _refusal(tmp_path, doc, "disconnected", "h2.nic0")


def test_ranks_that_do_not_add_up_are_refused(tmp_path):
    _refusal(tmp_path, cluster(ranks=6), "ranks: 6", "hold 4")
    doc = cluster(fabric={"kind": "torus", "dims": [3, 3]})
    _refusal(tmp_path, doc, "fabric.dims", "9 hosts", "has 4")


@pytest.mark.parametrize("change, words", [
    ({"nics": {"bandwith": "1 Gbit/s"}}, ["nics.bandwith: unknown key"]),
    ({"hosts": {"count": 0}}, ["hosts.count"]),
    ({"fabric": {"kind": "hypercube"}}, ["fabric.kind"]),
    ({"switches": [{"name": "s", "hosts": "h9"}]}, ["switches[0]"]),
    ({"software": {"step_us": -1}}, ["software.step_us"]),
    ({"colour": "blue"}, ["colour: unknown key"]),
])
def test_bad_keys_are_named(tmp_path, change, words):
    doc = cluster(**change)
    if "switches" in change:
        del doc["fabric"]
    _refusal(tmp_path, doc, *words)


def test_not_json_names_the_line(tmp_path):
    f = tmp_path / "t.json"
    f.write_text('{\n "hosts": {"count": 2},\n oops\n}')
    with pytest.raises(TopologyError, match="line 3: not JSON"):
        load(f)


# -- routes ---------------------------------------------------------------------------
def test_routes_follow_the_topology():
    t = load(ROOT / "examples" / "topologies" / "two_racks.json")
    net = Network(t)
    names = lambda r: [net.names[x] for x in r]  # noqa: E731
    assert names(net.route(0, 1)) == ["h0.nic0 -> rack0", "rack0 -> h1.nic0"]
    assert names(net.route(0, 5)) == ["h0.nic0 -> rack0", "rack0 -> rack1", "rack1 -> h5.nic0"]
    ring = Network(load(ROOT / "examples" / "topologies" / "host_ring.json"))
    assert len(ring.route(0, 3)) == 3 and len(ring.route(0, 5)) == 1  # forwarded / a neighbour
    inside = Network(load(ROOT / "examples" / "topologies" / "two_hosts_2x2.json"))
    assert [inside.names[x] for x in inside.route(0, 1)] == ["rank 0 out (h0)", "rank 1 in (h0)"]
    ids = net.routes(np.array([0, 0, 3]), np.array([5, 1, 5]))
    assert list(net.route_latency[ids] * 1e6) == pytest.approx([60, 40, 60])


def test_ecmp_spreads_flows_over_the_spines():
    t = load(ROOT / "examples" / "topologies" / "fat_tree_1024.json")
    net = Network(t)
    spines = {net.names[x].split(" -> ")[1] for s in range(0, 256, 8)
              for x in net.route(s, s + 512) if "-> spine" in net.names[x]}
    assert len(spines) >= 6  # of 8


# -- max-min fairness and contention ---------------------------------------------------------
def test_max_min_rates():
    # A on link 0, B on links 0 and 1, C on link 1; link 1 has twice the capacity
    hf, hl = np.array([0, 1, 1, 2]), np.array([0, 0, 1, 1])
    assert list(engine.max_min(hf, hl, 3, np.array([1.0, 2.0]))) == pytest.approx([.5, .5, 1.5])
    assert list(engine.max_min(hf, hl, 3, np.array([1.0, 1.0]))) == pytest.approx([.5, .5, .5])


def _pairs_builder(pairs: list[tuple[int, int]], n: int):
    """An allreduce-shaped builder whose ranks only send: ``a`` to ``b`` for each pair
    at once (structure only: never proven, timed through the engine directly)."""
    def build(ctx):
        b = Builder(ctx)
        data = Region(0, 0, n)
        sends = [(d, data) for s, d in pairs if s == ctx.rank]
        recvs = [(s, data) for s, d in pairs if d == ctx.rank]
        b.step(sends=sends, recvs=recvs)
        return b.build()
    return build


def _time_pairs(topo, pairs, n) -> float:
    world, _ = checker.world_of(_pairs_builder(pairs, n), "allreduce", topo.size, (n,))
    costs = engine.Costs(reduce_bw=1e18, copy_bw=1e18, esize=4)
    return engine.run(FullProgram(world), Network(topo), costs).time


def test_two_flows_on_one_link_take_twice_as_long():
    doc = cluster(switches=[{"name": "s0", "hosts": "h0-h1"}, {"name": "s1", "hosts": "h2-h3"}],
                  links=[{"between": ["s0", "s1"], "bandwidth": "1 Gbit/s"}])
    del doc["fabric"]
    topo = parse(doc)
    n = 1 << 18
    lat = 20e-6  # the two NICs' cables; the uplink has none
    one = _time_pairs(topo, [(0, 2)], n) - lat
    two = _time_pairs(topo, [(0, 2), (1, 3)], n) - lat
    assert one == pytest.approx(4 * n / 125e6, rel=1e-9)
    assert two == pytest.approx(2 * one, rel=1e-9)
    # a flow that shares nothing is not slowed
    assert _time_pairs(topo, [(0, 2), (3, 1)], n) - lat == pytest.approx(one, rel=1e-9)


# -- closed forms -----------------------------------------------------------------------------
def _sim(topo, coll, algo, nbytes, **kw):
    r = simulate(coll, algo, REGISTRY[coll][algo], topo, nbytes, **kw)
    assert r.refused is None, r.refused
    return r


@pytest.mark.parametrize("p", [3, 6, 8])
def test_ring_on_a_ring_of_hosts(p):
    alpha, bw = 10e-6, 125e6
    topo = parse(cluster(hosts={"count": p, "ranks_per_host": 1}, fabric={"kind": "ring"}))
    n = 4 * p * 1024
    r = _sim(topo, "allreduce", "ring", n)
    assert r.seconds == pytest.approx(2 * (p - 1) * (alpha + n / (p * bw)), rel=1e-6)
    assert r.shares()["bandwidth"] == pytest.approx((n / (p * bw)) / (alpha + n / (p * bw)),
                                                    rel=1e-4)


@pytest.mark.parametrize("p", [4, 8, 16])
def test_recursive_doubling_on_one_switch(p):
    alpha, bw = 20e-6, 125e6  # two cables of 10 us between any two hosts
    topo = parse(cluster(hosts={"count": p, "ranks_per_host": 1}))
    n = 1 << 16
    r = _sim(topo, "allreduce", "recursive_doubling", n)
    assert r.seconds == pytest.approx(math.log2(p) * (alpha + n / bw), rel=1e-6)


@pytest.mark.parametrize("p", [4, 8, 16])
def test_binomial_tree_broadcast_on_one_switch(p):
    """A parent sends to all its children in one step, so its NIC is shared: a rank
    is reached after, per ancestor, alpha + (its children) * n / B."""
    alpha, bw = 20e-6, 125e6
    topo = parse(cluster(hosts={"count": p, "ranks_per_host": 1}))
    n = 1 << 16

    def reached(r: int) -> float:
        parent, _ = binomial(r, p, 0)
        if parent is None:
            return 0.0
        return reached(parent) + alpha + len(binomial(parent, p, 0)[1]) * n / bw
    r = _sim(topo, "broadcast", "tree", n, segment_bytes=1 << 30)
    assert r.seconds == pytest.approx(max(reached(x) for x in range(p)), rel=1e-6)


# -- the point-to-point executor's order (MPI) -------------------------------------------------
def _stream_builder(k: int, seg: int):
    """Rank 0 sends ``k`` segments to rank 1, one a step; rank 1 receives each into a
    scratch slot of its own and copies it into place (nothing rank 0 sends depends on
    what it receives, and no receive overwrites what a copy still reads, so on MPI
    every send and receive may start at once)."""
    from ringcomm.schedule import Copy

    def build(ctx):
        b = Builder(ctx)
        if ctx.rank == 0:
            for i in range(k):
                b.step(sends=[(1, Region(0, i * seg, seg))])
        else:
            tmp = b.scratch(k * seg)
            for i in range(k):
                b.step(recvs=[(0, Region(tmp, i * seg, seg))],
                       local=[Copy(Region(0, i * seg, seg), Region(tmp, i * seg, seg))])
        return b.build()
    return build


def test_mpi_order_streams_what_nccl_order_steps_through():
    """MPI: rank 0's k sends go at once, one after another on the pair's connection;
    rank 1 copies each while the next arrives: alpha + k T + L. NCCL: one group a
    step, so every step pays the latency, the transfer and the copy: k (alpha + T + L)."""
    from ringcomm.sim.cell import mpi_program
    k, seg, alpha, bw = 6, 1 << 14, 20e-6, 125e6
    topo = parse(cluster(hosts={"count": 2, "ranks_per_host": 1}))
    copy_bw = 1e9
    costs = engine.Costs(reduce_bw=1e12, copy_bw=copy_bw, esize=4)
    big_t, local = 4 * seg / bw, 4 * seg / copy_bw
    build = _stream_builder(k, seg)
    mpi = engine.run(mpi_program(build, "allreduce", topo, (k * seg,), 0, 1 << 30),
                     Network(topo), costs)
    world, _ = checker.world_of(build, "allreduce", 2, (k * seg,))
    nccl = engine.run(FullProgram(world), Network(topo), costs)
    assert mpi.time == pytest.approx(alpha + k * big_t + local, rel=1e-9)
    assert nccl.time == pytest.approx(k * (alpha + big_t + local), rel=1e-9)


def test_what_the_mpi_order_gains_where():
    """A ring's sends carry what the step before reduced: only its receives go early
    (the next chunk arrives while this one is reduced), a few percent; a pipelined
    tree's leaves send every segment ahead, a sixth and more."""
    topo = load(ROOT / "examples" / "topologies" / "two_racks.json")
    for n in (1 << 16, 1 << 22):
        mpi = _sim(topo, "allreduce", "ring", n, order="mpi")
        nccl = _sim(topo, "allreduce", "ring", n, mode="full")
        assert mpi.source == "every rank's, in MPI's order"
        assert 0.95 * nccl.seconds <= mpi.seconds <= nccl.seconds
    mpi = _sim(topo, "allreduce", "tree", 16 << 20, order="mpi")
    nccl = _sim(topo, "allreduce", "tree", 16 << 20)
    assert mpi.seconds < 0.85 * nccl.seconds


# -- program sources and engines ------------------------------------------------------------
@pytest.mark.parametrize("path", ["two_racks", "two_hosts_2x2", "torus_4x4"])
def test_rotated_ring_is_every_ranks_ring(path):
    topo = load(ROOT / "examples" / "topologies" / f"{path}.json")
    full = _sim(topo, "allreduce", "ring", 1 << 20, mode="full")
    rot = _sim(topo, "allreduce", "ring", 1 << 20, mode="rotated")
    assert (full.source, rot.source.split(",")[0]) == ("every rank's", "rank 0's rotated")
    assert rot.seconds == pytest.approx(full.seconds, rel=1e-9)
    assert rot.critical == pytest.approx(full.critical, rel=1e-6, abs=1e-12)


def test_a_tree_is_no_rotation():
    topo = load(ROOT / "examples" / "topologies" / "two_racks.json")
    r = simulate("allreduce", "tree", REGISTRY["allreduce"]["tree"], topo, 1 << 16,
                 mode="rotated")
    assert r.refused and "rank" in r.refused and r.seconds is None


@pytest.mark.parametrize("path", ["torus_4x4", "two_racks", "rails_8x8"])
def test_rounds_engine_against_events(path):
    """The ring's rounds never share a link at once, so the rounds engine is the
    events engine's result even where ranks drift apart (rails: a server's ranks
    next to the ranks that reach other servers)."""
    topo = load(ROOT / "examples" / "topologies" / f"{path}.json")
    for n in (1 << 16, 1 << 22):
        ev = _sim(topo, "allreduce", "ring", n, mode="rotated", engine="events")
        ro = _sim(topo, "allreduce", "ring", n, mode="rotated", engine="rounds")
        assert (ev.engine, ro.engine) == ("events", "rounds")
        assert ro.seconds == pytest.approx(ev.seconds, rel=1e-9)


@pytest.mark.parametrize("path", ["two_racks", "torus_4x4", "rails_8x8"])
def test_world_rounds_against_events(path):
    """Every rank's schedule by NCCL's rounds: exact where a round's messages move
    together, within 6% on these topologies where they do not (measured worst: a
    double binary tree on the torus, 5%)."""
    topo = load(ROOT / "examples" / "topologies" / f"{path}.json")
    for algo in ("tree", "recursive_doubling", "rabenseifner", "double_tree", "hierarchical"):
        for n in (1 << 16, 1 << 24):
            ev = _sim(topo, "allreduce", algo, n, mode="full", engine="events")
            ro = _sim(topo, "allreduce", algo, n, mode="full", engine="rounds")
            assert ro.engine == "rounds" and ro.source == "every rank's"
            assert ro.seconds == pytest.approx(ev.seconds, rel=0.06), (algo, n)


def test_builders_are_told_the_simulated_element_size():
    """As the planner tells them on a real call: the hierarchical allreduce picks its
    leaders' algorithm by bytes, so a bfloat16 call of the crossover's bytes runs
    recursive doubling across two hosts (fewer messages than the ring a float32 call
    of as many elements takes)."""
    from ringcomm.library import hierarchical
    from ringcomm.sim.cell import program_for
    from ringcomm.sim.layouts import layout_for

    topo = parse(cluster(hosts={"count": 2, "ranks_per_host": 2}))
    build = REGISTRY["allreduce"]["hierarchical"]
    n = hierarchical.SMALL_BYTES // 2  # elements: bfloat16 at the crossover
    messages = {k: len(program_for(build, "allreduce", topo, layout_for("allreduce", 4, n),
                                   0, 1 << 30, mode="full", itemsize=k)[0].world.m_rank)
                for k in (2, 4)}
    assert messages[2] < messages[4], messages
    timed = simulate("allreduce", "hierarchical", build, topo, hierarchical.SMALL_BYTES, esize=2)
    assert timed.seconds is not None, timed.refused


def test_a_wrong_algorithm_is_refused_not_timed():
    def lossy(ctx):  # every rank keeps its own data: no reduction at all
        return Builder(ctx).build()
    topo = load(ROOT / "examples" / "topologies" / "one_switch.json")
    r = simulate("allreduce", "lossy", lossy, topo, 1 << 16)
    assert r.seconds is None and r.refused.startswith("refused:"), r.refused


def test_over_budget_says_so_and_gives_no_time():
    topo = load(ROOT / "examples" / "topologies" / "fat_tree_1024.json")
    r = simulate("allreduce", "ring", REGISTRY["allreduce"]["ring"], topo, 1 << 20,
                 engine="events", budget_s=0.5)
    assert r.seconds is None and r.refused.startswith("budget:"), r.refused


def test_the_ring_skeleton():
    _, steps = checker.compiled_rank(REGISTRY["allreduce"]["ring"], "allreduce", 8, 0,
                                     (8 * 64,))
    prog = RotatedProgram(8, skeleton(0, 8, steps))
    assert prog.m == 2 * 2 * 7 and prog.nslots[0] == 2 * 7 + 1
    assert set(prog.sk.offset[prog.sk.kind == engine.SEND].tolist()) == {1}
    assert set(prog.sk.offset[prog.sk.kind == engine.RECV].tolist()) == {7}


# -- the command line ---------------------------------------------------------------------------
def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "ringcomm.sim", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, **kw)


def test_command_line_table_json_and_plot(tmp_path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    p = _cli("examples/topologies/two_racks.json", "--algos", "ring,tree,recursive_doubling",
             "--sizes", "64K,4M", "--json", str(out), "--plot", str(png))
    assert p.returncode == 0, p.stderr
    assert "two racks" in p.stdout and "busiest link" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["schema"] == "ringcomm.sim/1"
    cells = {(r["algorithm"], r["nbytes"]) for r in doc["results"]}
    assert cells == {(a, n) for a in ("ring", "tree", "recursive_doubling")
                     for n in (65536, 4 << 20)}
    assert all(r["seconds"] > 0 and r["busbw_gbps"] > 0 for r in doc["results"])
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("args, words", [
    (["--algos", "nosuch"], "nosuch is no algorithm"),
    (["--budget", "-1"], "--budget"),
    (["--sizes", "12Q"], "--sizes"),
    (["--root", "99"], "--root 99"),
])
def test_command_line_refuses_bad_input(args, words):
    p = _cli("examples/topologies/one_switch.json", *args)
    assert p.returncode == 2 and words in p.stderr, p.stderr


def test_command_line_times_a_users_algorithm_and_an_msccl_file(tmp_path):
    """--import: a module of the user's registers an algorithm; --msccl: an MSCCL
    file (here ringcomm's own ring for 4 ranks, exported) is timed like any other,
    and a ring exported from the built-in one takes the built-in ring's time."""
    (tmp_path / "my_algos.py").write_text(
        "import ringcomm\n"
        "from ringcomm.algorithms import REGISTRY\n"
        "ringcomm.register_algorithm('allreduce', 'my_ring', REGISTRY['allreduce']['ring'])\n")
    xml = tmp_path / "ring4.xml"
    # what `python -m ringcomm.msccl export ring allreduce 4` writes (test_msccl runs it)
    xml.write_text(msccl.to_xml("allreduce", "ring", 4))
    out = tmp_path / "sim.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    p = _cli("examples/topologies/one_switch.json", "--algos", "ring,my_ring", "--import",
             "my_algos", "--msccl", str(xml), "--sizes", "1M", "--json", str(out), env=env)
    assert p.returncode == 0, p.stderr
    times = {r["algorithm"]: r["seconds"] for r in json.loads(out.read_text())["results"]}
    assert len(times) == 3 and all(t > 0 for t in times.values()), times
    assert times["my_ring"] == times["ring"]
    from_xml = next(n for n in times if n not in ("ring", "my_ring"))
    assert times[from_xml] == pytest.approx(times["ring"], rel=0.05), times


def test_command_line_names_a_bad_topology(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps(cluster(ranks=3), indent=1))
    p = _cli(str(f))
    assert p.returncode == 2 and "ranks: 3" in p.stderr and "line" in p.stderr, p.stderr


def test_software_defaults_come_from_the_committed_run():
    from ringcomm.sim import costs
    run = json.loads((ROOT / "docs" / "data" / "compare_2ranks.json").read_text())
    assert costs.defaults() == json.loads(json.dumps(
        costs.fitted(run, "docs/data/compare_2ranks.json")))
