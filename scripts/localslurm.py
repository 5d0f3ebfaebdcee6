#!/usr/bin/env python3
"""A Slurm cluster on this machine, from Debian's ``slurm-wlm``: for trying and
testing ringcomm under ``srun`` and ``sbatch`` without a real cluster.

    eval "$(sudo python scripts/localslurm.py up)"            # one host: this machine
    srun -n 4 python -m ringcomm.demo
    sudo python scripts/localslurm.py down

    eval "$(sudo python scripts/localslurm.py up --hosts 2)"  # two namespace hosts
    sudo python scripts/localslurm.py exec -- srun -N 2 --ntasks-per-node 2 \\
        python -m ringcomm.demo
    sudo python scripts/localslurm.py down

One host runs slurmctld and one slurmd on this machine, on free private ports.
``--hosts N`` makes N hosts of ``scripts/nshosts.py`` (network namespaces on a
bridge, each with its own address and host name, ``node0..``): slurmctld and a
slurmd on ``node0``, a slurmd on each other host, host names resolvable on every
host (the cluster's hosts file mounted over ``/etc/hosts`` in each host's own
mount namespace). Jobs are then submitted from ``node0``, the login node:
``exec -- COMMAND`` runs a command there (on one host it just runs it).

``up``'s last line is ``export SLURM_CONF=PATH``, for a shell to eval; ``down``
stops the daemons and removes the namespaces and files. The cluster needs root
(Slurm's daemons run as root, without munge: ``auth/none``, ``cred/none``),
``proctrack/linuxproc`` and ``task/none``, so no cgroups are needed either.

As a module: ``with LocalSlurm(hosts=2) as c: subprocess.run(c.command(["srun", ...]),
env={**os.environ, **c.env})``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nshosts  # noqa: E402

#: where ``up`` puts the cluster unless ``--dir`` says otherwise
DEFAULT_DIR = os.path.join(tempfile.gettempdir(), "ringcomm-localslurm")
#: CPUs each node declares (more than this machine has: ranks are oversubscribed)
DEFAULT_CPUS = 8
#: the daemons' ports inside namespace hosts (private to the namespaces)
NS_PORTS = (6817, 6818)
DAEMONS = ("slurmctld", "slurmd", "srun", "sinfo")


def unavailable(hosts: int = 0) -> str | None:
    """Why such a cluster cannot be made here, or None when it can."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found): "
                f"apt-get install slurm-wlm")
    if os.geteuid() != 0:
        return "Slurm's daemons run as root here (auth/none): run as root"
    return nshosts.unavailable() if hosts else None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalSlurm:
    """A running cluster: :meth:`up` starts it, :meth:`down` stops it.

    Args:
        hosts: 0 for one host (this machine); N >= 1 for N namespace hosts.
        cpus: CPUs each node declares.
        root: the cluster's directory (configuration, state, logs).
        rate: shape each namespace host's link (``tc`` syntax, e.g. ``1gbit``).
    """

    def __init__(self, hosts: int = 0, cpus: int = DEFAULT_CPUS, root: str | None = None,
                 rate: str | None = None):
        if hosts < 0:
            raise ValueError(f"localslurm: --hosts {hosts}; give 0 (this machine) or more")
        if cpus < 1:
            raise ValueError(f"localslurm: --cpus {cpus}; each node needs at least one")
        self.hosts, self.cpus, self.rate = hosts, cpus, rate
        self.root = os.path.abspath(root or tempfile.mkdtemp(prefix="localslurm-"))
        self.conf = os.path.join(self.root, "slurm.conf")
        self.hosts_file = os.path.join(self.root, "hosts")
        self.ns: nshosts.NamespaceHosts | None = None
        if hosts:
            self.ns = nshosts.NamespaceHosts(hosts, prefix=f"rcs{os.getpid() % 100000}h",
                                             rate=rate)
            self.nodes = list(self.ns.hostnames)
            self.addresses = list(self.ns.addresses)
        else:
            self.nodes = [socket.gethostname().split(".")[0]]
            self.addresses = ["127.0.0.1"]

    @property
    def env(self) -> dict[str, str]:
        """What a client (srun, sbatch, sinfo) needs in its environment."""
        return {"SLURM_CONF": self.conf}

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run on the login node (``node0`` of namespace hosts)."""
        return self._on(0, argv)

    def _on(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run on ``host``: in its network namespace, under its host name, with
        the cluster's hosts file as ``/etc/hosts`` (a mount namespace of its own).
        Not ``ip netns exec``: the sysfs it mounts lacks the cgroup file systems
        slurmd looks for."""
        if not self.ns:
            return list(argv)
        return ["nsenter", f"--net=/run/netns/{self.ns.namespaces[host]}",
                "unshare", "--mount", "--uts", "sh", "-c",
                'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"',
                self.hosts_file, self.nodes[host], *argv]

    # -- up and down ------------------------------------------------------------------
    def up(self, timeout: float = 30) -> "LocalSlurm":
        """Write the configuration, start the daemons, wait until every node is idle
        (tearing all down on failure)."""
        try:
            os.makedirs(os.path.join(self.root, "state"), exist_ok=True)
            if self.ns:
                self.ns.up()
                ports = NS_PORTS
                with open(self.hosts_file, "w") as f:
                    f.write("127.0.0.1 localhost\n" + "".join(
                        f"{a} {n}\n" for a, n in zip(self.addresses, self.nodes)))
            else:
                ports = tuple(_free_ports(2))
            self._write_conf(*ports)
            self._save()
            self._daemon(0, ["slurmctld", "-i"])
            for i, node in enumerate(self.nodes):
                self._daemon(i, ["slurmd"] if self.ns else ["slurmd", "-N", node])
            self._wait_idle(timeout)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop the daemons and the jobs' processes; remove namespaces and files
        (idempotent)."""
        for pidfile in sorted(os.listdir(self.root)) if os.path.isdir(self.root) else []:
            if pidfile.endswith(".pid"):
                try:
                    with open(os.path.join(self.root, pidfile)) as f:
                        os.kill(int(f.read().strip()), signal.SIGTERM)
                except (OSError, ValueError):
                    pass
        time.sleep(0.2)
        if self.ns:
            self.ns.down()  # kills whatever is left in the hosts
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "LocalSlurm":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    @classmethod
    def attach(cls, root: str) -> "LocalSlurm":
        """The cluster ``up`` left in ``root`` (for ``down`` and ``exec``)."""
        try:
            with open(os.path.join(root, "cluster.json")) as f:
                saved = json.load(f)
        except FileNotFoundError:
            raise SystemExit(f"localslurm: no cluster in {root} (start one with `up`)")
        c = cls.__new__(cls)
        c.hosts, c.cpus, c.rate = saved["hosts"], saved["cpus"], saved["rate"]
        c.root, c.conf = root, os.path.join(root, "slurm.conf")
        c.hosts_file = os.path.join(root, "hosts")
        c.nodes, c.addresses = saved["nodes"], saved["addresses"]
        c.ns = None
        if c.hosts:
            c.ns = nshosts.NamespaceHosts(c.hosts, prefix=saved["prefix"], rate=c.rate)
        return c

    # -- pieces -----------------------------------------------------------------------
    def _write_conf(self, ctld_port: int, slurmd_port: int) -> None:
        r = self.root
        nodes = "".join(f"NodeName={n} NodeAddr={a} CPUs={self.cpus} State=UNKNOWN\n"
                        for n, a in zip(self.nodes, self.addresses))
        with open(self.conf, "w") as f:
            f.write(f"""# written by ringcomm's scripts/localslurm.py
ClusterName=ringcomm
SlurmctldHost={self.nodes[0]}({self.addresses[0]})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
KillWait=5
MinJobAge=5
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool-%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")

    def _save(self) -> None:
        with open(os.path.join(self.root, "cluster.json"), "w") as f:
            json.dump({"hosts": self.hosts, "cpus": self.cpus, "rate": self.rate,
                       "prefix": self.ns.prefix if self.ns else None,
                       "nodes": self.nodes, "addresses": self.addresses}, f)

    def _daemon(self, host: int, argv: list[str]) -> None:
        """Start a daemon on ``host`` (it forks into the background)."""
        argv = self._on(host, argv)
        r = subprocess.run(argv, env={**os.environ, **self.env}, capture_output=True,
                           text=True, timeout=30)
        if r.returncode:
            raise RuntimeError(f"localslurm: {' '.join(argv)} failed (exit {r.returncode}):"
                               f" {r.stderr.strip() or r.stdout.strip()}{self._logs()}")

    def _wait_idle(self, timeout: float) -> None:
        deadline, states = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            try:
                r = subprocess.run(self.command(["sinfo", "-h", "-N", "-o", "%N %T"]),
                                   env={**os.environ, **self.env}, capture_output=True,
                                   text=True, timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
            states = r.stdout.strip() or r.stderr.strip()
            lines = [ln.split() for ln in r.stdout.splitlines()]
            if r.returncode == 0 and len(lines) == len(self.nodes) and all(
                    s[1].rstrip("*") == "idle" for s in lines if len(s) == 2):
                return
            time.sleep(0.2)
        raise RuntimeError(f"localslurm: the nodes were not idle within {timeout:g} s "
                           f"(sinfo: {states!r}){self._logs()}")

    def _logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.root)) if os.path.isdir(self.root) else []:
            if name.endswith(".log"):
                with open(os.path.join(self.root, name)) as f:
                    tail = f.read().splitlines()[-5:]
                out.append(f"\n--- {name}\n" + "\n".join(tail))
        return "".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=DEFAULT_DIR, help=f"the cluster's files (default {DEFAULT_DIR})")
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("up", help="start a cluster; the last line is `export SLURM_CONF=...`")
    p.add_argument("--hosts", type=int, default=0,
                   help="namespace hosts (default 0: this machine is the one host)")
    p.add_argument("--cpus", type=int, default=DEFAULT_CPUS, help="CPUs each node declares")
    p.add_argument("--rate", help="shape each namespace host's link, e.g. 1gbit")
    sub.add_parser("down", help="stop the cluster and remove its files")
    p = sub.add_parser("exec", help="run a command on the login node (node0)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="after --: the command")
    a = ap.parse_args(argv)
    if a.what == "up":
        why = unavailable(a.hosts)
        if why:
            print(f"localslurm: {why}", file=sys.stderr)
            return 2
        if os.path.exists(os.path.join(a.dir, "cluster.json")):
            print(f"localslurm: a cluster is already up in {a.dir} (`down` first)",
                  file=sys.stderr)
            return 1
        c = LocalSlurm(a.hosts, a.cpus, a.dir, a.rate).up()
        where = (f"{a.hosts} namespace hosts " + ", ".join(
            f"{n}={ad}" for n, ad in zip(c.nodes, c.addresses)) if a.hosts else
            f"this machine ({c.nodes[0]})")
        print(f"# localslurm: up on {where}, {c.cpus} CPUs each; "
              + ("submit from node0: localslurm.py exec -- srun ..." if a.hosts else
                 "srun and sbatch work once SLURM_CONF is exported"), file=sys.stderr)
        print(f"export SLURM_CONF={c.conf}")
        return 0
    c = LocalSlurm.attach(a.dir)
    if a.what == "down":
        c.down()
        return 0
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if not args:
        ap.error("give the command after --")
    return subprocess.run(c.command(args), env={**os.environ, **c.env}).returncode


if __name__ == "__main__":
    sys.exit(main())
