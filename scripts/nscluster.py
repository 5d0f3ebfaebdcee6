#!/usr/bin/env python3
"""An emulated cluster built from a simulator topology file: network namespaces,
veth cables, Linux bridges as switches, every cable shaped to its bandwidth.

The JSON file ``python -m ringcomm.sim`` predicts from (examples/topologies/,
docs/simulator.md) is the one built here, so one file drives the prediction and
the run it is checked against:

    sudo python scripts/nscluster.py examples/topologies/two_racks.json -- \\
        -m ringcomm.bench -e 16M --json out.json
    python scripts/nscluster.py --plan examples/topologies/host_ring.json   # no root

The first runs the command under torchrun on every host (one agent a host, as many
processes as the file gives the host ranks, static rendezvous on host 0); the
second prints what would be built.

What is built (root and iproute2 needed; nothing of the machine's own network is
touched):

* a host: a network namespace; processes started on it also get the host name
  ``node<i>`` (a UTS namespace, as scripts/nshosts.py does); one interface
  ``eth<k>`` per cable of its NIC, in the file's cable order;
* a switch: a namespace holding a Linux bridge ``br0``. A NIC's cable to it is a
  veth pair whose far end is a bridge port; a cable between two switches is a veth
  pair between their namespaces, both ends bridge ports. The switches one can reach
  from another form one Ethernet segment; loops among them are refused (bridges
  without spanning tree would flood a loop forever), as is a NIC cabled twice into
  one segment;
* hosts cabled NIC to NIC (the ``ring`` and ``torus`` fabrics): each cable is a
  segment of its own; hosts forward (``net.ipv4.ip_forward=1``) and static routes
  send every address of a host along the simulator's own route (fewest cables)
  from the sender's first rank to that host's first rank, so a message to a host
  two cables away is forwarded by the host between, as the simulator has it;
* every veth end's egress: ``htb`` at the cable's bandwidth (rate = ceil), so each
  direction of a cable is limited alone (full duplex, as the simulator models).
  Under it, one class for each pair of hosts whose route crosses that end, served
  round robin, so that host pairs sharing a cable get equal shares, as the
  simulator's max-min fair flows do (one FIFO leaves the split to TCP's congestion
  control: BBR, on the machine this was written on, split two flows 1:2); in each
  class a fair queue where the kernel has one
  (``fq_codel``, ``sfq``: TCP connections of one pair share fairly too), else a
  byte FIFO. Before them all, a class of TCP's bare acknowledgements (IP packets
  under 128 bytes): left behind a host pair's data in its FIFO they waited up to
  :data:`QUEUE_S`, an ACK clock no datacenter fabric has, and an exchange (a pair's
  data one way, its ACKs the other, in one class) ran up to 2x slower than its
  cables allow. ``tbf`` (no classes) where the kernel lacks htb. :attr:`Cluster.qdisc`
  says which. The rate counts Ethernet frames: TCP's payload gets ~95.6% of it;
* every veth end sends packets of at most :data:`GSO_SEGS` frames
  (``gso_max_segs``): the shaper meters packets, and a 64 KiB segmentation-offload
  packet passed whole on a few frames' tokens, running a short message faster than
  its cable; one frame a packet left the two cores short of time for the kernel's
  per-packet work.

Addresses (only inside the namespaces): host ``h`` is ``10.<214 + s // 256>.<s %
256>.<h + 1>/24`` on segment ``s``; every address of every host is reachable from
every host. :attr:`Cluster.addresses` is each host's address on its first cable.

Not emulated:

* the file's latencies: this kernel's ``tc`` has no ``netem``, so a cable's latency
  is what the veth pair and the kernel give (microseconds), plus queueing;
* the hosts' insides (``intra_host``) and the file's software costs: ranks of one
  host talk however the job's transport makes them talk;
* more than one NIC a host (refused);
* the simulator's spreading of equal routes by rank pair (ECMP): a host has one
  route to each address, chosen as the simulator chooses for the hosts' first ranks.

As a module::

    from ringcomm.sim.topology import load
    with Cluster(load("examples/topologies/one_switch.json")) as c:
        codes = c.run_torchrun(["train.py"], timeout=600)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # ringcomm itself, when run from a checkout
import nshosts  # noqa: E402
from ringcomm.sim.network import Network  # noqa: E402
from ringcomm.sim.topology import Components, Topology, load  # noqa: E402

#: at most this many hosts (as nshosts): a namespace and processes each
MAX_HOSTS = 200
#: htb's buckets, in seconds of the cable's rate, and at least MIN_BURST bytes: a few
#: frames. A bucket holds what passes at the line rate after an idle spell, so a
#: larger one lets small messages through unshaped (a 96 KiB bucket made a 64 KiB
#: allreduce three times faster than its cable allows); htb's own timers keep the
#: rate of long transfers with this one (tests/test_nscluster.py measures them)
BURST_S = 0.0002
MIN_BURST = 4 * 1514
#: the byte FIFO of a class where no fair queue exists (and tbf's queue): seconds of
#: the cable's rate, at least MIN_QUEUE bytes (enough for TCP to keep a cable busy)
QUEUE_S = 0.02
MIN_QUEUE = 256 * 1024
#: the bytes a host-pair class may send in its turn of the round robin
QUANTUM = 16 * 1024
#: the frames one packet may carry on a cable (the kernel's segmentation offload):
#: with 64 KiB packets allreduces of 64 KiB-256 KiB ran up to 1.3x faster than their
#: cables allow; with 1 every cable was slower than its rate, the two cores busy
#: with packets (docs/simulator.md)
GSO_SEGS = 4
#: TCP's bare acknowledgements (IP packets under 128 bytes) go first, in a class of
#: their own assured this share of the cable: behind a host pair's data in its
#: FIFO they would wait up to QUEUE_S, an ACK clock no datacenter fabric has, and
#: an exchange's two directions (one's data, the other's ACKs in one class) then
#: ran up to 2x slower than its cables allow
ACK_SHARE = 0.05
ACK_CLASS = "ff"
ACK_LENGTH_MASK = 0xff80
#: fair queues to try in each class, best first
FAIR_QDISCS = ("fq_codel", "sfq")
#: seconds up() waits for every cable end to carry traffic
SETTLE_S = 10.0


@dataclasses.dataclass
class End:
    """One veth end.

    Attributes:
        namespace: where it lives.
        name: its interface name there.
        link: the simulator's directed link it sends on (``2 * cable`` from the
            cable's ``a`` to ``b``, ``2 * cable + 1`` back).
        bandwidth: bytes per second it may send.
        bridged: it is a port of its namespace's bridge.
    """
    namespace: str
    name: str
    link: int
    bandwidth: float
    bridged: bool = False


@dataclasses.dataclass
class Plan:
    """What :meth:`Cluster.up` builds, worked out from the topology alone.

    Attributes:
        hosts: host namespaces, by host number.
        switches: switch namespaces, by switch (node order).
        cables: the two ends of every cable, in the topology's order.
        interfaces: per host, interface name -> address (``a.b.c.d/24``).
        routes: per host, ``ip route`` arguments (address, next hop, device).
        forwards: per host, whether it forwards others' packets.
        paths: ``paths[s][d]``: the directed links (simulator numbering) a packet from
            host ``s`` to host ``d`` crosses (``[]`` for ``s == d``).
    """
    hosts: list[str]
    switches: list[str]
    cables: list[tuple[End, End]]
    interfaces: list[dict[str, str]]
    routes: list[list[tuple[str, str, str]]]
    forwards: list[bool]
    paths: list[list[list[int]]]
    _crossing: dict[int, list[tuple[int, int]]] | None = dataclasses.field(
        default=None, repr=False, compare=False)

    def pairs(self, link: int) -> list[tuple[int, int]]:
        """The host pairs (sender, receiver) whose packets cross directed ``link``."""
        if self._crossing is None:
            self._crossing = {}
            for s, row in enumerate(self.paths):
                for d, path in enumerate(row):
                    for lid in path:
                        self._crossing.setdefault(lid, []).append((s, d))
        return self._crossing.get(link, [])


def nics_per_host(topo: Topology) -> int:
    """How many NICs each host of ``topo`` has (its nodes start with them)."""
    first = topo.hosts[0]
    k = 1
    while k < len(topo.nodes) and topo.nodes[k] == f"{first}.nic{k}":
        k += 1
    return k


def _address(segment: int, host: int) -> str:
    # the last byte is the host's on every segment: shaping classifies on it
    return f"10.{214 + segment // 256}.{segment % 256}.{host + 1}"


def plan(topo: Topology, prefix: str) -> Plan:
    """Work out namespaces, cables, addresses, routes and paths for ``topo``.

    Args:
        topo: the cluster (:func:`ringcomm.sim.topology.load`).
        prefix: namespace name prefix (hosts ``<prefix><i>``, switches ``<prefix>s<j>``).

    Raises:
        ValueError: a topology that cannot be emulated: too many hosts, several NICs a
            host, a loop among switches, a NIC cabled twice into one segment, or two
            cables between the same two hosts.
    """
    nh = len(topo.hosts)
    if not 1 <= nh <= MAX_HOSTS:
        raise ValueError(f"nscluster: {topo.name}: {nh} hosts; 1 to {MAX_HOSTS} can be "
                         "emulated (a namespace and processes each)")
    nper = nics_per_host(topo)
    if nper != 1:
        raise ValueError(f"nscluster: {topo.name}: {nper} NICs a host; one NIC a host "
                         "is emulated")
    switch_nodes = list(range(nh, len(topo.nodes)))
    hosts = [f"{prefix}{i}" for i in range(nh)]
    switches = [f"{prefix}s{j}" for j in range(len(switch_nodes))]
    ns_of = {**dict(enumerate(hosts)), **dict(zip(switch_nodes, switches))}

    # switches joined by cables form a segment, refusing a loop
    parts = Components(switch_nodes)
    for ln in topo.links:
        if ln.a >= nh and ln.b >= nh and not parts.join(ln.a, ln.b):
            raise ValueError(
                f"nscluster: {topo.name}: the cable {topo.nodes[ln.a]} - "
                f"{topo.nodes[ln.b]} ({ln.key}) closes a loop among switches; Linux "
                "bridges without spanning tree would flood it, so the switches must "
                "form a tree")

    # segments, numbered as the cables that make them come: a switch tree, or a
    # cable between two NICs
    tree_segment: dict[int, int] = {}
    seg_cables: list[list[int]] = []
    interfaces: list[dict[str, str]] = [{} for _ in range(nh)]
    seg_iface: list[dict[int, str]] = [{} for _ in range(nh)]  # host: segment -> iface
    cable_iface: dict[tuple[int, int], str] = {}  # (host, cable) -> iface
    cables: list[tuple[End, End]] = []
    pairs: set[tuple[int, int]] = set()

    def nic_end(h: int, cable: int, link: int, segment: int, bw: float) -> End:
        if segment in seg_iface[h]:
            raise ValueError(f"nscluster: {topo.name}: {topo.hosts[h]}'s NIC has two cables "
                             f"into one segment ({topo.links[cable].key}); each must lead "
                             "to another switch tree or host")
        name = f"eth{len(interfaces[h])}"
        interfaces[h][name] = f"{_address(segment, h)}/24"
        seg_iface[h][segment] = name
        cable_iface[(h, cable)] = name
        return End(hosts[h], name, link, bw)

    for i, ln in enumerate(topo.links):
        if ln.a < nh and ln.b < nh:
            pair = (min(ln.a, ln.b), max(ln.a, ln.b))
            if pair in pairs:
                raise ValueError(f"nscluster: {topo.name}: two cables between "
                                 f"{topo.hosts[pair[0]]} and {topo.hosts[pair[1]]} "
                                 f"({ln.key}); a route would use only one")
            pairs.add(pair)
            seg = len(seg_cables)
            seg_cables.append([])
        else:
            root = parts.find(ln.b if ln.b >= nh else ln.a)
            if root not in tree_segment:
                tree_segment[root] = len(seg_cables)
                seg_cables.append([])
            seg = tree_segment[root]
        seg_cables[seg].append(i)
        cables.append(tuple(
            nic_end(node, i, link, seg, ln.bandwidth) if node < nh else
            End(ns_of[node], f"p{i}", link, ln.bandwidth, bridged=True)
            for node, link in ((ln.a, 2 * i), (ln.b, 2 * i + 1))))
    if len(seg_cables) > 256 * 40:
        raise ValueError(f"nscluster: {topo.name}: {len(seg_cables)} segments do not fit "
                         "the address plan (10.214.0.0 - 10.253.255.0)")

    # the next host on the way from u to d, and the segment to it: d itself on a
    # cluster of one segment, else the first host on the simulator's route between the
    # hosts' first ranks
    routed = any(len(x) > 1 for x in interfaces)
    hop: dict[tuple[int, int], tuple[int, int]] = {}
    if routed:
        net = Network(topo)
        first = [sum(topo.ranks_per_host[:h]) for h in range(nh)]
        for u in range(nh):
            for d in range(nh):
                if u == d:
                    continue
                links = net.route(first[u], first[d])
                dev = cable_iface[(u, links[0] // 2)]
                node = u
                for lid in links:
                    ln = topo.links[lid // 2]
                    node = ln.b if lid % 2 == 0 else ln.a
                    if node < nh:
                        break
                hop[(u, d)] = (node, next(s for s, n in seg_iface[u].items() if n == dev))
    else:
        # every host has one interface, all on the one segment (the file is connected)
        hop = {(u, d): (d, next(iter(seg_iface[u]))) for u in range(nh) for d in range(nh)
               if u != d}

    # routes: every address of every host not on a segment of the sender
    routes: list[list[tuple[str, str, str]]] = [[] for _ in range(nh)]
    if routed:
        for (u, d), (v, seg) in sorted(hop.items()):
            routes[u] += [(f"{_address(s, d)}/32", _address(seg, v), seg_iface[u][seg])
                          for s in seg_iface[d] if s not in seg_iface[u]]

    def within(u: int, v: int, seg: int) -> list[int]:
        """Directed links from u's NIC to v's within a segment (a tree: one path)."""
        adj: dict[int, list[tuple[int, int]]] = {}
        for c in seg_cables[seg]:
            ln = topo.links[c]
            adj.setdefault(ln.a, []).append((ln.b, 2 * c))
            adj.setdefault(ln.b, []).append((ln.a, 2 * c + 1))
        back: dict[int, tuple[int, int]] = {u: (-1, -1)}
        todo = deque([u])
        while todo:
            x = todo.popleft()
            for y, lid in adj.get(x, []):
                if y not in back:
                    back[y] = (x, lid)
                    todo.append(y)
        out = []
        while v != u:
            v, lid = back[v]
            out.append(lid)
        return out[::-1]

    paths: list[list[list[int]]] = [[[] for _ in range(nh)] for _ in range(nh)]
    for s in range(nh):
        for d in range(nh):
            u = s
            while u != d:  # each hop is closer to d on the simulator's shortest route
                v, seg = hop[(u, d)]
                paths[s][d] += within(u, v, seg)
                u = v
    return Plan(hosts, switches, cables, interfaces, routes,
                [routed and len(x) > 1 for x in interfaces], paths)


def _batch(tool: str, namespace: str | None, lines: list[str]) -> None:
    """Run ``lines`` through ``ip -batch`` or ``tc -batch`` (in ``namespace``): one
    process for many commands, the first failing one named."""
    if not lines:
        return
    argv = [tool, *(["-n", namespace] if namespace else []), "-batch", "-"]
    r = subprocess.run(argv, input="\n".join(lines) + "\n", capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} ({namespace or 'this machine'}): "
                           f"{r.stderr.strip() or r.stdout.strip()}")


def _sysctl(namespace: str, settings: dict[str, str]) -> None:
    r = subprocess.run(["ip", "netns", "exec", namespace, "sysctl", "-qw",
                        *(f"{k}={v}" for k, v in settings.items())],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"sysctl in {namespace}: {r.stderr.strip()}")


def _json(argv: list[str]) -> list:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
    return json.loads(r.stdout or "[]")


def _bits(rate: float) -> str:
    return f"{max(1, round(rate * 8))}bit"


def _works(namespace: str, dev: str, qdisc: str) -> bool:
    """Whether this kernel has ``qdisc`` (tried as ``dev``'s root, then removed)."""
    r = subprocess.run(["tc", "-n", namespace, "qdisc", "add", "dev", dev, "root",
                        *qdisc.split()], capture_output=True)
    subprocess.run(["tc", "-n", namespace, "qdisc", "del", "dev", dev, "root"],
                   capture_output=True)
    return r.returncode == 0


class Cluster(nshosts.NamespaceHosts):
    """A topology file's cluster as network namespaces (see the module's docstring).

    Host ``i`` is namespace ``<prefix><i>`` with host name ``node<i>``; :meth:`popen`,
    :meth:`command`, :meth:`torchrun_argv`, :meth:`mpiexec_argv` and :attr:`launcher`
    work as :class:`nshosts.NamespaceHosts`' do.

    Args:
        topo: the cluster, or the path of its file.
        prefix: namespace name prefix (default: unique to this process).

    Raises:
        ValueError: a topology that cannot be emulated (:func:`plan` says why).
        ringcomm.sim.topology.TopologyError: a file that describes no cluster.

    Attributes:
        topo: the topology.
        plan: what is built (:class:`Plan`).
        addresses: each host's address on its first cable (host 0's is the rendezvous).
        host_addresses: every address of each host.
        interfaces: per host, interface name -> address with prefix length.
        switch_namespaces: the switches' namespaces, in the topology's node order.
        qdisc: the shaping in use (``"htb+fq_codel"``, ``"htb+bfifo"``, ``"tbf"``),
            known after :meth:`up`.
    """

    def __init__(self, topo: Topology | str | Path, prefix: str | None = None):
        self.topo = topo if isinstance(topo, Topology) else load(topo)
        prefix = prefix or f"rc{os.getpid() % 100000}c"
        self.plan = plan(self.topo, prefix)
        super().__init__(len(self.topo.hosts), prefix=prefix)
        self.interfaces = self.plan.interfaces
        self.host_addresses = [[a.split("/")[0] for a in x.values()] for x in self.interfaces]
        # a host without cables (a one-host file) is reached on loopback only
        self.addresses = [x[0] if x else "127.0.0.1" for x in self.host_addresses]
        self.switch_namespaces = self.plan.switches
        # nshosts' down() deletes .switch with the hosts; the others go in ours
        self.switch = self.switch_namespaces[0] if self.switch_namespaces else f"{prefix}s"
        self.qdisc: str | None = None

    def up(self) -> "Cluster":
        """Create namespaces, bridges, cables, addresses, routes and shaping, and wait
        until every cable carries traffic.

        Raises:
            RuntimeError: a command failed, or a cable end did not come up in
                :data:`SETTLE_S` seconds (named); everything made is deleted.
        """
        p = self.plan
        try:
            for ns in [*p.hosts, *p.switches]:
                nshosts._ip("netns", "add", ns)
                # before any interface exists, so that each takes the defaults: no IPv6
                # chatter on shaped cables, no reverse-path drops of replies that come
                # back another way, no redirects moving traffic off its planned route
                _sysctl(ns, {"net.ipv6.conf.default.disable_ipv6": "1",
                             "net.ipv4.conf.all.rp_filter": "0",
                             "net.ipv4.conf.default.rp_filter": "0",
                             "net.ipv4.conf.all.send_redirects": "0",
                             "net.ipv4.conf.default.send_redirects": "0"})
            for ns in p.switches:
                _batch("ip", ns, ["link add br0 type bridge", "link set br0 up"])
            _batch("ip", None, [f"link add {a.name} netns {a.namespace} type veth peer name "
                                f"{b.name} netns {b.namespace}" for a, b in p.cables])
            ends = [e for pair in p.cables for e in pair]
            self.qdisc = self._qdisc(ends[0]) if ends else "none"
            for ns in [*p.hosts, *p.switches]:
                mine = [e for e in ends if e.namespace == ns]
                _batch("tc", ns, [x for e in mine for x in self._shaping(e)])
                _batch("ip", ns, [f"link set {e.name} master br0" for e in mine if e.bridged])
            for h, ns in enumerate(p.hosts):
                if p.forwards[h]:
                    _sysctl(ns, {"net.ipv4.ip_forward": "1"})
                _batch("ip", ns, ["link set lo up",
                                  *(f"addr add {a} dev {i}" for i, a in p.interfaces[h].items())])
            for ns in [*p.hosts, *p.switches]:
                # one frame per packet: the shaper's buckets meter frames, where a
                # 64 KiB segmentation-offload packet would pass whole on a few
                # frames' tokens and run a short message faster than its cable
                _batch("ip", ns, [f"link set {e.name} gso_max_segs {GSO_SEGS} up"
                                  for e in ends if e.namespace == ns])
            for h, ns in enumerate(p.hosts):  # a route needs its device up
                _batch("ip", ns, [f"route add {d} via {v} dev {i}" for d, v, i in p.routes[h]])
            self._settle(ends)
            self._dir = tempfile.mkdtemp(prefix="nscluster-")
            self._write_launcher()
        except BaseException:
            self.down()
            raise
        return self

    def _qdisc(self, end: End) -> str:
        """The shaping this kernel allows, tried on ``end``."""
        if not _works(end.namespace, end.name, "handle 1: htb"):
            if not _works(end.namespace, end.name, "tbf rate 1mbit burst 10kb limit 10kb"):
                raise RuntimeError("nscluster: this kernel's tc has neither htb nor tbf, so "
                                   "cables cannot be shaped")
            return "tbf"
        for kind in FAIR_QDISCS:
            if _works(end.namespace, end.name, kind):
                return f"htb+{kind}"
        return "htb+bfifo"

    def _shaping(self, end: End) -> list[str]:
        """``tc`` commands limiting ``end``'s egress to its cable's bandwidth: htb, one
        class for each host pair crossing it (and one for all else), round robin."""
        dev, rate = end.name, _bits(end.bandwidth)
        burst = max(MIN_BURST, round(end.bandwidth * BURST_S))
        queue = max(MIN_QUEUE, round(end.bandwidth * QUEUE_S))
        if self.qdisc == "tbf":
            return [f"qdisc add dev {dev} root tbf rate {rate} burst {burst} limit {queue}"]
        leaf = self.qdisc.split("+")[1] + (f" limit {queue}" if self.qdisc.endswith("bfifo")
                                           else "")
        pairs = self.plan.pairs(end.link)
        # each class is assured an equal part and may borrow up to the whole cable:
        # backlogged classes then share what is free in equal quanta
        share = _bits(end.bandwidth * (1 - ACK_SHARE) / (len(pairs) + 1))
        out = [f"qdisc add dev {dev} root handle 1: htb default 2",
               f"class add dev {dev} parent 1: classid 1:1 htb rate {rate} ceil {rate} "
               f"burst {burst} cburst {burst} quantum {QUANTUM}",
               # TCP's bare acknowledgements first, in a class of their own
               f"class add dev {dev} parent 1:1 classid 1:{ACK_CLASS} htb rate "
               f"{_bits(end.bandwidth * ACK_SHARE)} ceil {rate} burst {burst} cburst {burst} "
               f"prio 0 quantum {QUANTUM}",
               f"qdisc add dev {dev} parent 1:{ACK_CLASS} handle {ACK_CLASS}: pfifo limit 10000",
               f"filter add dev {dev} parent 1: prio 1 protocol ip u32 match ip protocol 6 0xff "
               f"match u16 0x0000 {ACK_LENGTH_MASK:#06x} at 2 flowid 1:{ACK_CLASS}"]
        for k, pair in enumerate([None, *pairs]):
            minor = f"{k + 2:x}"
            out += [f"class add dev {dev} parent 1:1 classid 1:{minor} htb rate {share} "
                    f"ceil {rate} burst {burst} cburst {burst} prio 1 quantum {QUANTUM}",
                    f"qdisc add dev {dev} parent 1:{minor} handle {minor}: {leaf}"]
            if pair is not None:  # the last byte of an address is its host's number + 1
                s, d = pair
                out.append(f"filter add dev {dev} parent 1: prio 2 protocol ip u32 "
                           f"match u8 {s + 1} 0xff at 15 match u8 {d + 1} 0xff at 19 "
                           f"flowid 1:{minor}")
        return out

    def _settle(self, ends: list[End]) -> None:
        """Wait until every veth end is up and every bridge port forwards: the kernel
        notes a carrier up to a second late, and until then drops what is sent."""
        deadline = time.monotonic() + SETTLE_S
        by_ns: dict[str, set[str]] = {}
        for e in ends:
            by_ns.setdefault(e.namespace, set()).add(e.name)
        while True:
            waiting = []
            for ns, names in by_ns.items():
                state = {d["ifname"]: d.get("operstate")
                         for d in _json(["ip", "-n", ns, "-j", "link", "show"])}
                if ns in self.switch_namespaces:
                    for d in _json(["bridge", "-n", ns, "-j", "link", "show"]):
                        if d.get("state") != "forwarding":
                            state[d["ifname"]] = d.get("state")
                waiting += [f"{ns}/{n} ({state.get(n)})" for n in sorted(names)
                            if state.get(n) != "UP"]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nscluster: cable ends not up after {SETTLE_S} s: "
                                   + ", ".join(waiting[:8]))
            time.sleep(0.05)

    def down(self) -> None:
        """Stop every process on the hosts and delete every namespace (idempotent)."""
        super().down()  # processes, host namespaces, the first switch, the launcher
        for ns in self.switch_namespaces[1:]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def __enter__(self) -> "Cluster":
        return self.up()

    def run_torchrun(self, args: list[str], timeout: float, port: int = 29500,
                     **popen_kwargs) -> list[int]:
        """Run ``args`` (torchrun's script and its arguments) under one torchrun agent
        on every host, with as many processes as the topology gives the host ranks.

        Args:
            args: the script and its arguments (``["-m", "ringcomm.bench", ...]`` too).
            timeout: seconds before every agent still running is killed.
            port: the rendezvous port on host 0.
            popen_kwargs: for :meth:`popen` (``env``, ``cwd``, ``stdout``...).

        Returns:
            Every agent's exit code, by host (-9 for one killed at the timeout).
        """
        procs = [self.popen(h, self.torchrun_argv(h, n, port, args), **popen_kwargs)
                 for h, n in enumerate(self.topo.ranks_per_host)]
        return nshosts.run_all(procs, timeout)

    def link_bytes(self) -> list[int]:
        """Bytes every cable end has sent so far (Ethernet frames), in the simulator's
        numbering of directed links (``2 * cable``: from its ``a`` to ``b``; ``2 * cable
        + 1``: back), to compare with a simulation's link loads.

        Raises:
            RuntimeError: the statistics could not be read (the cluster is down).
        """
        sent = {(ns, d["ifname"]): d["stats64"]["tx"]["bytes"]
                for ns in [*self.plan.hosts, *self.plan.switches]
                for d in _json(["ip", "-n", ns, "-j", "-s", "link", "show"])}
        out = [0] * (2 * len(self.plan.cables))
        for e in (e for pair in self.plan.cables for e in pair):
            out[e.link] = sent[(e.namespace, e.name)]
        return out

    def describe(self) -> str:
        """Some lines for a person: hosts with their addresses, switches, shaping."""
        t = self.topo
        lines = [f"nscluster: {t.name}: {len(t.hosts)} hosts, {len(self.switch_namespaces)} "
                 f"switches, {len(t.links)} cables shaped with {self.qdisc or '(not up)'}; "
                 "latencies not emulated"]
        for h, ns in enumerate(self.namespaces):
            ifs = ", ".join(f"{i} {a}" for i, a in self.interfaces[h].items()) or "no cables"
            n = t.ranks_per_host[h]
            lines.append(f"  {t.hosts[h]} = {self.hostnames[h]} ({ns}, {n} rank"
                         f"{'s' if n > 1 else ''}): {ifs}" + (
                             f"; {len(self.plan.routes[h])} routes" if self.plan.routes[h]
                             else ""))
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("topology", help="a topology file (examples/topologies/*.json)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before all is killed")
    ap.add_argument("--port", type=int, default=29500, help="rendezvous port on host 0")
    ap.add_argument("--plan", action="store_true",
                    help="print what would be built, with the routes, and exit (no root)")
    ap.epilog = "after --: torchrun's script and its arguments"
    argv = sys.argv[1:] if argv is None else argv
    # everything after the first "--" is the command: options may come on either side
    # of the topology, and none of the command's are ours
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    args = argv[cut + 1:]
    try:
        cluster = Cluster(a.topology)
    except (ValueError, OSError) as e:  # TopologyError is a ValueError
        print(e, file=sys.stderr)
        return 2
    if a.plan:
        print(cluster.describe())
        for h, routes in enumerate(cluster.plan.routes):
            for d, v, i in routes:
                print(f"  {cluster.hostnames[h]}: {d} via {v} dev {i}")
        return 0
    if not args:
        ap.error("give the command after --")
    why = nshosts.unavailable()
    if why:
        print(f"nscluster: {why}", file=sys.stderr)
        return 2
    with cluster:
        print(cluster.describe(), file=sys.stderr, flush=True)
        codes = cluster.run_torchrun(args, a.timeout, a.port)
    bad = [c for c in codes if c != 0]
    return bad[0] if bad else 0


if __name__ == "__main__":
    sys.exit(main())
