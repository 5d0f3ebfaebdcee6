"""Jobs across hosts: network-namespace hosts (scripts/nshosts.py), each with its own
interface, address and host name, joined by a bridge. With no network variable set
by the launch:

* torchrun ``--nnodes`` (one agent per host, static rendezvous on host 0) and
  mpiexec (hydra entering each host's namespace where a cluster would use ssh)
  run the collectives check, a DDP equivalence check and the algorithm library
  (hierarchical on 2 hosts x 2 ranks) against gloo;
* a network path that cannot work (UCX forced on torchrun's singletons) fails
  within RINGCOMM_CONNECT_TIMEOUT with an error naming hosts, interface and
  variables; it does not hang.

The network path's pieces (interface lookup, which variables are set and which
are left to the user) are tested in-process. Skipped with the reason where
namespaces cannot be made (not root, no iproute2).
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from conftest import RANKS, ROOT, _env, assert_checks
from ringcomm.launch import network

sys.path.insert(0, str(ROOT / "scripts"))
import nshosts  # noqa: E402
import reliability_report  # noqa: E402

_ports = itertools.count(29400)


@pytest.fixture(scope="module")
def hosts():
    why = nshosts.unavailable()
    if why:
        pytest.skip(f"no namespace hosts here: {why}")
    with nshosts.NamespaceHosts(3, prefix=f"rct{os.getpid() % 10000}h") as h:
        yield h


def _wait(procs, what: str, timeout: float) -> list[tuple[int, str]]:
    """(exit code, stdout + stderr) of each process; kills all and fails at ``timeout``."""
    deadline = time.monotonic() + timeout
    outs: list[tuple[int, str]] = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append((p.returncode, o + e))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        outs += [(p.returncode, "".join(p.communicate())) for p in procs[len(outs):]]
        pytest.fail(f"timed out after {timeout}s: {what}\n" + "\n".join(
            f"--- {i}\n{out[-3000:]}" for i, (_, out) in enumerate(outs)))
    return outs


def _start(hosts, host: int, argv: list[str], env: dict | None) -> subprocess.Popen:
    return hosts.popen(host, argv, cwd=ROOT, env=_env(env), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)


def torchrun_hosts(hosts, nnodes: int, per_node: int, program: str, *args: str,
                   timeout: float = 150, env: dict | None = None,
                   check: bool = True) -> list[tuple[int, str]]:
    """tests/ranks/``program`` (or a path) under one torchrun agent on each of the first ``nnodes``
    hosts; each agent's (exit code, output)."""
    port = next(_ports)
    path = program if os.path.sep in program else str(RANKS / program)
    procs = [_start(hosts, i, hosts.torchrun_argv(i, per_node, port, [path, *args], nnodes), env)
             for i in range(nnodes)]
    outs = _wait(procs, f"{program} on {nnodes} hosts", timeout)
    if check and any(code for code, _ in outs):
        pytest.fail(f"{program} failed on {nnodes} torchrun hosts:\n" + "\n".join(
            f"--- host {i} (exit {code})\n{out[-5000:]}" for i, (code, out) in enumerate(outs)))
    return outs


def mpiexec_hosts(hosts, nhosts: int, n: int, program: str, *args: str,
                  timeout: float = 150, env: dict | None = None) -> str:
    """tests/ranks/``program`` on ``n`` ranks over the first ``nhosts`` hosts, mpiexec
    started on host 0."""
    argv = hosts.mpiexec_argv(n, [sys.executable, str(RANKS / program), *args], hosts=nhosts)
    [(code, out)] = _wait([_start(hosts, 0, argv, env)], f"{program} (mpiexec)", timeout)
    if code:
        pytest.fail(f"{program} failed under mpiexec on {nhosts} hosts (exit {code}):\n"
                    f"{out[-8000:]}")
    return out


@pytest.mark.cluster
def test_a_rank_leaves_across_hosts(hosts):
    """Rows of docs/reliability.md's "a rank leaves": mpiexec, one rank on each of two
    hosts, the second leaving while the first waits on it."""
    from test_departure import assert_row

    launcher = "mpiexec, 2 hosts"
    for how in reliability_report.DEPARTURES[launcher]:
        assert_row(reliability_report.departure(launcher, how,
                                                reliability_report.hosts_runner(hosts)))


@pytest.mark.cluster
def test_torchrun_three_hosts_network_ddp_and_subgroups(hosts):
    outs = torchrun_hosts(hosts, 3, 1, "multinode_check.py", "--hosts", "0,1,2",
                          "--netmod", "ofi")
    assert_checks("".join(o for _, o in outs), "multinode_check torchrun 3 hosts x 1", 3)


@pytest.mark.cluster
def test_torchrun_two_hosts_of_two_ranks_hierarchical(hosts):
    outs = torchrun_hosts(hosts, 2, 2, "library_check.py", "--hosts", "0,0,1,1", "--quick")
    assert_checks("".join(o for _, o in outs), "library_check torchrun 2 hosts x 2", 4)


@pytest.mark.cluster
def test_mpiexec_two_hosts_network_ddp_and_subgroups(hosts):
    """With RINGCOMM_IFACE: applied before MPI starts (UCX_NET_DEVICES), MASTER_ADDR is
    that interface's address."""
    out = mpiexec_hosts(hosts, 2, 3, "multinode_check.py", "--hosts", "0,0,1",
                        "--netmod", "launcher", env={"RINGCOMM_IFACE": "eth0"})
    assert_checks(out, "multinode_check mpiexec 2 hosts n=3", 3)


@pytest.mark.cluster
def test_mpiexec_two_hosts_collectives_check(hosts):
    """Every collective across hosts; torchrun's singletons across hosts run
    multinode_check's collectives above and under Slurm (tests/test_slurm_cluster.py)."""
    out = mpiexec_hosts(hosts, 2, 2, "collectives_check.py")
    assert_checks(out, "collectives_check mpiexec 2 hosts x 1", 2)


@pytest.mark.cluster
def test_the_benchmark_across_hosts_reports_its_links(hosts, tmp_path):
    """compare_collectives on 2 hosts x 2 ranks: links within each host and between
    them, measured first and printed above the tables; results checked (-c)."""
    out = tmp_path / "bench.json"
    outs = torchrun_hosts(hosts, 2, 2, str(ROOT / "scripts" / "compare_collectives.py"), "-b",
                          "4K", "-e", "64K", "-f", "16", "-n", "2", "-w", "1", "--min-time", "0",
                          "--rounds", "1", "-c", "--algos", "ring,hierarchical,auto",
                          "--peers", "gloo", "--no-model", "--json", str(out))
    doc = json.loads(out.read_text())
    assert doc["meta"]["hosts"] == {"node0": 2, "node1": 2}
    assert [x["link"] for x in doc["meta"]["links"]] == [
        "within node0", "within node1", "node0 <-> node1"]
    assert all(x["latency_us"] > 0 and x["bandwidth_GBps"] > 0 for x in doc["meta"]["links"])
    assert "# links (ping-pong" in outs[0][1]
    assert {r["status"] for r in doc["results"]} == {"ok"}
    assert all(r["wrong"] == 0 for r in doc["results"])
    assert {(r["size"], r["auto_choice"]) for r in doc["results"] if r["column"] == "auto"} \
        == {(4096, "recursive_doubling"), (65536, "hierarchical")}


#: network paths MPI cannot use across the namespace hosts, by how the world forms:
#: singletons merged (UCX cannot connect them across hosts) and MPI started whole
#: (libfabric's TCP bound to loopback advertises an address no other host reaches)
BROKEN_PATHS = {
    "tree": ({"MPIR_CVAR_CH4_NETMOD": "ucx", "RINGCOMM_PMI": "0"},
             ("MPIR_CVAR_CH4_NETMOD=ucx", "FI_TCP_IFACE=<interface>")),
    "whole": ({"FI_TCP_IFACE": "lo"}, ("FI_TCP_IFACE=lo", "MPIR_CVAR_CH4_NETMOD=ofi")),
}


@pytest.mark.cluster
@pytest.mark.parametrize("way", BROKEN_PATHS)
def test_a_network_path_that_cannot_connect_fails_in_time_naming_what_to_check(hosts, way):
    env, facts = BROKEN_PATHS[way]
    start = time.monotonic()
    outs = torchrun_hosts(hosts, 2, 1, "multinode_check.py", "--hosts", "0,1", "--netmod", "ofi",
                          env={**env, "RINGCOMM_CONNECT_TIMEOUT": "4"}, timeout=90, check=False)
    assert time.monotonic() - start < 60
    assert all(code != 0 for code, _ in outs)
    for host, (_, out) in enumerate(outs):
        assert "did not complete within 4 s" in out, out[-3000:]
        for fact in ("rank 0 on node0", "interface eth0", "RINGCOMM_IFACE=<interface>",
                     *facts):
            assert fact in out, f"host {host}'s error lacks {fact!r}:\n{out[-3000:]}"
    assert "rank 1 on node1" in outs[1][1]


# -- the network path, in-process ---------------------------------------------------
@pytest.fixture
def clean_env(monkeypatch):
    """No network variable set; whatever a test sets is undone afterwards."""
    for var in (*network.VARIABLES, "PMI_HOSTNAME"):
        monkeypatch.setenv(var, "x")
        monkeypatch.delenv(var)
    return monkeypatch


def test_interfaces_and_routes_on_this_machine():
    have = network.interfaces()
    assert have.get("lo") == "127.0.0.1"
    assert network.interface_toward("127.0.0.1") == ("lo", "127.0.0.1")
    assert network.interface_toward("no-such-host.invalid") == (None, None)


def test_across_hosts_libfabric_tcp_on_the_interface_toward_the_store(clean_env):
    set_ = network.apply("eth7", spans_hosts=True, set_netmod=True)
    want = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth7",
            "NCCL_SOCKET_IFNAME": "eth7", "GLOO_SOCKET_IFNAME": "eth7"}
    assert set_ == want
    assert {k: os.environ[k] for k in want} == want


def test_what_the_user_set_wins(clean_env):
    clean_env.setenv("MPIR_CVAR_CH4_NETMOD", "ucx")
    clean_env.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert network.apply("eth7", spans_hosts=True, set_netmod=True) == {
        "GLOO_SOCKET_IFNAME": "eth7"}
    assert os.environ["MPIR_CVAR_CH4_NETMOD"] == "ucx" and "FI_PROVIDER" not in os.environ
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"


def test_one_host_keeps_mpi_defaults_and_loopback_is_never_chosen_across_hosts(clean_env):
    assert network.apply("eth7", spans_hosts=False, set_netmod=True) == {}
    assert network.apply("lo", spans_hosts=True, set_netmod=True) == {
        "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}


def test_ringcomm_iface_is_checked_and_applied_on_one_host_too(clean_env):
    clean_env.setenv("RINGCOMM_IFACE", "nope0")
    with pytest.raises(ValueError, match=r"RINGCOMM_IFACE='nope0' is not an interface .*lo"):
        network.chosen_iface()
    clean_env.setenv("RINGCOMM_IFACE", "lo")
    assert network.chosen_iface() == "lo"
    assert network.apply("lo", spans_hosts=False, set_netmod=False) == {
        "UCX_NET_DEVICES": "lo", "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}


def test_a_rank_that_does_not_start_is_reported_while_waiting_then_named(clean_env, caplog):
    clean_env.setattr(network, "WAIT_REPORT_S", 0.1)
    with pytest.raises(Exception, match=r"waited .* for ranks \[1, 2\] to start"):
        network.compare_hosts(dist.HashStore(), 0, 3, timedelta(seconds=0.35), set_netmod=True)
    reports = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert reports and "2 of 3 ranks to start: ranks [1, 2]" in reports[0], reports


def test_compare_hosts_on_one_host_sets_nothing(clean_env):
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    store = dist.HashStore()
    path = network.compare_hosts(store, 0, 1, timedelta(seconds=5), set_netmod=True)
    assert not path.spans_hosts and path.set_vars == {} and path.iface == "lo"
    assert network.host_of(store, 0) == path.hosts[0]
    assert network.host_of(store, 3) == "unknown"
    with pytest.raises(Exception, match=r"waited .* for ranks \[1\] to start"):
        network.compare_hosts(dist.HashStore(), 0, 2, timedelta(seconds=0.2), set_netmod=True)
