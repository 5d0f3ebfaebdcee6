"""Executors: run a schedule (:mod:`ringcomm.schedule`) on a transport.

A :class:`ringcomm.execution.plan.Plan` is a schedule compiled once per call
shape (regions numbered, dependencies worked out). A *program* is a plan
prepared for one link and reduce op, with its scratch; for each set of
caller buffer addresses it keeps a *binding*: the step lists with every
message made ready to issue, so a repeated call does only the messages and the
local work. Three kinds:

* :class:`P2PProgram`, over a :class:`ringcomm.transport.Transport` (MPI for
  CPU tensors, in-process threads for tests). Messages are persistent requests
  and the local work's operands are arrays over the regions' addresses (both
  made once per binding, neither holding the caller's tensors), so a step's
  sends may go out, and its receives be posted, before earlier steps finished, as long as no data they touch is still
  in use: a segment reduced in step s is forwarded at once while later segments
  are still arriving. Sends and receives keep schedule order, so messages
  between a pair still match step by step.
* :class:`GroupProgram`, over an NCCL-like communicator (:class:`GroupComm`):
  each step is one group (group start, its sends and receives, group end), its
  local work follows on the same stream. This is the only order NCCL allows;
  :mod:`ringcomm.execution.simulator` provides a communicator that enforces NCCL's rules
  on CPU tensors, the CUDA transport the real one.
* :class:`NativeProgram`: the transport library's own collective (``native``).
"""
from __future__ import annotations

import collections
import weakref
from typing import Any, Protocol, Sequence

import torch

from ringcomm import ops, trace
from ringcomm.mismatch import CollectiveMismatch, mismatch
from ringcomm.execution.plan import COPY, REDUCE_SRC_FIRST, Plan

#: bindings (sets of caller buffer addresses) a program keeps; the oldest made is
#: dropped first (a run does not refresh its binding: a loop over more buffers than
#: this makes new ones in turn)
BINDINGS = 4
#: A schedule's message tag, from its top bit down: the call's signature (a hash of
#: what the call is: collective, algorithm, sizes, root, dtype, reduce op), the
#: group's epoch, and the message's number among those it exchanges with that peer in
#: that direction. Each field is cut to these many bits, the signature taking what the
#: transport's tag range leaves (MPICH's 2^30: 10 bits; MPI's smallest, 2^15: none),
#: so messages of two different calls, or of two epochs, rarely match, and a rank
#: that waits can tell its peer runs another call (:class:`TagLayout`).
NUMBER_BITS, EPOCH_BITS, SIGNATURE_BITS = 14, 6, 16


class TagLayout:
    """The fields of a transport's tags (see :data:`NUMBER_BITS`)."""

    __slots__ = ("number_bits", "epoch_bits", "signature_bits")

    def __init__(self, limit: int):
        bits = max(limit, 1).bit_length() - 1  # 2**bits <= limit
        self.number_bits = min(NUMBER_BITS, bits)
        self.epoch_bits = min(EPOCH_BITS, bits - self.number_bits)
        self.signature_bits = min(SIGNATURE_BITS, bits - self.number_bits - self.epoch_bits)

    def base(self, signature: int, epoch: int) -> int:
        """The tag of a call's first message to a peer (the k-th adds k modulo the
        number field)."""
        sig = signature & ((1 << self.signature_bits) - 1)
        ep = epoch & ((1 << self.epoch_bits) - 1)
        return ((sig << self.epoch_bits) | ep) << self.number_bits

    def split(self, tag: int) -> tuple[int, int, int]:
        """``(signature, epoch, number)`` of a tag."""
        n = tag & ((1 << self.number_bits) - 1)
        rest = tag >> self.number_bits
        return rest >> self.epoch_bits, rest & ((1 << self.epoch_bits) - 1), n


def _owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor a caller's buffer stands for: its base when it is a view (a flat
    ``view(-1)`` made at every call of a 2-D tensor), so kept slices still match.
    A buffer is at a fixed address with the program's fixed size: the same owner
    and address mean the same memory."""
    base = t._base
    return t if base is None else base


def _key(bufs: Sequence[torch.Tensor | None]) -> Any:
    """The binding key of the caller's buffers: their addresses."""
    if len(bufs) == 1:
        return bufs[0].data_ptr()
    return tuple(0 if b is None else b.data_ptr() for b in bufs)


class _Program:
    """What every program shares: the plan, its scratch and the bindings."""

    def __init__(self, plan: Plan, scratch: Sequence[torch.Tensor]):
        self.plan = plan
        self.scratch = list(scratch)  # held: persistent requests point into it
        self._bindings: collections.OrderedDict = collections.OrderedDict()

    def _views(self, bufs: Sequence, regions: list) -> list:
        """A view of every region (``regions``: the plan's, unpacked), to bind
        messages."""
        full = [*bufs, *self.scratch]
        return [full[buf] if whole else full[buf][a:e] for buf, a, e, whole in regions]

    def _binding(self, bufs: Sequence) -> Any:
        key = _key(bufs)
        bd = self._bindings.get(key)
        if bd is None:
            bd = self._bind(bufs)
            if len(self._bindings) >= BINDINGS:
                self._release(self._bindings.popitem(last=False)[1])
            self._bindings[key] = bd
        return key, bd

    def _bind(self, bufs: Sequence) -> Any:
        raise NotImplementedError

    def _release(self, bd: Any) -> None:
        """Free a binding's resources (it is not running)."""

    def _drop(self, key: Any, bd: Any, bufs: Sequence) -> None:
        """A run failed: the binding cannot be reused."""
        self._bindings.pop(key, None)

    def close(self) -> None:
        """Release every binding."""
        while self._bindings:
            self._release(self._bindings.popitem()[1])


class P2PProgram(_Program):
    """A plan on a point-to-point transport, for one reduce op.

    Args:
        plan: the compiled schedule.
        tp: the transport.
        scratch: the schedule's scratch buffers (held by the program).
        op: the reduce op (None for collectives that do not reduce).
        epoch: the group's epoch (see :data:`NUMBER_BITS`).
        signature: ``(hash, text)`` of what the call is, the same on every rank
            that makes the same call (the hash goes into the tags).
        names: ``names(part, bits) -> text | None``: the call this rank made whose
            hash ends in the ``bits`` bits ``part``, to name a peer's call in a
            mismatch.
    """

    def __init__(self, plan: Plan, tp, scratch: Sequence[torch.Tensor], op, epoch: int = 0,
                 signature: tuple[int, str] = (0, "this call"), names=None):
        super().__init__(plan, scratch)
        self.tp = tp
        self.op = op
        self.signature, self.epoch, self._names = signature, epoch, names
        self._layout: TagLayout | None = None  # the transport's, at the first binding

    def _bind(self, bufs: Sequence) -> tuple:
        """Persistent requests for every message, and per step the batches to start
        and wait for, in the order :class:`Plan` worked out."""
        plan = self.plan.unpack()  # the plan as tuples, for this binding only
        views = self._views(bufs, plan.regions)
        lay = self._layout = TagLayout(self.tp.tag_limit)
        self.tp.number_bits = lay.number_bits  # a transport with two paths tells messages apart
        # the messages go through the transport that carries them all (a wrapper's
        # inner one where the wrapper would only pass them on)
        tp = self.tp.carrier([(peer, views[v].nbytes)
                              for peer, v in (*plan.send_list, *plan.recv_list)])
        base, span = lay.base(self.signature[0], self.epoch), 1 << lay.number_bits
        counts: dict = collections.defaultdict(int)

        def tag(kind: str, peer: int) -> int:
            k = counts[kind, peer]
            counts[kind, peer] = k + 1
            return base + k % span

        # first: it may refuse the binding
        work_of, held_of = self._local_work(bufs, tp, plan.regions)
        work = [[work_of(*w) for w in local] for *_, local in plan.p2p_steps]
        sreq = [tp.send_init(views[v], peer, tag("s", peer)) for peer, v in plan.send_list]
        # a receive whose data only one local step reads stays where the sender put it,
        # on a transport that can leave it there (shared memory): that step reads it
        # from the sender's memory instead of a copy in scratch
        held = self.plan.held_receives(plan) if tp.holds_receives else {}
        rreq = []
        for j, (peer, v) in enumerate(plan.recv_list):
            t = tag("r", peer)
            h = tp.recv_held_init(views[v], peer, t) if j in held else None
            if h is None:
                h = tp.recv_init(views[v], peer, t)
            else:
                i, li = held[j]
                kind, d, _ = plan.p2p_steps[i][4][li]
                work[i][li] = held_of(kind, d, h)
            rreq.append(h)
        batch, rw = tp.batch, plan.recv_waits
        steps, ns, nr = [], 0, 0
        for i, (send_upto, recv_upto, mine, send_waits, _) in enumerate(plan.p2p_steps):
            actions: list = []
            # receives that wait for no send go first: posted before the matching send
            # arrives, a message skips MPI's unexpected queue
            first = []
            while nr < recv_upto and not rw[nr]:
                first.append(rreq[nr])
                nr += 1
            starts = first + sreq[ns:send_upto]
            ns = max(ns, send_upto)
            if starts:
                actions.append((False, batch(starts)))
            while nr < recv_upto:
                if rw[nr]:
                    actions.append((True, batch([sreq[k] for k in rw[nr]])))
                group = [rreq[nr]]
                nr += 1
                while nr < recv_upto and not rw[nr]:
                    group.append(rreq[nr])
                    nr += 1
                actions.append((False, batch(group)))
            waits = [rreq[j] for j in mine] + [sreq[k] for k in send_waits]
            if waits:
                actions.append((True, batch(waits)))
            steps.append((actions, work[i]))
        tail = [sreq[k] for k in plan.tail_sends]
        if tail:
            steps.append(([(True, batch(tail))], []))
        return steps, sreq + rreq, tp

    def _local_work(self, bufs: Sequence, tp, regions: list):
        """``work_of(kind, dst, src)``: one local step (a :data:`plan.COPY
        <ringcomm.execution.plan.COPY>` or one of the reduces) bound to the memory of
        this binding's regions (numbers of ``regions``, the plan's), as ``(fn, dst, src)``
        for ``fn(dst, src)``: operands over raw addresses (:func:`ringcomm.ops.memory`),
        made once, holding no reference to the caller's tensors; and
        ``held_of(kind, dst, handle)``: the same step reading held receive
        ``handle`` where it lies (``recv_held_init`` of transport ``tp``)."""
        full = [*bufs, *self.scratch]
        reducers: dict = {}

        def mem(v: int) -> tuple:
            # checked here, once per binding: raw memory has no bounds of its own, and
            # an unchecked schedule's region past its buffer would write past it
            buf, a, e, _ = regions[v]
            t = full[buf]
            if t is not None and t.device.type != "cpu":
                raise ValueError(f"ringcomm: the point-to-point executor works on CPU "
                                 f"memory; buffer {buf} is on {t.device}")
            if t is None or not 0 <= a <= e <= t.numel():
                raise ValueError(f"ringcomm: local work on elements [{a}, {e}) of buffer "
                                 f"{buf}, which has "
                                 f"{'none' if t is None else t.numel()}: a malformed schedule")
            size = t.element_size()
            if e > a and not t.data_ptr():
                raise ValueError(f"ringcomm: buffer {buf} has {t.numel()} elements but no "
                                 "memory (its storage was freed or resized to 0)")
            return ops.memory(t.data_ptr() + a * size, (e - a) * size), t.dtype

        def work_of(kind: int, d: int, s: int) -> tuple:
            (dm, dtype), (sm, sdtype) = mem(d), mem(s)
            if dm.size != sm.size or dtype != sdtype:
                raise ValueError(f"ringcomm: local work between regions of {dm.size} and "
                                 f"{sm.size} bytes ({dtype}, {sdtype}): a malformed schedule")
            if kind == COPY:
                return ops.serial_copy, dm, sm
            return reducer(dtype, kind), ops.operand(dm, dtype), ops.operand(sm, dtype)

        def reducer(dtype: torch.dtype, kind: int):
            fn = reducers.get((dtype, kind))
            if fn is None:
                fn = reducers[dtype, kind] = ops.serial_reducer(
                    self.op, dtype, src_first=kind == REDUCE_SRC_FIRST)
            return fn

        def held_of(kind: int, d: int, handle: Any) -> tuple:
            dm, dtype = mem(d)
            return tp.held_work(handle, dm, dtype, None if kind == COPY else reducer(dtype, kind))
        return work_of, held_of

    def _release(self, bd: tuple) -> None:
        _, requests, tp = bd
        tp.free(requests)

    def _drop(self, key: Any, bd: tuple, bufs: Sequence) -> None:
        super()._drop(key, bd, bufs)
        _, requests, tp = bd
        tp.abandon(requests, keep=list(bufs))

    def run(self, bufs: Sequence[torch.Tensor | None]) -> None:
        """One collective on the caller's 1-D buffers (``ringcomm.schedule.BUFFERS``'
        order); waits honour the transport's deadline."""
        key = bufs[0].data_ptr() if len(bufs) == 1 else _key(bufs)
        bd = self._bindings.get(key)
        if bd is None:
            key, bd = self._binding(bufs)
        # one loop with the trace's test per step: a second loop without it saved
        # 0.00-0.04 us a call of one step (scripts/bench_copies.py,
        # docs/data/hot_path_copies.json)
        plan = self.plan
        steps, _, tp = bd
        start, wait = tp.start, tp.wait
        traced = trace.active()
        if traced:
            trace.annotate(peers=plan.peers, steps=plan.nsteps)
            t0, k = trace.now(), 0
        try:
            for actions, work in steps:
                for is_wait, b in actions:
                    if is_wait:
                        wait(b)
                    else:
                        start(b)
                for fn, d, s in work:
                    fn(d, s)
                if traced and k < plan.nsteps:
                    t0, k = plan.trace_step(k, t0), k + 1
        except BaseException as e:
            raise self._failed(key, bd, bufs, e)

    def _failed(self, key: Any, bd: tuple, bufs: Sequence, e: BaseException) -> BaseException:
        """A run failed: its binding dropped; the error to raise (a message of another
        call named as a collective mismatch)."""
        self._drop(key, bd, bufs)
        if isinstance(e, getattr(self.tp, "Mismatch", ())):
            err = self._mismatch(e)
            err.__cause__ = e
            return err
        if isinstance(e, getattr(self.tp, "PeerFailed", ())) and str(e).startswith(
                "collective mismatch"):  # another rank's report: add this rank's side
            err = type(e)(f"{e}; rank {self.tp.rank} runs {self.signature[1]}")
            err.__cause__ = e
            return err
        return e

    def _mismatch(self, e: Any) -> CollectiveMismatch:
        """The error of a call whose peer runs another: what each runs, as far as
        this rank can tell from the peer's tag, or from its call's whole signature
        where the transport read one (``e.signature``)."""
        lay, me = self._layout, self.tp.rank
        names = self._names
        if e.signature is not None:  # a shared-memory window: the whole signature
            return mismatch(me, self.signature[1], e.peer,
                            names(e.signature, 32) if names is not None else None)
        sig, epoch, _ = lay.split(e.found)
        mine_sig, mine_epoch, _ = lay.split(e.expected)
        if epoch != mine_epoch:
            theirs = ("a call of another epoch (a call before it was refused on some "
                      "ranks only: bad input there)")
        elif sig == mine_sig:
            theirs = "the same call with its messages in another order"
        else:
            name = (names(sig, lay.signature_bits)
                    if names is not None and lay.signature_bits else None)
            theirs = f"{name} (as far as its message tags tell)" if name else None
        return mismatch(me, self.signature[1], e.peer, theirs)


class GroupComm(Protocol):
    """The NCCL-like interface :class:`GroupProgram` drives. Every call only enqueues
    work on the communicator's stream; completion is the caller's business.

    A communicator may also have ``message(kind, buf, peer) -> (fn, args) | None``:
    the call that issues a send or receive of ``buf`` (``kind`` ``"send"`` or
    ``"recv"``), worked out once per binding; None: nothing to issue (an empty
    message). Without it, ``send``/``recv`` are called with the buffer.
    """

    def group_start(self) -> None: ...

    def group_end(self, label: str = "") -> None: ...

    def close_groups(self) -> None:
        """Close the groups that an exception left open (NCCL's depth is per thread:
        an open one would swallow every later call of the thread)."""

    def send(self, buf: torch.Tensor, peer: int) -> None: ...

    def recv(self, buf: torch.Tensor, peer: int) -> None: ...

    def local_reduce(self, dst: torch.Tensor, src: torch.Tensor, op,
                     src_first: bool = False) -> None: ...

    def local_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...


#: how GroupProgram finds a region's tensor for local work (its recipe's first field):
#: a caller's buffer whole, a slice of a caller's buffer, a scratch tensor (fixed)
_WHOLE, _SLICED, _SCRATCH = 0, 1, 2


class GroupProgram(_Program):
    """A plan on an NCCL-like communicator: one group per step, local work after it."""

    def __init__(self, plan: Plan, comm: GroupComm, scratch: Sequence[torch.Tensor], op):
        super().__init__(plan, scratch)
        nbuf = plan.nbuffers
        u = plan.unpack()
        # the regions local work touches, numbered in the order of the steps' lists;
        # scratch ones are sliced once, caller ones when the caller's tensors change
        # (see _local_views)
        used = sorted({v for _, _, local in u.steps for _, d, s in local for v in (d, s)})
        self._lpos = {v: i for i, v in enumerate(used)}
        self._recipe = []
        for v in self._lpos:
            buf, a, e, whole = u.regions[v]
            if buf >= nbuf:
                t = self.scratch[buf - nbuf]
                self._recipe.append((_SCRATCH, t if whole else t[a:e], a, e))
            else:
                self._recipe.append((_WHOLE if whole else _SLICED, buf, a, e))
        self._static = all(k == _SCRATCH for k, *_ in self._recipe)
        self._fixed = [x[1] for x in self._recipe] if self._static else None
        # the common small case: caller buffers whole (no slicing) next to scratch
        self._whole = (None if self._static or any(k == _SLICED for k, *_ in self._recipe)
                       else ([x if k == _SCRATCH else None for k, x, _, _ in self._recipe],
                             [(i, x) for i, (k, x, _, _) in enumerate(self._recipe)
                              if k == _WHOLE]))
        # otherwise caller buffers are sliced: the last call's slices are kept while the
        # caller's tensors, or the tensors they are views of, live (weak references to
        # them: a slice held after they are gone would keep their memory), so DDP's
        # buckets, FSDP's flat parameters and any tensor passed again are sliced once
        self._callers = sorted({x for k, x, _, _ in self._recipe if k != _SCRATCH})
        self._sliced: tuple | None = None
        me = weakref.ref(self)

        def forget(ref: weakref.ref) -> None:
            program = me()
            last = program._sliced if program is not None else None
            if last is not None and any(r is ref for r, _ in last[0]):
                program._sliced = None

        self._forget = forget

        self.comm = comm
        self.op = op
        self._labels = [f"step {i}" for i in range(plan.nsteps)]
        # a communicator whose local work is plain torch ops on the current stream (the
        # CUDA transport) gets them called directly; a simulator gets its own methods
        # (copy, reduce, reduce with the source first): indexed by plan.COPY and the rest
        if getattr(comm, "local_work_inline", False):
            self._local = (torch.Tensor.copy_, *((ops.reducer(op), ops.reducer(op, True))
                                                 if op is not None else (None, None)))
        else:
            self._local = (comm.local_copy, lambda d, s: comm.local_reduce(d, s, op),
                           lambda d, s: comm.local_reduce(d, s, op, src_first=True))

    def _local_views(self, bufs: Sequence) -> list:
        if self._static:
            return self._fixed  # type: ignore[return-value]
        if self._whole is not None:
            out, callers = self._whole
            out = out.copy()
            for i, b in callers:
                out[i] = bufs[b]
            return out
        last = self._sliced
        if last is not None:
            for (ref, ptr), b in zip(last[0], self._callers):
                t = bufs[b]
                if ref() is not _owner(t) or t.data_ptr() != ptr:
                    break
            else:
                return last[1]
        # views of detached tensors, whole buffers too: a view keeps its base tensor
        # alive, and a kept caller tensor would never die
        out = [x if kind == _SCRATCH else bufs[x].detach()[a:e]
               for kind, x, a, e in self._recipe]
        forget = self._forget
        self._sliced = ([(weakref.ref(_owner(bufs[b]), forget), bufs[b].data_ptr())
                         for b in self._callers], out)
        return out

    def _bind(self, bufs: Sequence) -> list:
        u = self.plan.unpack()
        comm, views, lpos = self.comm, self._views(bufs, u.regions), self._lpos
        message = getattr(comm, "message", None)
        steps = []
        for i, (sends, recvs, local) in enumerate(u.steps):
            msgs = []
            for kind, xfers in (("send", sends), ("recv", recvs)):
                for peer, v in xfers:
                    if message is not None:
                        m = message(kind, views[v], peer)
                        if m is not None:
                            msgs.append(m)
                    else:
                        msgs.append((comm.send if kind == "send" else comm.recv,
                                     (views[v], peer)))
            local_fn = self._local
            steps.append((bool(sends or recvs), msgs,
                          [(local_fn[kind], lpos[d], lpos[s]) for kind, d, s in local],
                          self._labels[i]))
        if trace.active():
            return steps
        # untraced runs take one flat list: None marks local work on the views
        start, end, flat = comm.group_start, comm.group_end, []
        for grouped, msgs, work, label in steps:
            if grouped:
                flat.append((start, ()))
                flat.extend(msgs)
                flat.append((end, (label,)))
            flat.extend((None, w) for w in work)
        return flat

    def run(self, bufs: Sequence[torch.Tensor | None]) -> None:
        """Enqueue one collective on the caller's 1-D buffers."""
        key = bufs[0].data_ptr() if len(bufs) == 1 else _key(bufs)
        ops_ = self._bindings.get(key)
        if ops_ is None or trace.active():
            return self._run_traced(bufs)
        lv = self._local_views(bufs)
        try:
            for fn, args in ops_:
                if fn is None:
                    f, d, s = args
                    f(lv[d], lv[s])
                else:
                    fn(*args)
        except BaseException:
            self.comm.close_groups()
            raise

    def _run_traced(self, bufs: Sequence) -> None:
        """:meth:`run` on a first binding or with the trace on (each step recorded)."""
        self._bindings.pop(_key(bufs), None)
        key, steps = self._binding(bufs)
        if not trace.active():
            return self.run(bufs)
        lv = self._local_views(bufs)
        comm = self.comm
        trace.annotate(peers=self.plan.peers, steps=self.plan.nsteps)
        t0 = trace.now()
        try:
            for i, (grouped, msgs, work, label) in enumerate(steps):
                if grouped:
                    comm.group_start()
                    for fn, args in msgs:
                        fn(*args)
                    comm.group_end(label)
                for fn, d, s in work:
                    fn(lv[d], lv[s])
                t0 = self.plan.trace_step(i, t0)  # the time to enqueue the step
        except BaseException:
            comm.close_groups()
            raise
        self._bindings.pop(key, None)  # traced bindings keep the steps: not reused


class NativeProgram:
    """The communication library's own ``collective`` (algorithm ``native``) for one call
    shape (:meth:`ringcomm.transport.Link.native_init`)."""

    def __init__(self, link, collective: str, layout: tuple, dtype: torch.dtype, op,
                 root: int):
        self.link = link
        self._call = link.native_init(collective, layout, dtype, op, root)

    def run(self, bufs: Sequence[torch.Tensor | None]) -> None:
        nc = self._call
        try:
            nc.start(bufs)
            nc.finish(bufs)
        except BaseException:
            self.link.abandon(nc.handles(), keep=list(bufs))
            raise

    def close(self) -> None:
        pass
