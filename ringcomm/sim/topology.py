"""A cluster described in a small JSON file: hosts and their ranks, the link
inside a host, each host's NICs, switches and the links between them, and the
software's own costs. :func:`load` reads and checks one; :class:`Topology` is what
the simulator routes over.

The format (docs/simulator.md has it in full, examples/topologies/ has examples)::

    {
      "name": "two racks, 4:1 uplink",
      "hosts": {"count": 8, "ranks_per_host": 1},          # or a list, see below
      "intra_host": {"bandwidth": "10 GB/s", "latency": "1 us"},
      "nics": {"per_host": 1, "bandwidth": "200 Mbit/s", "latency": "5 us"},
      "switches": [{"name": "tor0", "hosts": "h0-h3"}, {"name": "tor1", "hosts": "h4-h7"}],
      "links": [{"between": ["tor0", "tor1"], "bandwidth": "200 Mbit/s"}],
      "software": {"step_us": 6.0}
    }

or, in place of ``switches`` and ``links``, a generated fabric: ``"fabric": {"kind":
"switch" | "fat_tree" | "rails" | "ring" | "torus", ...}``.

Hosts are ``h0``, ``h1``, ... (``"prefix"`` changes the ``h``), or named in a list
``[{"name": "a", "ranks": 8}, ...]``. Ranks are numbered host after host, as
mpiexec and torchrun place them. Local rank ``i`` of a host uses NIC ``i %
per_host``: one NIC shared by every rank, or one per rank (rails). A link is full
duplex: each direction has the bandwidth.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

#: bandwidth units -> bytes per second per unit
_BANDWIDTH = {"bit/s": 1 / 8, "kbit/s": 1e3 / 8, "mbit/s": 1e6 / 8, "gbit/s": 1e9 / 8,
              "tbit/s": 1e12 / 8, "bps": 1 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8,
              "gbps": 1e9 / 8, "tbps": 1e12 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8,
              "gbit": 1e9 / 8, "b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
              "kib/s": 1 << 10, "mib/s": 1 << 20, "gib/s": 1 << 30, "tib/s": 1 << 40}
#: latency units -> seconds per unit
_LATENCY = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([a-zµ/]+)\s*$", re.IGNORECASE)

#: software costs (seconds, bytes per second) when the file names none: fitted to
#: this machine's committed runs by :func:`ringcomm.sim.costs.defaults`
SOFTWARE_KEYS = ("call_us", "step_us", "message_us", "reduce_gbps", "copy_gbps")
FABRICS = ("switch", "fat_tree", "rails", "ring", "torus")


class TopologyError(ValueError):
    """A topology file that cannot describe a cluster; the message names the key
    (``links[2].bandwidth``) and, for a file, its line."""


@dataclasses.dataclass(frozen=True)
class Link:
    """One undirected cable: ``a`` and ``b`` are node numbers of :class:`Topology`,
    ``bandwidth`` bytes per second each way, ``latency`` seconds; ``key`` names where
    the file said so."""
    a: int
    b: int
    bandwidth: float
    latency: float
    key: str


@dataclasses.dataclass
class Topology:
    """A checked cluster.

    Attributes:
        name: what the file calls it.
        hosts: host names, in rank order.
        ranks_per_host: ranks on each host.
        rank_host: the host number of every rank.
        rank_nic: the node number of the NIC every rank uses to leave its host.
        nodes: node names: every host's NICs (``h0.nic0``) then the switches.
        links: the cables between nodes.
        intra_bandwidth, intra_latency: a rank's port inside its host (each way).
        host_bandwidth: all of one host's traffic inside it (None: not limited).
        software: the software costs the file sets (missing ones: the defaults).
        source: the file, if any.
    """
    name: str
    hosts: list[str]
    ranks_per_host: list[int]
    rank_host: list[int]
    rank_nic: list[int]
    nodes: list[str]
    links: list[Link]
    intra_bandwidth: float
    intra_latency: float
    host_bandwidth: float | None
    software: dict[str, float]
    source: str = ""

    @property
    def size(self) -> int:
        return len(self.rank_host)

    def host_numbers(self) -> tuple:
        """``Context.hosts`` for this cluster: every rank's host number (empty for one
        host)."""
        return tuple(self.rank_host) if len(self.hosts) > 1 else ()

    def describe(self) -> str:
        per = sorted(set(self.ranks_per_host))
        return (f"{self.name}: {self.size} ranks on {len(self.hosts)} host{'s' if len(self.hosts) > 1 else ''} "
                f"({'/'.join(map(str, per))} a host), {len(self.links)} links")


# -- quantities ----------------------------------------------------------------------
def bandwidth(value: Any, key: str) -> float:
    """Bytes per second from ``"200 Mbit/s"``, ``"12.5 GB/s"``, ``"100gbit"``."""
    return _quantity(value, key, _BANDWIDTH, "a bandwidth such as \"200 Mbit/s\" or "
                     "\"12.5 GB/s\"", positive=True)


def latency(value: Any, key: str) -> float:
    """Seconds from ``"5 us"``, ``"1.5 ms"``, ``"200 ns"``, ``"0 us"``."""
    return _quantity(value, key, _LATENCY, "a latency such as \"5 us\" or \"1.5 ms\"",
                     positive=False)


def _quantity(value, key, units, what, positive) -> float:
    m = _QUANTITY.match(value) if isinstance(value, str) else None
    unit = m and units.get(m.group(2).lower())
    if unit is None:
        hint = " (a number needs its unit)" if isinstance(value, (int, float)) else ""
        raise TopologyError(f"{key}: {value!r} is not {what}{hint}; units: "
                            f"{', '.join(sorted(units))}")
    out = float(m.group(1)) * unit
    if positive and out <= 0:
        raise TopologyError(f"{key}: {value!r} must be more than zero")
    return out


# -- reading -------------------------------------------------------------------------
def load(path: str | Path) -> Topology:
    """Read and check the topology file ``path``.

    Raises:
        TopologyError: the file is not JSON, or describes no cluster; the message
            names the key and its line.
    """
    text = Path(path).read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise TopologyError(f"{path}: line {e.lineno}: not JSON: {e.msg}") from None
    try:
        return parse(doc, source=str(path))
    except TopologyError as e:
        line = _line_of(text, str(e).split(":", 1)[0])
        raise TopologyError(f"{path}: {'line ' + str(line) + ': ' if line else ''}{e}") \
            from None


def _line_of(text: str, key: str) -> int | None:
    """The line of the last name in ``key`` (``links[2].bandwidth``), searched in
    the order the path names them; None when not found."""
    at = 0
    found = None
    for part in re.findall(r"[A-Za-z_][\w.-]*|\[\d+\]", key):
        if part.startswith("["):
            continue
        i = text.find(f'"{part}"', at)
        if i < 0:
            break
        at, found = i, i
    return None if found is None else text.count("\n", 0, found) + 1


def parse(doc: dict, source: str = "") -> Topology:
    """Check ``doc`` (a topology file's JSON) and build its :class:`Topology`.

    Raises:
        TopologyError: naming the key that is wrong.
    """
    if not isinstance(doc, dict):
        raise TopologyError("top level: a topology is a JSON object")
    _known(doc, ("name", "description", "hosts", "intra_host", "nics", "switches", "links",
                 "fabric", "software", "ranks"), "top level")
    hosts, per_host = _hosts(doc.get("hosts"))
    intra = _section(doc, "intra_host", ("bandwidth", "latency", "host_bandwidth"))
    nics = _section(doc, "nics", ("per_host", "bandwidth", "latency"))
    intra_bw = bandwidth(_need(intra, "bandwidth", "intra_host"), "intra_host.bandwidth")
    intra_lat = latency(intra.get("latency", "0 us"), "intra_host.latency")
    host_bw = (bandwidth(intra["host_bandwidth"], "intra_host.host_bandwidth")
               if "host_bandwidth" in intra else None)
    nper = nics.get("per_host", 1)
    if not isinstance(nper, int) or isinstance(nper, bool) or nper < 1:
        raise TopologyError(f"nics.per_host: {nper!r} must be a whole number of at least 1")
    multi = len(hosts) > 1
    if multi and "nics" not in doc:
        raise TopologyError("nics: several hosts need NICs (\"nics\": {\"bandwidth\": ...})")
    nic_bw = bandwidth(_need(nics, "bandwidth", "nics"), "nics.bandwidth") if multi else 0.0
    nic_lat = latency(nics.get("latency", "0 us"), "nics.latency")
    nodes = [f"{h}.nic{k}" for h in hosts for k in range(nper)]
    if "ranks" in doc and doc["ranks"] != sum(per_host):
        raise TopologyError(f"ranks: {doc['ranks']!r}, but the hosts hold {sum(per_host)} "
                            f"({' + '.join(map(str, per_host[:8]))}"
                            f"{' + ...' if len(per_host) > 8 else ''})")
    builder = _Net(hosts, nper, nodes, nic_bw, nic_lat)
    if "fabric" in doc:
        if "switches" in doc or "links" in doc:
            raise TopologyError("fabric: give a fabric or switches and links, not both")
        _fabric(builder, doc["fabric"])
    else:
        _switches(builder, doc.get("switches", []))
        _links(builder, doc.get("links", []))
    if multi:
        builder.check_connected()
    rank_host = [h for h, n in enumerate(per_host) for _ in range(n)]
    rank_nic = [h * nper + i % nper for h, n in enumerate(per_host) for i in range(n)]
    software = _software(doc.get("software", {}))
    return Topology(str(doc.get("name", Path(source).stem if source else "cluster")), hosts,
                    per_host, rank_host, rank_nic, builder.nodes, builder.links, intra_bw,
                    intra_lat, host_bw, software, source)


def _known(d: dict, keys: tuple, where: str) -> None:
    extra = [k for k in d if k not in keys]
    if extra:
        raise TopologyError(f"{where}.{extra[0]}: unknown key; known here: {', '.join(keys)}"
                            if where != "top level" else
                            f"{extra[0]}: unknown key; known: {', '.join(keys)}")


def _need(d: dict, key: str, where: str):
    if key not in d:
        raise TopologyError(f"{where}.{key}: missing")
    return d[key]


def _section(doc: dict, key: str, keys: tuple) -> dict:
    d = doc.get(key, {})
    if not isinstance(d, dict):
        raise TopologyError(f"{key}: must be an object")
    _known(d, keys, key)
    return d


def _count(value, key: str, least: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise TopologyError(f"{key}: {value!r} must be a whole number of at least {least}")
    return value


def _hosts(spec) -> tuple[list[str], list[int]]:
    if spec is None:
        raise TopologyError("hosts: missing (e.g. \"hosts\": {\"count\": 4, "
                            "\"ranks_per_host\": 1})")
    if isinstance(spec, dict):
        _known(spec, ("count", "ranks_per_host", "prefix"), "hosts")
        n = _count(_need(spec, "count", "hosts"), "hosts.count")
        per = _count(spec.get("ranks_per_host", 1), "hosts.ranks_per_host")
        prefix = str(spec.get("prefix", "h"))
        return [f"{prefix}{i}" for i in range(n)], [per] * n
    if not isinstance(spec, list) or not spec:
        raise TopologyError("hosts: an object {\"count\", \"ranks_per_host\"} or a list of "
                            "{\"name\", \"ranks\"}")
    names, per = [], []
    for i, h in enumerate(spec):
        if not isinstance(h, dict) or "name" not in h:
            raise TopologyError(f"hosts[{i}]: needs a \"name\"")
        _known(h, ("name", "ranks"), f"hosts[{i}]")
        if h["name"] in names:
            raise TopologyError(f"hosts[{i}].name: {h['name']!r} named twice")
        names.append(str(h["name"]))
        per.append(_count(h.get("ranks", 1), f"hosts[{i}].ranks"))
    return names, per


def _software(spec) -> dict[str, float]:
    if not isinstance(spec, dict):
        raise TopologyError("software: must be an object")
    _known(spec, SOFTWARE_KEYS, "software")
    out = {}
    for k, v in spec.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or (
                k.endswith("gbps") and v == 0):
            raise TopologyError(f"software.{k}: {v!r} must be a number "
                                f"{'above' if k.endswith('gbps') else 'of at least'} 0")
        out[k] = float(v)
    return out


class Components:
    """Which nodes cables join (union-find over node numbers)."""

    def __init__(self, nodes):
        self.parent = {x: x for x in nodes}

    def find(self, x: int) -> int:
        """The representative of ``x``'s component."""
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def join(self, a: int, b: int) -> bool:
        """Join ``a``'s and ``b``'s components; False when they were one already (the
        cable closes a loop)."""
        ra, rb = self.find(a), self.find(b)
        self.parent[ra] = rb
        return ra != rb


class _Net:
    """The nodes and cables as they are added, checked as they come."""

    def __init__(self, hosts, nper, nodes, nic_bw, nic_lat):
        self.hosts, self.nper, self.nodes = hosts, nper, list(nodes)
        self.nic_bw, self.nic_lat = nic_bw, nic_lat
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.host_index = {h: i for i, h in enumerate(hosts)}
        self.links: list[Link] = []

    def switch(self, name: str, key: str) -> int:
        if name in self.index or name in self.host_index:
            raise TopologyError(f"{key}: {name!r} is already the name of a "
                                f"{'host' if name in self.host_index else 'switch'}")
        self.index[name] = len(self.nodes)
        self.nodes.append(name)
        return self.index[name]

    def nic(self, host: int, k: int) -> int:
        return host * self.nper + k

    def link(self, a: int, b: int, bw: float, lat: float, key: str) -> None:
        if a == b:
            raise TopologyError(f"{key}: a link from {self.nodes[a]} to itself")
        self.links.append(Link(a, b, bw, lat, key))

    def endpoint(self, name, key: str) -> list[int]:
        """A link's end: a switch, or a host (its NICs)."""
        if isinstance(name, str) and name in self.host_index:
            h = self.host_index[name]
            return [self.nic(h, k) for k in range(self.nper)]
        if isinstance(name, str) and name in self.index and name not in self.host_index:
            return [self.index[name]]
        raise TopologyError(f"{key}: {name!r} is no host or switch")

    def host_list(self, spec, key: str) -> list[int]:
        """Host numbers from ``"h0-h3"``, ``"*"`` or a list of names and ranges."""
        items = spec if isinstance(spec, list) else [spec]
        out: list[int] = []
        for item in items:
            if item == "*":
                out += range(len(self.hosts))
                continue
            m = re.match(r"^(.*?)(\d+)-(?:\1)?(\d+)$", str(item))
            if str(item) in self.host_index:
                out.append(self.host_index[str(item)])
            elif m:
                for i in range(int(m.group(2)), int(m.group(3)) + 1):
                    name = f"{m.group(1)}{i}"
                    if name not in self.host_index:
                        raise TopologyError(f"{key}: {item!r} names {name!r}, no host")
                    out.append(self.host_index[name])
            else:
                raise TopologyError(f"{key}: {item!r} is no host (names, ranges such as "
                                    "\"h0-h3\", or \"*\")")
        return out

    def check_connected(self) -> None:
        """Every NIC reaches every other NIC, and every host has a cable."""
        cabled = {x for ln in self.links for x in (ln.a, ln.b)}
        for h, name in enumerate(self.hosts):
            if not any(self.nic(h, k) in cabled for k in range(self.nper)):
                raise TopologyError(f"switches: host {name} is attached to no switch and "
                                    "no link")
        parts = Components(range(len(self.nodes)))
        for ln in self.links:
            parts.join(ln.a, ln.b)
        nics = range(len(self.hosts) * self.nper)
        root = parts.find(0)
        apart = [n for n in nics if parts.find(n) != root]
        if apart:
            raise TopologyError(f"links: the network is disconnected: {self.nodes[apart[0]]} "
                                f"cannot reach {self.nodes[0]} ({len(apart)} NICs apart)")


def _switches(net: _Net, spec) -> None:
    if not isinstance(spec, list):
        raise TopologyError("switches: a list of {\"name\", \"hosts\", \"nic\"}")
    for i, sw in enumerate(spec):
        key = f"switches[{i}]"
        if not isinstance(sw, dict) or "name" not in sw:
            raise TopologyError(f"{key}: needs a \"name\"")
        _known(sw, ("name", "hosts", "nic", "bandwidth", "latency"), key)
        s = net.switch(str(sw["name"]), f"{key}.name")
        bw = bandwidth(sw["bandwidth"], f"{key}.bandwidth") if "bandwidth" in sw else net.nic_bw
        lat = latency(sw["latency"], f"{key}.latency") if "latency" in sw else net.nic_lat
        nics = range(net.nper)
        if "nic" in sw:
            k = _count(sw["nic"], f"{key}.nic", 0)
            if k >= net.nper:
                raise TopologyError(f"{key}.nic: {k}, but hosts have {net.nper} NICs "
                                    "(nics.per_host)")
            nics = [k]
        for h in net.host_list(sw.get("hosts", []), f"{key}.hosts"):
            for k in nics:
                net.link(net.nic(h, k), s, bw, lat, f"{key}.hosts")


def _links(net: _Net, spec) -> None:
    if not isinstance(spec, list):
        raise TopologyError("links: a list of {\"between\", \"bandwidth\", \"latency\"}")
    for i, ln in enumerate(spec):
        key = f"links[{i}]"
        if not isinstance(ln, dict):
            raise TopologyError(f"{key}: must be an object")
        _known(ln, ("between", "bandwidth", "latency", "count"), key)
        ends = _need(ln, "between", key)
        if not isinstance(ends, list) or len(ends) != 2:
            raise TopologyError(f"{key}.between: two names, e.g. [\"tor0\", \"spine\"]")
        bw = bandwidth(_need(ln, "bandwidth", key), f"{key}.bandwidth")
        lat = latency(ln.get("latency", "0 us"), f"{key}.latency")
        count = _count(ln.get("count", 1), f"{key}.count")
        a = net.endpoint(ends[0], f"{key}.between")
        b = net.endpoint(ends[1], f"{key}.between")
        for x, y in zip(a, b) if len(a) == len(b) else ((x, y) for x in a for y in b):
            for _ in range(count):
                net.link(x, y, bw, lat, key)


def _fabric(net: _Net, spec) -> None:
    """The generated fabrics (docs/simulator.md describes each)."""
    if not isinstance(spec, dict) or spec.get("kind") not in FABRICS:
        raise TopologyError(f"fabric.kind: one of {', '.join(FABRICS)}")
    kind = spec["kind"]
    keys = {"switch": ("kind",),
            "fat_tree": ("kind", "hosts_per_leaf", "spines", "oversubscription", "latency"),
            "rails": ("kind", "spines", "oversubscription", "latency"),
            "ring": ("kind", "bandwidth", "latency"),
            "torus": ("kind", "dims", "bandwidth", "latency")}[kind]
    _known(spec, keys, "fabric")
    nh = len(net.hosts)
    lat = latency(spec.get("latency", "0 us"), "fabric.latency")
    if kind == "switch":
        s = net.switch("switch", "fabric")
        for h in range(nh):
            for k in range(net.nper):
                net.link(net.nic(h, k), s, net.nic_bw, net.nic_lat, "fabric")
    elif kind in ("fat_tree", "rails"):
        spines = _count(spec.get("spines", 1), "fabric.spines")
        over = spec.get("oversubscription", 1)
        if not isinstance(over, (int, float)) or isinstance(over, bool) or over < 1:
            raise TopologyError(f"fabric.oversubscription: {over!r} must be a number of at "
                                "least 1 (down-links' bandwidth / up-links')")
        if kind == "fat_tree":  # leaves of hosts_per_leaf hosts, every NIC on its leaf
            per_leaf = _count(_need(spec, "hosts_per_leaf", "fabric"), "fabric.hosts_per_leaf")
            groups = [[(h, k) for h in range(a, min(a + per_leaf, nh)) for k in range(net.nper)]
                      for a in range(0, nh, per_leaf)]
            name = "leaf"
        else:  # one leaf a NIC index: NIC k of every host on rail k
            groups = [[(h, k) for h in range(nh)] for k in range(net.nper)]
            name = "rail"
        leaves = [net.switch(f"{name}{i}", "fabric") for i in range(len(groups))]
        tops = [net.switch(f"spine{j}", "fabric") for j in range(spines)] \
            if len(groups) > 1 else []
        for leaf, group in zip(leaves, groups):
            for h, k in group:
                net.link(net.nic(h, k), leaf, net.nic_bw, net.nic_lat, "fabric")
            up = len(group) * net.nic_bw / (over * spines)
            for t in tops:
                net.link(leaf, t, up, lat, "fabric")
    else:  # hosts cabled to their neighbours, NIC to NIC
        bw = bandwidth(spec["bandwidth"], "fabric.bandwidth") if "bandwidth" in spec \
            else net.nic_bw
        lat = lat if "latency" in spec else net.nic_lat
        dims = [nh] if kind == "ring" else spec.get("dims")
        if kind == "torus" and (not isinstance(dims, list) or not dims or any(
                not isinstance(d, int) or d < 1 for d in dims)):
            raise TopologyError("fabric.dims: a list of whole numbers, e.g. [4, 4]")
        total = 1
        for d in dims:
            total *= d
        if total != nh:
            raise TopologyError(f"fabric.dims: {dims} hold {total} hosts, the file has {nh}")
        seen = set()
        for h in range(nh):
            coord, rest = [], h
            for d in reversed(dims):
                coord.append(rest % d)
                rest //= d
            coord.reverse()
            for axis, d in enumerate(dims):
                if d < 2:
                    continue
                nxt = list(coord)
                nxt[axis] = (coord[axis] + 1) % d
                g = 0
                for c, dd in zip(nxt, dims):
                    g = g * dd + c
                pair = (min(h, g), max(h, g), axis)
                if pair in seen:  # a dimension of 2: one cable, not two
                    continue
                seen.add(pair)
                for k in range(net.nper):
                    net.link(net.nic(h, k), net.nic(g, k), bw, lat, "fabric")
