"""Time a program on a network: messages as flows that share each link's bandwidth
max-min fairly, in NCCL's order of groups.

The order is the program's (:mod:`ringcomm.sim.program`): a rank's slots run one
after another; entering a slot it runs the slot's local work (reductions at
``reduce_gbps``, copies at ``copy_gbps``), pays the per-step cost, starts the
message sides the slot starts, and leaves the slot when the sides it waits for have
ended (in NCCL's order, :class:`~ringcomm.execution.world.World`'s, a slot starts
and waits for its group; in MPI's, sends and receives start earlier). A message
moves when both its sides have started, after the pair's messages before it. A message that starts at ``s`` waits out its route's
latency (plus the per-message cost), then moves its bytes at the rate max-min
fairness gives it among the messages moving at that moment on any link of its
route (progressive filling: the link whose equal share is smallest fixes the rate
of every message on it, and the rest share what is left), recomputed whenever a
message starts or ends. So two messages on one link take twice as long as one,
and a route is as fast as its busiest link.

Time moves from event to event (a message becomes ready, a message ends), and each
event is handled for every message and rank it concerns at once, as array
operations: a 1,024-rank ring, all ranks in lockstep, is about 4,000 events.

Each rank carries the critical path to its current slot split four ways, the
route latency, the moving of bytes (contention included), local work and
software costs, so that the report can say what the call's time is made of.
"""
from __future__ import annotations

import collections
import dataclasses
import time as _time

import numpy as np

from ringcomm.execution.world import RECV, SEND
from ringcomm.schedule import ScheduleError
from ringcomm.sim.network import Network

#: the critical path's parts, in the order the arrays hold them
PARTS = ("latency", "bandwidth", "local", "software")


@dataclasses.dataclass
class Costs:
    """The software's costs (seconds, bytes per second) and the element size."""
    call: float = 0.0
    step: float = 0.0
    message: float = 0.0
    reduce_bw: float = 1e10
    copy_bw: float = 1e10
    esize: int = 4


@dataclasses.dataclass
class Timing:
    """One simulated call.

    Attributes:
        time: seconds, from the call to the last rank's end.
        finish: when each rank ended.
        critical: the last rank's critical path, seconds per part of :data:`PARTS`.
        link_bytes: bytes that crossed each link of the network.
        events: event times handled.
        messages: messages timed.
        seconds: what the simulation itself took.
    """
    time: float
    finish: np.ndarray
    critical: dict
    link_bytes: np.ndarray
    events: int
    messages: int
    seconds: float


#: the events engine keeps a few flags and its critical path for every message side
#: (about 50 bytes each): at most this many
MAX_SIDES = 20_000_000


class OutOfTime(RuntimeError):
    """The simulation passed its deadline (the message says how far it got)."""


def max_min(hop_flow: np.ndarray, hop_link: np.ndarray, nflows: int,
            capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rates of ``nflows`` flows whose routes are the pairs
    ``(hop_flow[i], hop_link[i])``, on links of ``capacity`` (progressive filling)."""
    rate = np.zeros(nflows)
    if not len(hop_flow):
        return rate
    left = capacity.astype(float, copy=True)
    live = np.ones(len(hop_flow), bool)
    fixed = np.zeros(nflows, bool)
    nl = len(capacity)
    while True:
        cnt = np.bincount(hop_link[live], minlength=nl)
        used = cnt > 0
        share = np.full(nl, np.inf)
        share[used] = left[used] / cnt[used]
        m = share.min()
        if not np.isfinite(m):
            return rate
        now = np.zeros(nflows, bool)
        now[hop_flow[live & (share[hop_link] <= m * (1 + 1e-9))]] = True
        rate[now] = m
        fixed |= now
        taken = live & now[hop_flow]
        left -= np.bincount(hop_link[taken], minlength=nl) * m
        live &= ~taken
        if not live.any():
            return rate


def _repeats(keys: np.ndarray) -> np.ndarray:
    """Whether each key appeared earlier in ``keys``."""
    out = np.zeros(len(keys), bool)
    if len(keys) > 1:
        order = np.argsort(keys, kind="stable")
        sk = keys[order]
        out[order[1:]] = sk[1:] == sk[:-1]
    return out


class _Flows:
    """The messages started and not ended, as growable arrays."""
    FIELDS = (("src", np.int64), ("dst", np.int64), ("rem", float), ("ready", float),
              ("route", np.int64), ("send", np.int64), ("recv", np.int64))

    def __init__(self):
        for name, t in self.FIELDS:
            setattr(self, name, np.zeros(0, t))
        self.crit = np.zeros((0, len(PARTS)))

    def __len__(self) -> int:
        return len(self.src)

    def add(self, **cols) -> None:
        for name, _ in self.FIELDS:
            setattr(self, name, np.concatenate((getattr(self, name), cols[name])))
        self.crit = np.concatenate((self.crit, cols["crit"]))

    def keep(self, mask: np.ndarray) -> None:
        for name, _ in self.FIELDS:
            setattr(self, name, getattr(self, name)[mask])
        self.crit = self.crit[mask]


def run(program, net: Network, costs: Costs, deadline: float | None = None) -> Timing:
    """Time one call of ``program`` (:mod:`ringcomm.sim.program`) on ``net``.

    A rank enters a slot (``program.slot_work``: its local work, then the per-step
    cost), starts the slot's message sides (``slot_posts``), and leaves it when the
    sides it waits for (``slot_waits``) have ended, or at once when they ended before.
    A message moves when both its sides have started.

    Args:
        deadline: a ``time.monotonic()`` reading after which to give up.
    Raises:
        OutOfTime: past ``deadline``.
        ScheduleError: nothing can move while ranks have work left (a schedule that
            deadlocks; the checker names why).
    """
    began = _time.perf_counter()
    p = program.size
    nparts = len(PARTS)
    if program.nsides > MAX_SIDES:
        raise OutOfTime(f"{program.nsides:,} message sides, over the {MAX_SIDES:,} the "
                        "events engine holds (the rounds engine times more)")
    head = np.zeros(p, np.int64)
    last = program.nslots - 1
    post = np.zeros(p)
    crit = np.zeros((p, nparts))  # the critical path to each rank's post
    crit_end = np.zeros((p, nparts))  # ... to the end of its last awaited message
    pend = np.zeros(p, np.int64)
    finish = np.full(p, np.nan)
    started = np.zeros(program.nsides, bool)
    started_at = np.zeros(program.nsides)
    started_crit = np.zeros((program.nsides, nparts))
    ended = np.zeros(program.nsides, bool)
    now_started = np.zeros(program.nsides, bool)
    flows = _Flows()
    queued: dict[int, collections.deque] = {}  # pair -> messages behind the moving one
    route_bytes = np.zeros(0)
    counted = [0, 0]  # events, messages

    def start(ranks: np.ndarray) -> None:
        """Start what ``ranks``' slots start; messages whose both sides started move."""
        nonlocal route_bytes
        ids, own = program.slot_posts(ranks, head[ranks])
        if not len(ids):
            return
        started[ids] = True
        started_at[ids] = post[ranks[own]]
        started_crit[ids] = crit[ranks[own]]
        kind, me, peer, n, partner, _ = program.sides(ids)
        now_started[ids] = True
        keep = (partner >= 0) & started[np.maximum(partner, 0)] & (
            (kind == SEND) | ~now_started[np.maximum(partner, 0)])
        now_started[ids] = False
        if not keep.any():
            return
        ids, kind, me, peer, n, partner = (x[keep] for x in (ids, kind, me, peer, n, partner))
        send = np.where(kind == SEND, ids, partner)
        recv = np.where(kind == SEND, partner, ids)
        src = np.where(kind == SEND, me, peer)
        dst = np.where(kind == SEND, peer, me)
        later = np.where(started_at[send] >= started_at[recv], send, recv)
        routes = net.routes(src, dst)
        lat = net.route_latency[routes]
        fc = started_crit[later]
        fc[:, 0] += lat
        fc[:, 3] += costs.message
        nbytes = n.astype(float) * costs.esize
        if len(route_bytes) < len(net.route_latency):
            route_bytes = np.concatenate((route_bytes,
                                          np.zeros(len(net.route_latency) - len(route_bytes))))
        np.add.at(route_bytes, routes, nbytes)
        ready = started_at[later] + lat + costs.message
        # a pair's messages follow one another (one connection, in issue order): one
        # behind another of its pair moves when that one has ended
        pair = src * p + dst
        busy = np.isin(pair, flows.src * p + flows.dst) | _repeats(pair)
        for i in np.nonzero(busy)[0].tolist():
            queued.setdefault(int(pair[i]), collections.deque()).append(
                dict(src=src[i:i + 1], dst=dst[i:i + 1], rem=nbytes[i:i + 1],
                     ready=ready[i:i + 1], route=routes[i:i + 1], crit=fc[i:i + 1],
                     send=send[i:i + 1], recv=recv[i:i + 1]))
        go = ~busy
        flows.add(src=src[go], dst=dst[go], rem=nbytes[go], ready=ready[go], route=routes[go],
                  crit=fc[go], send=send[go], recv=recv[go])
        counted[1] += len(src)

    def enter(ranks: np.ndarray, at: np.ndarray, c: np.ndarray) -> None:
        """``ranks`` enter their slot ``head`` at times ``at`` with critical paths ``c``;
        those with nothing left to wait for go on at once, slot after slot."""
        while len(ranks):
            slots = head[ranks]
            nwork, red, cop = program.slot_work(ranks, slots)
            local = red * (costs.esize / costs.reduce_bw) + cop * (costs.esize / costs.copy_bw)
            stepc = np.where(nwork > 0, costs.step, 0.0)
            post[ranks] = at + local + stepc
            c = c.copy()
            c[:, 2] += local
            c[:, 3] += stepc
            crit[ranks] = c
            start(ranks)
            ids, own = program.slot_waits(ranks, slots)
            pend[ranks] = np.bincount(own[~ended[ids]], minlength=len(ranks))
            free = pend[ranks] == 0
            ends = free & (slots == last[ranks])
            finish[ranks[ends]] = post[ranks[ends]]
            ranks = ranks[free & ~ends]
            head[ranks] += 1
            at, c = post[ranks], crit[ranks]

    enter(np.arange(p), np.full(p, costs.call), np.tile([0.0, 0.0, 0.0, costs.call], (p, 1)))
    t = 0.0
    prev_routes = None
    rate_active = None
    while len(flows):
        counted[0] += 1
        if deadline is not None and counted[0] % 256 == 0 and _time.monotonic() > deadline:
            raise OutOfTime(f"{counted[1]:,} messages timed, {int(np.isnan(finish).sum())} of "
                            f"{p} ranks not done at {t * 1e6:.1f} us simulated")
        tol = 1e-9 * max(t, 1e-9)
        active = flows.ready <= t + tol
        moving = active & (flows.rem > 0)
        routes = flows.route[moving]
        if prev_routes is None or len(routes) != len(prev_routes) or \
                not np.array_equal(routes, prev_routes):
            hf, hl = net.hops(routes)
            rate_active = max_min(hf, hl, len(routes), net.capacity)
            prev_routes = routes
        rate = np.zeros(len(flows))
        rate[moving] = rate_active
        with np.errstate(divide="ignore", invalid="ignore"):
            fin = np.where(moving, t + flows.rem / rate, np.where(active, t, np.inf))
        waiting = flows.ready[~active]
        t_next = min(fin.min(), waiting.min() if len(waiting) else np.inf)
        flows.rem = np.where(moving, flows.rem - rate * (t_next - t), flows.rem)
        t = t_next
        done = active & (fin <= t + 1e-9 * max(t, 1e-9))
        if not done.any():
            continue
        # the messages that ended: a rank waiting for one of their sides has one fewer
        sides = np.concatenate((flows.send[done], flows.recv[done]))
        fc = flows.crit[done]
        fc[:, 1] += t - flows.ready[done]
        fc = np.concatenate((fc, fc))
        ended_pairs = (flows.src[done] * p + flows.dst[done]).tolist()
        flows.keep(~done)
        for key in ended_pairs:  # the next message of each pair moves now
            line = queued.get(key)
            if line:
                nxt = line.popleft()
                nxt["ready"] = np.maximum(nxt["ready"], t)
                flows.add(**nxt)
                if not line:
                    del queued[key]
        ended[sides] = True
        _, rank, _, _, _, wait_slot = program.sides(sides)
        waited = head[rank] == wait_slot
        rank, fc = rank[waited], fc[waited]
        np.subtract.at(pend, rank, 1)
        crit_end[rank] = fc
        touched = np.unique(rank)
        ready = touched[pend[touched] == 0]
        if len(ready):
            # a rank goes on when it has posted and its last awaited message ended
            late = post[ready] > t
            ends = head[ready] == last[ready]
            at = np.where(late, post[ready], t)
            c = np.where(late[:, None], crit[ready], crit_end[ready])
            finish[ready[ends]] = at[ends]
            crit[ready[ends]] = c[ends]
            go = ~ends
            head[ready[go]] += 1
            enter(ready[go], at[go], c[go])
    if np.isnan(finish).any():
        stuck = np.nonzero(np.isnan(finish))[0]
        raise ScheduleError(f"simulation: {len(stuck)} of {p} ranks never end (rank "
                            f"{int(stuck[0])} waits in its slot {int(head[stuck[0]])}): the "
                            "schedule deadlocks")
    end = int(np.argmax(finish))
    link_bytes = np.bincount(net.route_links,
                             np.repeat(route_bytes, np.diff(net.route_start)),
                             len(net.capacity)) if len(route_bytes) else \
        np.zeros(len(net.capacity))
    return Timing(float(finish[end]), finish, dict(zip(PARTS, crit[end].tolist())),
                  link_bytes, counted[0], counted[1], _time.perf_counter() - began)


class _RoundShape:
    """What a round's offsets fix, whatever its sizes and times: every rank's sends'
    receivers, routes, latencies and max-min rates (all of them moving at once), and
    where each rank's receives are among the sends (row, sender)."""

    def __init__(self, program, net: Network, js, rj, by_offset: dict, ranks):
        p, sk = program.size, program.sk
        offs = sk.offset[js].tolist()
        for d in offs:
            if d not in by_offset:
                by_offset[d] = net.routes(ranks, (ranks + d) % p)
        self.routes = np.stack([by_offset[d] for d in offs])  # (sends, p)
        hf, hl = net.hops(self.routes.ravel())
        self.rate = max_min(hf, hl, self.routes.size, net.capacity).reshape(self.routes.shape)
        self.dst = (ranks[None, :] + sk.offset[js][:, None]) % p
        self.lat = net.route_latency[self.routes]
        self.recv_row = np.searchsorted(js, program.partner[rj])[:, None]
        self.recv_src = (ranks[None, :] + sk.offset[rj][:, None]) % p


def run_rounds(program, net: Network, costs: Costs, deadline: float | None = None) -> Timing:
    """Time a program round by round: a :class:`~ringcomm.sim.program.RotatedProgram`
    by :func:`_rotated_rounds`, a :class:`~ringcomm.sim.program.FullProgram` by
    :func:`_world_rounds`.

    Raises:
        OutOfTime: past ``deadline``.
    """
    if hasattr(program, "rounds"):
        return _world_rounds(program, net, costs, deadline)
    return _rotated_rounds(program, net, costs, deadline)


def _world_rounds(program, net: Network, costs: Costs, deadline: float | None) -> Timing:
    """Time a :class:`~ringcomm.sim.program.FullProgram` by NCCL's rounds of its world
    (:meth:`~ringcomm.sim.program.FullProgram.rounds`): a round's messages share the
    links max-min fairly as if they all moved at once, whenever each starts;
    messages of different rounds do not share. Each rank posts a slot when its
    previous slot's last message ended, as in :func:`run`. A round costs array
    operations over its messages: a pipelined tree of 1,024 ranks is a few hundred
    rounds, where :func:`run` handles an event for nearly every message."""
    began = _time.perf_counter()
    w, p = program.world, program.size
    cur = np.zeros(p, np.int64)  # each rank's slot
    first = program.first
    # each rank's post and the end of its current slot's messages so far, and the
    # critical path to each: latency, local work, software (the rest moved bytes)
    post = np.zeros(p)
    done = np.zeros(p)
    path = np.zeros((3, p))
    done_path = np.zeros((3, p))
    link_bytes = np.zeros(len(net.capacity))
    nmsg = 0

    def enter(ranks: np.ndarray, at: np.ndarray, carried: np.ndarray) -> None:
        g = first[ranks] + cur[ranks]
        local = (program.reduce_elems[g] * (costs.esize / costs.reduce_bw)
                 + program.copy_elems[g] * (costs.esize / costs.copy_bw))
        stepc = np.where(w.s_msg[g + 1] > w.s_msg[g], costs.step, 0.0)
        post[ranks] = at + local + stepc
        done[ranks] = post[ranks]
        path[:, ranks] = carried + np.stack((np.zeros(len(ranks)), local, stepc))
        done_path[:, ranks] = path[:, ranks]

    everyone = np.arange(p)
    enter(everyone, np.full(p, costs.call), np.array([[0.0], [0.0], [costs.call]]))
    for k, (snd, rcv) in enumerate(program.rounds()):
        if deadline is not None and k % 256 == 255 and _time.monotonic() > deadline:
            raise OutOfTime(f"{k} of {len(program.rounds())} rounds timed ({nmsg:,} messages)")
        a, b = w.m_rank[snd], w.m_rank[rcv]
        both = np.unique(np.concatenate((a, b)))
        need = np.concatenate((w.m_slot[snd] - first[a], w.m_slot[rcv] - first[b]))
        want = np.zeros(p, np.int64)
        np.maximum.at(want, np.concatenate((a, b)), need)
        moving = both[want[both] > cur[both]]  # their slot ended in an earlier round
        if len(moving):
            cur[moving] += 1
            enter(moving, done[moving], done_path[:, moving])
        routes = net.routes(a, b)
        hf, hl = net.hops(routes)
        rate = max_min(hf, hl, len(routes), net.capacity)
        nbytes = w.m_n[snd].astype(float) * costs.esize
        np.add.at(link_bytes, hl, nbytes[hf])
        lat = net.route_latency[routes]
        later = np.where(post[a] >= post[b], a, b)
        move = np.divide(nbytes, rate, out=np.zeros(len(rate)), where=nbytes > 0)
        end = post[later] + lat + costs.message + move
        carried = path[:, later] + np.stack((lat, np.zeros(len(lat)),
                                             np.full(len(lat), costs.message)))
        nmsg += len(snd)
        # each rank's slot so far ends with the last of its messages: ascending order,
        # so that the last write of a rank is its latest message
        ends = np.concatenate((end, end))
        who = np.concatenate((a, b))
        order = np.argsort(ends, kind="stable")
        ends, who, carried = ends[order], who[order], np.concatenate((carried, carried),
                                                                     axis=1)[:, order]
        later_than = ends > done[who]
        done[who[later_than]] = ends[later_than]
        done_path[:, who[later_than]] = carried[:, later_than]
    # every rank's last slot: the local work after its last group
    last = program.nslots - 1
    moving = np.nonzero(cur < last)[0]
    cur[moving] = last[moving]
    enter(moving, done[moving], done_path[:, moving])
    end = int(np.argmax(post))
    total = float(post[end])
    lat, local, soft = (float(x) for x in path[:, end])
    crit = {"latency": lat, "bandwidth": max(total - lat - local - soft, 0.0), "local": local,
            "software": soft}
    return Timing(total, post.copy(), crit, link_bytes, len(program.rounds()), nmsg,
                  _time.perf_counter() - began)


def _rotated_rounds(program, net: Network, costs: Costs, deadline: float | None) -> Timing:
    """Time a :class:`~ringcomm.sim.program.RotatedProgram` round by round: round ``k``
    is every rank's slot ``k`` (in a program whose ranks are rotations of one another,
    a message joins the same slot on both ranks). A round's messages share the links
    max-min fairly as if they all moved at once, whenever each starts; messages of
    different rounds do not share. Where the ranks move in lockstep (every rank alike
    on the network) this is :func:`run`'s result; where they drift apart (ranks that
    reach other hosts, next to ranks that do not) it is an approximation, whose
    distance from :func:`run` tests/test_sim.py measures. Each round costs a few array
    operations over the ranks, whatever the network: a 16,384-rank ring's 32,766
    rounds are seconds.

    Raises:
        OutOfTime: past ``deadline``.
    """
    began = _time.perf_counter()
    p, sk = program.size, program.sk
    ranks = np.arange(p)
    post = np.full(p, costs.call)
    # the critical path to each rank's post: its latency per rank; local work and
    # software costs are every path's alike (every rank runs every round's), and the
    # moving of bytes is the rest
    path_lat = np.zeros(p)
    local_sum, soft_sum = 0.0, costs.call
    by_offset: dict[int, np.ndarray] = {}  # offset -> route of every rank's message
    sent: dict[int, float] = {}  # offset -> bytes sent per rank
    shapes: dict[tuple, _RoundShape] = {}  # a round's offsets -> what they fix
    durations: dict[tuple, np.ndarray] = {}
    nmsg = 0
    for k in range(sk.nslots):
        if deadline is not None and k % 256 == 255 and _time.monotonic() > deadline:
            raise OutOfTime(f"{k} of {sk.nslots} rounds timed ({nmsg:,} messages), "
                            f"{post.max() * 1e6:.1f} us simulated")
        a, b = int(program.start[k]), int(program.start[k + 1])
        local = (sk.reduce_elems[k] * costs.esize / costs.reduce_bw
                 + sk.copy_elems[k] * costs.esize / costs.copy_bw)
        stepc = costs.step if b > a else 0.0
        post = post + (local + stepc)
        local_sum += local
        soft_sum += stepc
        if b == a:
            break
        soft_sum += costs.message
        js = a + np.nonzero(sk.kind[a:b] == SEND)[0]
        rj = a + np.nonzero(sk.kind[a:b] == RECV)[0]
        key = (tuple(sk.offset[js].tolist()), tuple(sk.offset[rj].tolist()),
               tuple((program.partner[rj] - a).tolist()))
        sh = shapes.get(key)
        if sh is None:
            sh = shapes[key] = _RoundShape(program, net, js, rj, by_offset, ranks)
        sizes = tuple(sk.n[js].tolist())
        for d, n in zip(key[0], sizes):
            sent[d] = sent.get(d, 0.0) + n * costs.esize
        nmsg += sh.routes.size
        dur = durations.get((key, sizes))
        if dur is None:
            nbytes = np.asarray(sizes, float)[:, None] * costs.esize
            move = np.divide(nbytes, sh.rate, out=np.zeros(sh.rate.shape), where=nbytes > 0)
            dur = durations[(key, sizes)] = sh.lat + costs.message + move
        pd = post[sh.dst]
        mine = post >= pd  # the sender posted last: the message waited for it
        end = np.maximum(post, pd) + dur
        lat_end = np.where(mine, path_lat, path_lat[sh.dst]) + sh.lat
        # every rank's slot ends with the last of its sends and of the sends it receives
        post, path_lat = end[0], lat_end[0]
        for i in range(1, len(end)):
            later = end[i] > post
            post, path_lat = np.where(later, end[i], post), np.where(later, lat_end[i], path_lat)
        for i in range(len(sh.recv_row)):
            e = end[sh.recv_row[i, 0], sh.recv_src[i]]
            later = e > post
            post = np.where(later, e, post)
            path_lat = np.where(later, lat_end[sh.recv_row[i, 0], sh.recv_src[i]], path_lat)
    link_bytes = np.zeros(len(net.capacity))
    for d, routes in by_offset.items():
        hf, hl = net.hops(routes)
        link_bytes += np.bincount(hl, minlength=len(net.capacity)) * sent.get(d, 0.0)
    end = int(np.argmax(post))
    total = float(post[end])
    crit = {"latency": float(path_lat[end]),
            "bandwidth": max(total - float(path_lat[end]) - local_sum - soft_sum, 0.0),
            "local": local_sum, "software": soft_sum}
    return Timing(total, post, crit, link_bytes, sk.nslots, nmsg,
                  _time.perf_counter() - began)


__all__ = ["Costs", "Timing", "OutOfTime", "PARTS", "run", "run_rounds", "max_min", "RECV",
           "SEND"]
