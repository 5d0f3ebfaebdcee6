"""Per-link numbers of a run: ping-pong between two ranks over ringcomm's
point-to-point path (``dist.send``/``dist.recv``), for each pair of hosts (their
first ranks) and within each host that has two ranks. Latency is half the round
trip of a small message; bandwidth is a large message's size over half its round
trip. Both benchmarks print them above their tables when the ranks span hosts, so
that a table across hosts can be read against the links it ran on.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

#: (bytes, least round trips, seconds to fill): latency, then bandwidth
SIZES = ((8, 50, 0.1), (4 << 20, 5, 0.3))


def pairs(hosts: list[str]) -> list[tuple[int, int, str]]:
    """(rank a, rank b, label) of each link to measure, given each rank's host: two
    ranks within each host that has them, then the first ranks of each pair of hosts."""
    order: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        order.setdefault(h, []).append(r)
    out = [(rs[0], rs[1], f"within {h}") for h, rs in order.items() if len(rs) > 1]
    names = list(order)
    out += [(order[x][0], order[y][0], f"{x} <-> {y}")
            for i, x in enumerate(names) for y in names[i + 1:]]
    return out


def _ping_pong(rank: int, a: int, b: int, nbytes: int, least: int, fill_s: float,
               group) -> float | None:
    """Seconds per round trip, on rank ``a`` (None on ``b``): warm-up, then at least
    ``least`` trips and until ``fill_s`` seconds passed; ``a`` decides when to stop and
    tells ``b`` in the first byte."""
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    peer = b if rank == a else a
    trips, start = 0, None
    while True:
        if rank == a:
            if trips == 3:
                start = time.perf_counter()
            done = start is not None and trips - 3 >= least and \
                time.perf_counter() - start >= fill_s
            buf[0] = 1 if done else 0
            dist.send(buf, peer, group=group)
            if done:
                return (time.perf_counter() - start) / (trips - 3)
            dist.recv(buf, peer, group=group)
        else:
            dist.recv(buf, peer, group=group)
            if buf[0]:
                return None
            dist.send(buf, peer, group=group)
        trips += 1


def measure(hosts: list[str], rank: int, group=None) -> list[dict]:
    """Every link of :func:`pairs`, over ringcomm group ``group`` (default: the world;
    all its ranks call this): ``{"link", "ranks", "latency_us", "bandwidth_GBps"}``
    each, the same on every rank. The ranks outside a pair wait in a gloo barrier,
    which sleeps: a waiting rank that polled would take the pair's cores when ranks
    outnumber cores."""
    idle = dist.new_group(dist.get_process_group_ranks(group or dist.group.WORLD),
                          backend="gloo")
    found = []
    for a, b, label in pairs(hosts):
        row: dict = {"link": label, "ranks": [a, b]}
        for (nbytes, least, fill_s), key in zip(SIZES, ("latency_us", "bandwidth_GBps")):
            secs = _ping_pong(rank, a, b, nbytes, least, fill_s, group) \
                if rank in (a, b) else None
            got: list = [None] * len(hosts)
            dist.all_gather_object(got, secs, group=idle)
            one_way = next(s for s in got if s is not None) / 2
            row[key] = round(one_way * 1e6, 1) if key == "latency_us" else \
                round(nbytes / one_way / 1e9, 3)
        found.append(row)
    dist.destroy_process_group(idle)
    return found


def text(links: list[dict]) -> str:
    """One header line: ``# links: a <-> b 45.1 us, 1.20 GB/s; ...``."""
    return "# links (ping-pong over ringcomm send/recv; latency 8 B, bandwidth 4 MiB): " + \
        "; ".join(f"{x['link']} {x['latency_us']:.1f} us, {x['bandwidth_GBps']:.2f} GB/s"
                  for x in links)
