"""scripts/nscluster.py: a simulator topology file built as network namespaces.

Built and measured (root; skipped with the reason where namespaces cannot be made):
one_switch, two_racks and host_ring from examples/topologies/: every host reaches
every address of every other; a bulk TCP transfer runs at the cable's shaped rate;
two transfers sharing the two racks' uplink get half of it each; on the ring a
transfer to the host across is forwarded over the simulator's route (the bytes are
counted on the cables); ringcomm's all_reduce runs under torchrun across one_switch's
hosts; no namespace is left behind, also when building fails.

The plan (addresses, routes, refusals) is checked without root.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import ROOT, _env
from ringcomm.sim.network import Network
from ringcomm.sim.topology import load, parse

sys.path.insert(0, str(ROOT / "scripts"))
import nscluster  # noqa: E402
import nshosts  # noqa: E402

TOPOLOGIES = ROOT / "examples" / "topologies"
PY = sys.executable

#: run on a host: ICMP echo to every address given (raw socket: root); prints the
#: addresses that did not answer within a second, as JSON
PING = r"""
import json, os, socket, struct, sys, time
def checksum(b):
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    s = (s >> 16) + (s & 0xFFFF)
    return ~(s + (s >> 16)) & 0xFFFF
sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
ident, silent = os.getpid() & 0xFFFF, []
for seq, addr in enumerate(sys.argv[1:]):
    head = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
    packet = struct.pack("!BBHHH", 8, 0, checksum(head), ident, seq)
    deadline, answered = time.monotonic() + 1.0, False
    while not answered and time.monotonic() < deadline:
        sock.sendto(packet, (addr, 0))
        sock.settimeout(0.1)
        try:
            while not answered:
                data, (src, _) = sock.recvfrom(2048)
                answered = src == addr and data[20] == 0 and data[24:28] == packet[4:8]
        except socket.timeout:
            pass
    if not answered:
        silent.append(addr)
print(json.dumps(silent))
"""

#: run on a host: ``recv PORT T0 T1`` prints the bytes/s received between wall-clock
#: times T0 and T1 and the bytes in all; ``send ADDRESS PORT T1`` sends until T1
TRANSFER = r"""
import socket, sys, time
if sys.argv[1] == "recv":
    port, t0, t1 = int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    server = socket.create_server(("0.0.0.0", port))
    conn, _ = server.accept()
    window = total = 0
    while True:
        data = conn.recv(1 << 20)
        if not data:
            break
        total += len(data)
        if t0 <= time.time() <= t1:
            window += len(data)
    print(window / (t1 - t0), total)
else:
    addr, port, t1 = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    while True:  # until the receiver listens
        try:
            conn = socket.create_connection((addr, port), timeout=1)
            break
        except OSError:
            if time.time() > t1:
                raise
            time.sleep(0.02)
    chunk = bytes(1 << 18)
    while time.time() < t1:
        conn.sendall(chunk)
    conn.close()
"""

#: the torchrun smoke test's program
ALL_REDUCE = """\
import torch, torch.distributed as dist, ringcomm  # noqa: F401
dist.init_process_group("ringcomm")
t = torch.full((1 << 16,), float(dist.get_rank() + 1))
dist.all_reduce(t)
n = dist.get_world_size()
assert bool((t == n * (n + 1) / 2).all()), f"rank {dist.get_rank()}: {t[:4]}"
print(f"rank {dist.get_rank()} of {n}: all_reduce ok", flush=True)
dist.destroy_process_group()
"""


@pytest.fixture
def namespaces():
    why = nshosts.unavailable()
    if why:
        pytest.skip(f"no namespace hosts here: {why}")


def _mbit(topo, cable: int = 0) -> float:
    return topo.links[cable].bandwidth * 8 / 1e6


def _left(cluster: nscluster.Cluster) -> list[str]:
    """The cluster's namespaces that still exist."""
    have = {line.split()[0] for line in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines() if line}
    return [ns for ns in [*cluster.namespaces, *cluster.switch_namespaces] if ns in have]


def _ping_all(cluster: nscluster.Cluster) -> None:
    """Every host echoes every address of every other host."""
    silent = {}
    for h in range(cluster.n):
        others = [a for g, addrs in enumerate(cluster.host_addresses) if g != h for a in addrs]
        p = cluster.popen(h, [PY, "-c", PING, *others], stdout=subprocess.PIPE, text=True)
        out, _ = p.communicate(timeout=5 + len(others))
        if json.loads(out):
            silent[cluster.hostnames[h]] = json.loads(out)
    assert not silent, f"addresses that did not answer each host's ping: {silent}"


def _transfer(cluster: nscluster.Cluster, pairs: list[tuple[int, int]],
              seconds: float = 1.6, skip: float = 0.5) -> list[tuple[float, int]]:
    """Bulk TCP from host s to host d for each pair at once, for ``seconds``: each
    receiver's payload rate (Mbit/s) after the first ``skip`` seconds, and its bytes."""
    start = time.time() + 0.4  # the receivers' Python starts first
    t0, t1 = start + skip, start + seconds
    recv = [cluster.popen(d, [PY, "-c", TRANSFER, "recv", str(5201 + i), str(t0), str(t1)],
                          stdout=subprocess.PIPE, text=True) for i, (_, d) in enumerate(pairs)]
    send = [cluster.popen(s, [PY, "-c", TRANSFER, "send", cluster.addresses[d],
                              str(5201 + i), str(t1)]) for i, (s, d) in enumerate(pairs)]
    out = []
    for p in recv:
        rate, total = p.communicate(timeout=seconds + 15)[0].split()
        out.append((float(rate) * 8 / 1e6, int(total)))
    assert [p.wait(timeout=5) for p in send] == [0] * len(send)
    return out


@pytest.mark.cluster
def test_one_switch_reaches_all_shapes_and_runs_ringcomm_under_torchrun(namespaces, tmp_path):
    topo = load(TOPOLOGIES / "one_switch.json")
    with nscluster.Cluster(topo) as c:
        assert c.hostnames == ["node0", "node1", "node2", "node3"]
        assert len(c.switch_namespaces) == 1 and c.qdisc
        _ping_all(c)
        [(rate, _)] = _transfer(c, [(0, 1)])
        assert rate == pytest.approx(_mbit(topo), rel=0.25), f"{rate:.1f} Mbit/s"
        program = tmp_path / "all_reduce.py"
        program.write_text(ALL_REDUCE)
        log = tmp_path / "torchrun.log"
        with open(log, "w") as f:
            codes = c.run_torchrun([str(program)], timeout=120, port=29471, env=_env({}),
                                   cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        out = log.read_text()
        assert codes == [0, 0, 0, 0], out[-5000:]
        for r in range(4):
            assert f"rank {r} of 4: all_reduce ok" in out, out[-5000:]
    assert _left(c) == []


@pytest.mark.cluster
def test_an_exchange_runs_both_ways_at_the_cables_rate(namespaces):
    """Two hosts send to each other at once: each direction at the cable's rate.
    Each pair's bare ACKs go ahead of data (a class of their own), and every cable
    end sends packets of at most GSO_SEGS frames, which the shaper meters."""
    topo = parse(_doc(fabric={"kind": "switch"}, hosts={"count": 2}))
    with nscluster.Cluster(topo) as c:
        assert c.qdisc.startswith("htb")
        for ns, dev in ((c.plan.hosts[0], "eth0"), (c.switch_namespaces[0], None)):
            for link in json.loads(subprocess.run(
                    ["ip", "-n", ns, "-d", "-j", "link", "show"], capture_output=True,
                    text=True, check=True).stdout):
                if link.get("link_type") == "ether" and link.get("linkinfo", {}).get(
                        "info_kind") == "veth" and dev in (None, link["ifname"]):
                    assert link["gso_max_segs"] == nscluster.GSO_SEGS, link
        classes = subprocess.run(["tc", "-n", c.plan.hosts[0], "class", "show", "dev", "eth0"],
                                 capture_output=True, text=True, check=True).stdout
        assert f"class htb 1:{nscluster.ACK_CLASS} parent 1:1 leaf {nscluster.ACK_CLASS}: prio 0" \
            in classes, classes
        rates = _transfer(c, [(0, 1), (1, 0)])
        for rate, _ in rates:
            assert rate == pytest.approx(_mbit(topo), rel=0.15), \
                f"{[round(r, 1) for r, _ in rates]} Mbit/s each way"
    assert _left(c) == []


@pytest.mark.cluster
def test_two_racks_share_their_uplink_fairly(namespaces):
    topo = load(TOPOLOGIES / "two_racks.json")
    uplink = next(i for i, ln in enumerate(topo.links) if ln.key.startswith("links"))
    with nscluster.Cluster(topo) as c:
        assert len(c.switch_namespaces) == 2
        _ping_all(c)
        # both flows cross the uplink (rack0 -> rack1), each from its own NIC
        assert all(2 * uplink in c.plan.paths[s][d] for s, d in ((0, 4), (1, 5)))
        rates = _transfer(c, [(0, 4), (1, 5)])
        half = _mbit(topo, uplink) / 2
        for rate, _ in rates:
            assert rate == pytest.approx(half, rel=0.25), \
                f"{[round(r, 1) for r, _ in rates]} Mbit/s, half the uplink is {half}"
    assert _left(c) == []


@pytest.mark.cluster
def test_host_ring_forwards_over_the_simulators_route(namespaces):
    topo = load(TOPOLOGIES / "host_ring.json")
    with nscluster.Cluster(topo) as c:
        assert c.switch_namespaces == [] and all(len(i) == 2 for i in c.interfaces)
        _ping_all(c)
        route = c.plan.paths[0][3]  # across the ring: forwarded by two hosts
        assert route == Network(topo).route(0, 3) and len(route) == 3
        before = c.link_bytes()
        [(rate, total)] = _transfer(c, [(0, 3)])
        sent = [b - a for a, b in zip(before, c.link_bytes())]
        assert rate == pytest.approx(_mbit(topo), rel=0.25), f"{rate:.1f} Mbit/s"
        for link, n in enumerate(sent):
            if link in route:
                assert n >= total, f"link {link} of the route sent {n} of {total} bytes"
            else:  # acknowledgements and ARP at most
                assert n < 0.05 * total, f"link {link}, off the route, sent {n} bytes"
    assert _left(c) == []


@pytest.mark.cluster
def test_a_failed_build_leaves_no_namespace(namespaces, monkeypatch):
    def fail(self, ends):
        raise RuntimeError("cable ends not up (as if)")
    monkeypatch.setattr(nscluster.Cluster, "_settle", fail)
    c = nscluster.Cluster(TOPOLOGIES / "two_racks.json")
    with pytest.raises(RuntimeError, match="as if"):
        with c:
            pass
    assert _left(c) == []


@pytest.mark.cluster
def test_without_htb_cables_are_shaped_by_tbf(namespaces, monkeypatch):
    have = nscluster._works
    monkeypatch.setattr(nscluster, "_works", lambda ns, dev, qdisc: "htb" not in qdisc
                        and have(ns, dev, qdisc))
    topo = parse(_doc(fabric={"kind": "switch"}, hosts={"count": 2}))
    with nscluster.Cluster(topo) as c:
        assert c.qdisc == "tbf"
        [(rate, _)] = _transfer(c, [(1, 0)], seconds=1.2, skip=0.4)
        assert rate == pytest.approx(_mbit(topo), rel=0.25), f"{rate:.1f} Mbit/s"
    assert _left(c) == []


# -- the plan, without root ------------------------------------------------------------
def _doc(**kw) -> dict:
    return {"hosts": {"count": 4}, "intra_host": {"bandwidth": "5 GB/s"},
            "nics": {"bandwidth": "200 Mbit/s"}, **kw}


def test_the_plan_routes_as_the_simulator_does():
    for name in ("two_racks", "host_ring"):
        topo = load(TOPOLOGIES / f"{name}.json")
        p = nscluster.plan(topo, "x")
        net = Network(topo)
        n = len(topo.hosts)
        assert all(p.paths[s][d] == net.route(s, d) for s in range(n) for d in range(n)
                   if s != d), name
    ring = nscluster.plan(load(TOPOLOGIES / "host_ring.json"), "x")
    # every host: its neighbours' far addresses, and both of the other three hosts'
    assert [len(r) for r in ring.routes] == [8] * 6 and all(ring.forwards)
    racks = nscluster.plan(load(TOPOLOGIES / "two_racks.json"), "x")
    assert racks.routes == [[]] * 8 and not any(racks.forwards)
    assert len({a for i in racks.interfaces for a in i.values()}) == 8


def test_what_cannot_be_emulated_is_refused_naming_why():
    loop = parse(_doc(switches=[{"name": "a", "hosts": "h0-h1"}, {"name": "b", "hosts": "h2-h3"}],
                      links=[{"between": ["a", "b"], "bandwidth": "1 Gbit/s", "count": 2}]))
    with pytest.raises(ValueError, match=r"a - b \(links\[0\]\) closes a loop among switches"):
        nscluster.plan(loop, "x")
    with pytest.raises(ValueError, match="8 NICs a host; one NIC a host"):
        nscluster.plan(load(TOPOLOGIES / "rails_8x8.json"), "x")
    twice = parse(_doc(links=[{"between": ["h0", "h1"], "bandwidth": "1 Gbit/s", "count": 2},
                              {"between": ["h1", "h2"], "bandwidth": "1 Gbit/s"},
                              {"between": ["h2", "h3"], "bandwidth": "1 Gbit/s"}]))
    with pytest.raises(ValueError, match="two cables between h0 and h1"):
        nscluster.plan(twice, "x")
    many = parse({**_doc(fabric={"kind": "switch"}), "hosts": {"count": 201}})
    with pytest.raises(ValueError, match="201 hosts; 1 to 200"):
        nscluster.plan(many, "x")


def test_the_command_line_prints_the_plan_without_root():
    r = subprocess.run([PY, str(ROOT / "scripts" / "nscluster.py"), "--plan",
                        str(TOPOLOGIES / "host_ring.json")], capture_output=True, text=True,
                       env=_env({}), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "6 hosts in a ring: 6 hosts, 0 switches, 6 cables" in r.stdout
    assert "node0: 10.214.2.4/32 via 10.214.0.2 dev eth0" in r.stdout


def test_validation_predicts_again_from_earlier_measurements(tmp_path):
    """scripts/validate_sim.py --measured: an earlier run's measurements calibrated
    and predicted again (no root): the software is fitted on the calibration cells
    alone, and a cell measured at what the fitted model predicts has no error."""
    import validate_sim
    from ringcomm.sim import simulate
    from ringcomm.algorithms import REGISTRY

    topo = load(TOPOLOGIES / "one_switch.json")
    truth = validate_sim.emulated(topo, {"call_us": 300.0, "step_us": 50.0})

    def t(algo, n):
        return simulate("allreduce", algo, REGISTRY["allreduce"][algo], truth, n,
                        order="mpi").seconds * 1e6
    run = {"topology": "examples/topologies/one_switch.json", "qdisc": "htb+bfifo",
           "measured_started": "then",
           "calibration": [{"algorithm": a, "bytes": n, "measured_us": t(a, n)}
                           for a in ("ring", "tree") for n in (4096, 16384)],
           "cells": [{"algorithm": a, "bytes": n, "measured_us": t(a, n)}
                     for a in ("ring", "tree") for n in (65536, 1 << 20)]}
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"runs": [run]}))
    out = tmp_path / "again.json"
    assert validate_sim.main(["examples/topologies/one_switch.json", "--algos", "ring,tree",
                              "--sizes", "64K,1M", "--measured", str(earlier),
                              "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    fitted = doc["runs"][0]["software"]
    assert fitted["call_us"] == pytest.approx(300.0, abs=1) and \
        fitted["step_us"] == pytest.approx(50.0, abs=1)
    assert doc["summary"]["cells"] == 4 and doc["summary"]["max_error"] < 0.01
    assert doc["summary"]["best_within_10"] == 1.0
