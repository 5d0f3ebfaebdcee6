"""A :class:`~ringcomm.sim.topology.Topology` as directed links with capacities and
latencies, and the route of every message over them.

Links, numbered: each cable's two directions (``2i``: a to b, ``2i + 1``: b to a),
then every rank's port out of and into its host's fabric, then (when the file
sets ``intra_host.host_bandwidth``) every host's own fabric. A message between two
ranks of one host crosses the sender's out-port and the receiver's in-port (and
the host's fabric); a message between hosts leaves by the sender's NIC, follows a
shortest path (fewest cables) to the receiver's NIC, and spreads over equal paths
by a hash of the two ranks, as a fabric's ECMP does. Routes are made on first use
and kept; :meth:`Network.routes` looks up many at once.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from ringcomm.execution.world import expand_ranges
from ringcomm.sim.topology import Topology


def _mix(x: int) -> int:
    """A 64-bit integer hash (splitmix64's finaliser)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class Network:
    """Directed links and routes.

    Attributes:
        capacity: bytes per second of every link.
        latency: seconds of every link.
        names: what every link is, for the report (``h0.nic0 -> leaf0``).
    """

    def __init__(self, topo: Topology):
        self.topo = t = topo
        p, nc = t.size, len(t.links)
        self.out_port = 2 * nc + np.arange(p)
        self.in_port = 2 * nc + p + np.arange(p)
        cap = [x for ln in t.links for x in (ln.bandwidth, ln.bandwidth)]
        lat = [x for ln in t.links for x in (ln.latency, ln.latency)]
        names = [x for ln in t.links for x in (f"{t.nodes[ln.a]} -> {t.nodes[ln.b]}",
                                               f"{t.nodes[ln.b]} -> {t.nodes[ln.a]}")]
        cap += [t.intra_bandwidth] * (2 * p)
        lat += [t.intra_latency] * p + [0.0] * p
        names += [f"rank {r} out ({t.hosts[t.rank_host[r]]})" for r in range(p)]
        names += [f"rank {r} in ({t.hosts[t.rank_host[r]]})" for r in range(p)]
        self.host_link = None
        if t.host_bandwidth is not None:
            self.host_link = 2 * nc + 2 * p + np.arange(len(t.hosts))
            cap += [t.host_bandwidth] * len(t.hosts)
            lat += [0.0] * len(t.hosts)
            names += [f"{h} fabric" for h in t.hosts]
        self.capacity = np.asarray(cap, float)
        self.latency = np.asarray(lat, float)
        self.names = names
        self._adj: list[list[tuple[int, int]]] = [[] for _ in t.nodes]
        for i, ln in enumerate(t.links):
            self._adj[ln.a].append((ln.b, 2 * i))
            self._adj[ln.b].append((ln.a, 2 * i + 1))
        self._dist: dict[int, list[int]] = {}
        self._host = np.asarray(t.rank_host, np.int64)
        # the routes made so far: sorted pair keys, and per key its route number
        self._keys = np.zeros(0, np.int64)
        self._ids = np.zeros(0, np.int64)
        self._links: list[list[int]] = []
        self.route_start = np.zeros(1, np.int64)
        self.route_links = np.zeros(0, np.int64)
        self.route_latency = np.zeros(0, float)

    # -- one route -----------------------------------------------------------------------
    def _distances(self, dst: int) -> list[int]:
        """Cables from every node to ``dst`` (breadth first; a node with one
        neighbour reuses that neighbour's)."""
        got = self._dist.get(dst)
        if got is not None:
            return got
        nbrs = {v for v, _ in self._adj[dst]}
        if len(nbrs) == 1 and len({v for v, _ in self._adj[next(iter(nbrs))]}) > 1:
            d = [x + 1 for x in self._distances(next(iter(nbrs)))]
            d[dst] = 0
        else:
            d = [-1] * len(self._adj)
            d[dst] = 0
            queue = deque([dst])
            while queue:
                u = queue.popleft()
                for v, _ in self._adj[u]:
                    if d[v] < 0:
                        d[v] = d[u] + 1
                        queue.append(v)
        self._dist[dst] = d
        return d

    def route(self, src: int, dst: int) -> list[int]:
        """The links a message from rank ``src`` to rank ``dst`` crosses."""
        t = self.topo
        if t.rank_host[src] == t.rank_host[dst]:
            out = [int(self.out_port[src]), int(self.in_port[dst])]
            if self.host_link is not None:
                out.append(int(self.host_link[t.rank_host[src]]))
            return out
        a, b = t.rank_nic[src], t.rank_nic[dst]
        d = self._distances(b)
        h = _mix(src * 1_000_003 + dst)
        links, u, hop = [], a, 0
        while u != b:
            nxt = [(v, lid) for v, lid in self._adj[u] if d[v] == d[u] - 1]
            v, lid = nxt[_mix(h + hop) % len(nxt)] if len(nxt) > 1 else nxt[0]
            links.append(lid)
            u, hop = v, hop + 1
        return links

    # -- many at once ---------------------------------------------------------------------
    def routes(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The route numbers of messages ``src[i] -> dst[i]`` (made on first use):
        index :attr:`route_start`, :attr:`route_links` and :attr:`route_latency`."""
        keys = src.astype(np.int64) * self.topo.size + dst
        pos = np.searchsorted(self._keys, keys)
        posc = np.minimum(pos, max(len(self._keys) - 1, 0))
        hit = (pos < len(self._keys)) & (self._keys[posc] == keys) if len(self._keys) else \
            np.zeros(len(keys), bool)
        if not hit.all():
            self._add(np.unique(keys[~hit]))
            return self.routes(src, dst)
        return self._ids[posc]

    def _add(self, keys: np.ndarray) -> None:
        p = self.topo.size
        first = len(self._links)
        for k in keys.tolist():
            self._links.append(self.route(k // p, k % p))
        new = self._links[first:]
        lens = np.array([len(x) for x in new], np.int64)
        flat = np.array([x for r in new for x in r], np.int64)
        self.route_start = np.concatenate((self.route_start, self.route_start[-1]
                                           + np.cumsum(lens)))
        self.route_links = np.concatenate((self.route_links, flat))
        starts = self.route_start[first:-1]
        lat = np.add.reduceat(self.latency[flat], starts - starts[0]) if len(flat) else \
            np.zeros(len(new))
        lat[lens == 0] = 0.0
        self.route_latency = np.concatenate((self.route_latency, lat))
        allk = np.concatenate((self._keys, keys))
        alli = np.concatenate((self._ids, np.arange(first, first + len(keys))))
        order = np.argsort(allk, kind="stable")
        self._keys, self._ids = allk[order], alli[order]

    def hops(self, routes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(position in routes, link)`` of every link of ``routes``."""
        a, b = self.route_start[routes], self.route_start[routes + 1]
        return np.repeat(np.arange(len(routes)), b - a), self.route_links[expand_ranges(a, b)]
