"""Simulated CUDA streams on the CPU, for the NCCL stand-in
(:mod:`ringcomm.testing.fake_nccl`): work issued "on a stream" runs later, in issue
order, on a thread of the stream's own, as a GPU runs a stream's kernels after the
host has moved on.

* :class:`SimStream`: a queue of entries (an NCCL group, a torch op, an event, a
  wait for another stream's event) run in order by the stream's thread.
* :class:`SimEvent`: ``cudaEvent_t``: complete once the stream reached it.
* :class:`Deferred`: a torch dispatch mode that, while ringcomm issues a collective
  on a simulated stream, turns every torch op that reads or writes tensor data into
  an entry of that stream, as CUDA does with kernels: an in-place op returns its
  (not yet written) tensor at once; a functional op returns output tensors
  allocated now and filled when the stream gets there; an op whose answer the host
  reads (``item()``, ``equal``) waits for the stream first, as it synchronises on a
  GPU. Views, and allocations that read no data, run at once.

So code that reads a collective's output without waiting for it (``Work.wait()``,
an event, a stream wait) reads stale memory here as on a GPU, and a Work is
pending until its stream reached its end.
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["SimStream", "SimEvent", "Deferred"]

log = logging.getLogger("ringcomm")

#: a stream's thread ends after this long with nothing to run (a new entry starts
#: another), so idle streams of finished tests hold no threads
_IDLE_S = 0.5


class SimEvent:
    """A point on a :class:`SimStream`: complete once the stream ran everything
    enqueued before it (``cudaEventQuery``/``cudaEventSynchronize``)."""

    __slots__ = ("_done",)

    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Block until complete, at most ``timeout_s``; whether it completed."""
        return self._done.wait(timeout_s)

    def _set(self) -> None:
        self._done.set()


class SimStream:
    """A simulated CUDA stream: entries run one after another, in issue order, on a
    thread of the stream's own.

    Args:
        name: for messages and the thread's name.
        timeout_s: how long a host wait (:meth:`synchronize`) waits before it gives
            up saying the stream is stuck (on a GPU it would wait forever).
    """

    def __init__(self, name: str, timeout_s: float):
        self.name = name
        self.timeout_s = timeout_s
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        #: entries that raised on the stream (what, exception), for tests
        self.errors: list[tuple[str, BaseException]] = []

    def enqueue(self, fn: Callable[[], Any], what: str) -> None:
        """Run ``fn()`` on the stream after everything enqueued before it."""
        with self._cv:
            self._queue.append((fn, what))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"sim-stream-{self.name}")
                self._thread.start()
            self._cv.notify()

    def record(self) -> SimEvent:
        """An event that completes when the stream reaches this point."""
        event = SimEvent()
        self.enqueue(event._set, "event")
        return event

    def wait_event(self, event: SimEvent) -> None:
        """Later entries run only after ``event`` completed (``cudaStreamWaitEvent``)."""
        def wait() -> None:
            if not event.wait(self.timeout_s):
                raise TimeoutError(f"stream {self.name}: an event it waits for did not "
                                   f"complete within {self.timeout_s:g}s")
        self.enqueue(wait, "wait for an event")

    def synchronize(self, what: str) -> None:
        """Block the host until the stream ran everything enqueued so far.

        Raises:
            RuntimeError: it did not within the stream's time limit (on a GPU the host
                would wait forever); ``what`` says what waited.
        """
        if not self.record().wait(self.timeout_s):
            raise RuntimeError(f"FakeNccl: {what} waited {self.timeout_s:g}s for stream "
                               f"{self.name}, which did not get there (on a GPU it would "
                               "wait forever)")

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._queue:
                    self._cv.wait(_IDLE_S)
                    if not self._queue:
                        self._thread = None
                        return
                fn, what = self._queue.popleft()
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - a kernel's failure stays on its stream
                self.errors.append((what, e))
                log.warning("FakeNccl: %s on stream %s failed: %s", what, self.name, e)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _meta(x: Any) -> Any:
    if _is_tensor(x):
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
    return x


#: ops that read no tensor data: run at once (a fresh allocation, filled or not, cannot
#: be touched by what the stream still has to run)
_NO_DATA_PREFIXES = ("empty", "new_empty", "zeros", "new_zeros", "ones", "new_ones",
                     "full", "new_full", "scalar_tensor", "arange", "lift_fresh",
                     "record_stream", "_record_function", "detach", "alias")


class Deferred(TorchDispatchMode):
    """While active (on the thread that issues a collective), torch ops on tensors
    become entries of ``stream`` (see the module docstring)."""

    def __init__(self, stream: SimStream):
        super().__init__()
        self.stream = stream

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        flat, _ = tree_flatten((args, kwargs))
        if func.is_view or name.startswith(_NO_DATA_PREFIXES) or not any(map(_is_tensor, flat)):
            return func(*args, **kwargs)
        schema = func._schema
        written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        meta_args, meta_kwargs = tree_map(_meta, args), tree_map(_meta, kwargs)
        if written:  # in place or out=: written later, handed back now
            # torch checks an op's arguments (dtypes, shapes) on the host as it issues
            # the kernel: the meta kernel makes the same checks, so an error is raised
            # now, not later on the stream
            try:
                func(*meta_args, **meta_kwargs)
            except NotImplementedError:  # no meta kernel (or one that needs the data):
                self.stream.synchronize(f"torch {name} on the host")  # the real op
                return func(*args, **kwargs)  # decides, at the host's turn
            self.stream.enqueue(lambda: func(*args, **kwargs), f"torch {name}")
            return self._written(schema, written, args, kwargs)
        if schema.returns and all(str(r.type) in ("Tensor", "Tensor[]") for r in schema.returns):
            try:  # the outputs' shapes, and the host's checks of the arguments
                shapes = func(*meta_args, **meta_kwargs)
            except Exception:  # noqa: BLE001 - no meta kernel, or shapes that depend on
                shapes = None  # the data: run it at the host's turn (which raises, if bad)
            if shapes is not None:
                outs = tree_map(lambda m: torch.empty_strided(m.size(), m.stride(),
                                                              dtype=m.dtype) if _is_tensor(m)
                                else m, shapes)

                def fill() -> None:
                    got = func(*args, **kwargs)
                    for o, g in zip(tree_flatten(outs)[0], tree_flatten(got)[0]):
                        if _is_tensor(o):
                            o.copy_(g)
                self.stream.enqueue(fill, f"torch {name}")
                return outs
        # the host reads the answer (item(), equal, ...): it synchronises, as on a GPU
        self.stream.synchronize(f"torch {name} on the host")
        return func(*args, **kwargs)

    @staticmethod
    def _written(schema: Any, written: list, args: tuple, kwargs: dict) -> Any:
        """What an in-place or out= op returns: the arguments it writes."""
        names = [a.name for a in schema.arguments]
        values = []
        for a in written:
            i = names.index(a.name)
            values.append(args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name))
        if not schema.returns:
            return None
        return values[0] if len(schema.returns) == 1 else tuple(values)
