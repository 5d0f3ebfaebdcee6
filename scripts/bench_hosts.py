#!/usr/bin/env python3
"""compare_collectives across hosts: namespace hosts (scripts/nshosts.py), one
benchmark run per setup, all written to one JSON for docs/multi-node.md.

    sudo python scripts/bench_hosts.py --json docs/data/multinode.json

Setups (each a full ``python -m ringcomm.bench`` run of allreduce, every
ringcomm allreduce algorithm that matters across hosts against MPI's own and
gloo; links measured first):

* 2 hosts x 2 ranks, 1 Gbit/s between hosts, under torchrun (ringcomm chooses
  libfabric over TCP) and under mpiexec (libfabric chosen by hand: MPICH's
  default UCX sees namespace hosts as one machine and moves their messages
  through shared memory, bypassing the shaped link);
* the same under torchrun with unshaped links (a veth pair is as fast as memory);
* 2 hosts x 1 rank, 1 Gbit/s, under torchrun and under mpiexec: one link,
  ringcomm against MPI and gloo on it (each rank gets both cores' worth of torch
  threads, as the benchmark gives a rank per host);
* ``--ddp FILE``: also the DDP paper's latency breakdown (``scripts/bench_ddp.py
  --sections breakdown``) on 2 hosts x 1 rank over the 1 Gbit/s link, where
  overlapping the allreduce with backward has a slow link to hide.

With 2 cores, 4 ranks are oversubscribed: small-message times carry that noise,
large ones are bound by the 1 Gbit/s link.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import nshosts  # noqa: E402

BENCH = ["-m", "ringcomm.bench", "-b", "4", "-e", "16M", "-f", "4",
         "--algos", "ring,tree,recursive_doubling,rabenseifner,hierarchical,auto",
         "--peers", "mpi,gloo", "--no-model"]

#: name -> (launcher, hosts, ranks per host, link rate, extra environment)
SETUPS = {
    "torchrun 2x2 1gbit": ("torchrun", 2, 2, "1gbit", {}),
    "mpiexec 2x2 1gbit": ("mpiexec", 2, 2, "1gbit", {"MPIR_CVAR_CH4_NETMOD": "ofi",
                                                     "FI_PROVIDER": "tcp"}),
    "torchrun 2x2 unshaped": ("torchrun", 2, 2, None, {}),
    "torchrun 2x1 1gbit": ("torchrun", 2, 1, "1gbit", {}),
    "mpiexec 2x1 1gbit": ("mpiexec", 2, 1, "1gbit", {"MPIR_CVAR_CH4_NETMOD": "ofi",
                                                     "FI_PROVIDER": "tcp"}),
}


def run(name: str, out: Path, timeout: float, args: list[str] | None = None) -> dict:
    """Setup ``name`` running ``args`` (default: the collectives benchmark) with
    ``--json out``; the setup and the benchmark's JSON."""
    launcher, nhosts, per_host, rate, extra = SETUPS[name]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    args = [*(args or BENCH), "--json", str(out)]
    with nshosts.NamespaceHosts(nhosts, rate=rate) as hosts:
        if launcher == "torchrun":
            procs = [hosts.popen(i, hosts.torchrun_argv(i, per_host, 29500, args), env=env,
                                 cwd=ROOT) for i in range(nhosts)]
        else:
            procs = [hosts.popen(0, hosts.mpiexec_argv(nhosts * per_host,
                                                       [sys.executable, *args]),
                                 env=env, cwd=ROOT)]
        codes = nshosts.run_all(procs, timeout)
    if any(codes):
        raise SystemExit(f"bench_hosts: {name} failed (exit codes {codes})")
    doc = json.loads(out.read_text())
    return {"name": name, "launcher": launcher, "hosts": nhosts, "ranks_per_host": per_host,
            "link_rate": rate, "environment": extra, "result": doc}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="where to write all runs")
    ap.add_argument("--ddp", metavar="FILE",
                    help="also run the DDP breakdown on 2 hosts x 1 rank, JSON to FILE")
    ap.add_argument("--only", help="comma list of setups to run (default: all)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per setup")
    a = ap.parse_args(argv)
    names = [n for n in a.only.split(",") if n] if a.only is not None else list(SETUPS)
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        ap.error(f"unknown setups {unknown}; known: {list(SETUPS)}")
    why = nshosts.unavailable()
    if why:
        print(f"bench_hosts: {why}", file=sys.stderr)
        return 2
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            print(f"bench_hosts: {name}", file=sys.stderr, flush=True)
            runs.append(run(name, Path(tmp) / f"{i}.json", a.timeout))
        Path(a.json).write_text(json.dumps({"runs": runs}, indent=1) + "\n")
        if a.ddp:
            print("bench_hosts: DDP breakdown, torchrun 2x1 1gbit", file=sys.stderr, flush=True)
            ddp = run("torchrun 2x1 1gbit", Path(tmp) / "ddp.json", a.timeout,
                      [str(ROOT / "scripts" / "bench_ddp.py"), "--sections", "breakdown"])
            Path(a.ddp).write_text(json.dumps(ddp, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
