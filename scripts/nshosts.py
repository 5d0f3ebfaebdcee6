#!/usr/bin/env python3
"""Several hosts on one machine, for multi-node runs: network namespaces on a switch.

Each host is a network namespace with one interface, ``eth0``, cabled by a veth
pair to a bridge in a switch namespace; processes started on a host also get
their own host name (a UTS namespace), as on a real cluster. Everything lives in
namespaces this script creates and deletes: no address or interface of the
machine's own network is touched. Needs root and iproute2 (``ip netns``).

    # torchrun, one agent per host (--nnodes = --hosts), static rendezvous on host 0
    sudo python scripts/nshosts.py torchrun --hosts 2 --nproc-per-node 2 -- \\
        -m ringcomm.bench -e 4M --json out.json
    # mpiexec over the hosts (hydra reaches host 1.. through a launcher that enters
    # their namespace, where a cluster would use ssh)
    sudo python scripts/nshosts.py mpiexec --hosts 2 -n 4 -- python -m ringcomm.demo

``--rate 1gbit`` shapes each host's link (a token bucket on eth0), so that links
between hosts are slower than memory, as they are on a cluster.

As a module: ``with NamespaceHosts(2) as hosts: hosts.popen(0, argv)``.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

#: the hosts' network (inside the namespaces only)
SUBNET = "10.213.0"


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or None when they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2 / util-linux)"
    probe = f"rcprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class NamespaceHosts:
    """``n`` hosts: namespaces ``<prefix>0..n-1`` with addresses ``10.213.0.1..n`` on
    ``eth0``, host names ``node0..``, joined by a bridge in ``<prefix>sw``.

    Args:
        n: number of hosts (1-200).
        prefix: namespace name prefix (default: unique to this process).
        rate: token-bucket rate of each host's link (``tc`` syntax, e.g. ``1gbit``);
            None leaves links unshaped.
    """

    def __init__(self, n: int, prefix: str | None = None, rate: str | None = None):
        if not 1 <= n <= 200:
            raise ValueError(f"nshosts: {n} hosts; 1 to 200 can be made")
        self.n, self.rate = n, rate
        self.prefix = prefix or f"rc{os.getpid() % 100000}h"
        self.namespaces = [f"{self.prefix}{i}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.hostnames = [f"node{i}" for i in range(n)]
        self.switch = f"{self.prefix}sw"
        self._dir: str | None = None
        self._procs: list[subprocess.Popen] = []

    def up(self) -> "NamespaceHosts":
        """Create the namespaces, links and addresses (tearing down on failure)."""
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, ns in enumerate(self.namespaces):
                _ip("netns", "add", ns)
                _ip("link", "add", "eth0", "netns", ns, "type", "veth",
                    "peer", "name", f"port{i}", "netns", self.switch)
                _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if self.rate:
                    r = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root",
                                        "tbf", "rate", self.rate, "burst", "256kb",
                                        "latency", "100ms"], capture_output=True, text=True)
                    if r.returncode != 0:
                        raise RuntimeError(f"tc (shaping to {self.rate}): {r.stderr.strip()}")
            self._dir = tempfile.mkdtemp(prefix="nshosts-")
            self._write_launcher()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop every process in the hosts and delete the namespaces (idempotent)."""
        for p in self._procs:
            if p.poll() is None:
                _kill(p)
        for ns in [*self.namespaces, self.switch]:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "NamespaceHosts":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run on ``host``: in its namespace, under its host name."""
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostnames[host], *argv]

    def popen(self, host: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on ``host`` in a new process group (killed by :meth:`down`)."""
        p = subprocess.Popen(self.command(host, argv), start_new_session=True, **kwargs)
        self._procs.append(p)
        return p

    @property
    def launcher(self) -> str:
        """A script for hydra's ``-launcher ssh -launcher-exec``: called like ssh with a
        host address and a command string, it runs the command on that host."""
        assert self._dir, "hosts are not up"
        return os.path.join(self._dir, "launch")

    def _write_launcher(self) -> None:
        cases = "\n".join(f"  {a}) exec {shlex.join(self.command(i, ['sh', '-c']))} \"$*\";;"
                          for i, a in enumerate(self.addresses))
        with open(self.launcher, "w") as f:
            f.write(f"""#!/bin/sh
# hydra's launcher for namespace hosts: launch [ssh options] HOST COMMAND...
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case $host in
{cases}
  *) echo "nshosts launcher: no host $host" >&2; exit 1;;
esac
""")
        os.chmod(self.launcher, 0o755)

    def torchrun_argv(self, host: int, nproc: int, port: int, args: list[str],
                      nnodes: int | None = None) -> list[str]:
        """torchrun's command line for ``host`` of a job on the first ``nnodes`` hosts
        (default: all): static rendezvous on host 0."""
        return [os.path.join(os.path.dirname(sys.executable), "torchrun"),
                "--nnodes", str(nnodes or self.n), "--node-rank", str(host),
                "--nproc-per-node", str(nproc), "--rdzv-backend", "static",
                "--master-addr", self.addresses[0], "--master-port", str(port), *args]

    def mpiexec_argv(self, nprocs: int, args: list[str], hosts: int | None = None) -> list[str]:
        """mpiexec's command line (run it on host 0): ranks in blocks of
        ``ceil(nprocs / hosts)`` over the first ``hosts`` hosts (default: all)."""
        hosts = hosts or self.n
        per_host = -(-nprocs // hosts)
        return [os.path.join(os.path.dirname(sys.executable), "mpiexec"),
                "-launcher", "ssh", "-launcher-exec", self.launcher,
                "-hosts", ",".join(self.addresses[:hosts]), "-n", str(nprocs),
                "-ppn", str(per_host), *args]


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.wait()


def run_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for ``procs``; past ``timeout`` seconds kill them all. Their exit codes
    (-9 for those killed)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    for p in procs:
        if p.poll() is None:
            _kill(p)
    return [p.returncode for p in procs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="launch", required=True)
    for name in ("torchrun", "mpiexec"):
        p = sub.add_parser(name, help=f"run a command under {name} across namespace hosts")
        p.add_argument("--hosts", type=int, default=2, help="number of hosts")
        p.add_argument("--rate", help="shape each host's link, e.g. 1gbit")
        p.add_argument("--timeout", type=float, default=1800, help="seconds before all is killed")
        if name == "torchrun":
            p.add_argument("--nproc-per-node", type=int, default=1)
            p.add_argument("--port", type=int, default=29500)
        else:
            p.add_argument("-n", type=int, required=True, help="number of ranks")
        p.add_argument("args", nargs=argparse.REMAINDER,
                       help="after --: torchrun's script and arguments, or mpiexec's command")
    a = ap.parse_args(argv)
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if not args:
        ap.error("give the command after --")
    why = unavailable()
    if why:
        print(f"nshosts: {why}", file=sys.stderr)
        return 2
    with NamespaceHosts(a.hosts, rate=a.rate) as hosts:
        print(f"nshosts: {a.hosts} hosts " + ", ".join(
            f"{h}={ad}" for h, ad in zip(hosts.hostnames, hosts.addresses))
            + (f", links shaped to {a.rate}" if a.rate else ""), file=sys.stderr, flush=True)
        if a.launch == "torchrun":
            procs = [hosts.popen(i, hosts.torchrun_argv(i, a.nproc_per_node, a.port, args))
                     for i in range(a.hosts)]
        else:
            procs = [hosts.popen(0, hosts.mpiexec_argv(a.n, args))]
        codes = run_all(procs, a.timeout)
    bad = [c for c in codes if c != 0]
    return bad[0] if bad else 0


if __name__ == "__main__":
    sys.exit(main())
