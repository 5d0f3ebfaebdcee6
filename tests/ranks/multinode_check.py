"""Per-rank program for a job across hosts (namespace hosts of scripts/nshosts.py):

* the network path ringcomm chose with no variable set by the launch: libfabric
  over TCP on ``--iface`` under torchrun (``--netmod ofi``), MPI's own under
  mpiexec (``--netmod launcher``), and the same interface for NCCL and gloo;
* ``MASTER_ADDR`` is an address the other hosts reach (under mpiexec ringcomm
  sets it);
* the host layout (``--hosts 0,0,1``) and ``auto``'s choice on it;
* collectives on the world group, on a subgroup within each host and on one
  spanning the hosts, against gloo over the same ranks;
* torch's DDP and ddp/ on ringcomm equal to torch's DDP on gloo.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ringcomm
from ringcomm.launch import network
from ddp import DistributedDataParallel as OurDDP
from _ddp_common import Classifier, done, init, train_classifier


def collectives(c, rank: int, mine, gloo, what: str) -> None:
    """allreduce (every allreduce algorithm), broadcast, allgather, reduce_scatter and
    alltoall on ringcomm group ``mine`` equal gloo's on ``gloo`` (same ranks)."""
    p = dist.get_world_size(mine)
    g = torch.Generator().manual_seed(rank)
    for algo in ("auto", "ring", "tree", "recursive_doubling", "hierarchical", "rabenseifner"):
        for n in (1, 1000, 70000):
            x = torch.randint(-50, 50, (n,), generator=g).double()
            want = x.clone()
            dist.all_reduce(want, group=gloo)
            with ringcomm.algorithm(algo, group=mine):
                dist.all_reduce(x, group=mine)
            c.check(torch.equal(x, want), f"{what}: allreduce {algo} n={n}")
    src = dist.get_global_rank(mine, p - 1)
    b = torch.randint(0, 9, (5000,), generator=g).float()
    want = b.clone()
    dist.broadcast(b, src=src, group=mine)
    dist.broadcast(want, src=src, group=gloo)
    c.check(torch.equal(b, want), f"{what}: broadcast")
    x = torch.randint(0, 99, (3000,), generator=g).float()
    got, want = torch.empty(3000 * p), torch.empty(3000 * p)
    dist.all_gather_into_tensor(got, x, group=mine)
    dist.all_gather_into_tensor(want, x, group=gloo)
    c.check(torch.equal(got, want), f"{what}: allgather")
    x = torch.randint(0, 9, (700 * p,), generator=g).float()
    got, want = torch.empty(700), torch.empty(700)
    dist.reduce_scatter_tensor(got, x, group=mine)
    dist.reduce_scatter_tensor(want, x, group=gloo)
    c.check(torch.equal(got, want), f"{what}: reduce_scatter")
    got, want = torch.empty(500 * p), torch.empty(500 * p)
    x = torch.randint(0, 9, (500 * p,), generator=g).float()
    dist.all_to_all_single(got, x, group=mine)
    dist.all_to_all_single(want, x, group=gloo)
    c.check(torch.equal(got, want), f"{what}: alltoall")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", required=True, help="host number of each rank, e.g. 0,0,1")
    ap.add_argument("--netmod", choices=("ofi", "launcher"), required=True)
    ap.add_argument("--iface", default="eth0")
    args = ap.parse_args()
    rank, world, groups, c = init()
    want_hosts = tuple(int(h) for h in args.hosts.split(","))
    c.check(len(want_hosts) == world, f"--hosts names {len(want_hosts)} ranks of {world}")

    env = os.environ
    if args.netmod == "ofi":
        c.check(env.get("MPIR_CVAR_CH4_NETMOD") == "ofi", "netmod: "
                f"{env.get('MPIR_CVAR_CH4_NETMOD')}")
        c.check(env.get("FI_PROVIDER") == "tcp", f"FI_PROVIDER={env.get('FI_PROVIDER')}")
        c.check(env.get("FI_TCP_IFACE") == args.iface, f"FI_TCP_IFACE={env.get('FI_TCP_IFACE')}")
        path = network.last
        c.check(path is not None and path.spans_hosts and path.iface == args.iface,
                f"network path {path}")
    else:  # mpiexec wired MPI up: ringcomm leaves its netmod alone
        c.check("MPIR_CVAR_CH4_NETMOD" not in env, "netmod set under mpiexec")
        if env.get("RINGCOMM_IFACE"):  # named: UCX uses it, the store is on it
            c.check(env.get("UCX_NET_DEVICES") == args.iface,
                    f"UCX_NET_DEVICES={env.get('UCX_NET_DEVICES')}")
            host = network.interfaces().get(args.iface) if rank == 0 else env["MASTER_ADDR"]
            c.check(env["MASTER_ADDR"] == host, f"MASTER_ADDR={env['MASTER_ADDR']}")
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        c.check(env.get(var) == args.iface, f"{var}={env.get(var)}")
    try:
        addr = ipaddress.ip_address(env["MASTER_ADDR"])
        c.check(not addr.is_loopback, f"MASTER_ADDR={addr} is loopback across hosts")
    except ValueError:
        c.check(args.netmod == "ofi", f"MASTER_ADDR={env['MASTER_ADDR']} is not an address")

    pg = ringcomm.get_group()
    c.check(pg.planner.hosts == want_hosts, f"host layout {pg.planner.hosts}, "
            f"expected {want_hosts}")
    several = len(set(want_hosts)) < len(want_hosts)
    chosen = pg.algorithm_for("allreduce", 4 << 20)
    c.check((chosen == "hierarchical") == several,
            f"auto chose {chosen} for 4 MiB on hosts {want_hosts}")

    collectives(c, rank, groups["ringcomm"], groups["gloo"], "world")
    # a subgroup within each host and one with the first rank of each host
    for h in sorted(set(want_hosts)):
        members = [r for r, x in enumerate(want_hosts) if x == h]
        sub, sub_gloo = dist.new_group(members), dist.new_group(members, backend="gloo")
        if rank in members:
            c.check(ringcomm.get_group(sub).planner.hosts == (), "host subgroup layout")
            collectives(c, rank, sub, sub_gloo, f"subgroup of host {h}")
    leaders = [want_hosts.index(h) for h in sorted(set(want_hosts))]
    sub, sub_gloo = dist.new_group(leaders), dist.new_group(leaders, backend="gloo")
    if rank in leaders:
        collectives(c, rank, sub, sub_gloo, "subgroup across hosts")

    def train(wrapper, group):
        torch.manual_seed(0)
        return train_classifier(wrapper, Classifier(), group, bucket_cap_mb=0.002, batch=6)

    oracle = train(TorchDDP, groups["gloo"])
    for name, wrapper in (("torch's DDP", TorchDDP), ("ddp/", OurDDP)):
        got = train(wrapper, groups["ringcomm"])
        c.check(all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(got, oracle)),
                f"{name} on ringcomm across hosts differs from torch's DDP on gloo")
    done(c)


if __name__ == "__main__":
    sys.exit(main())
