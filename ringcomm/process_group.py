"""The ringcomm ProcessGroup: torch's collective calls -> one request each for the engine."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import zlib
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from . import ops
from .algorithms import REGISTRY, select
from .engine import Engine
from .transport import Transport

log = logging.getLogger("ringcomm")

DEFAULT_SEGMENT_BYTES = 512 * 1024


@dataclasses.dataclass
class Options:
    """Per-group settings, passed as ``pg_options`` to ``init_process_group`` / ``new_group``.

    Attributes:
        algorithms: collective -> algorithm name (e.g. ``{"allreduce": "ring"}``);
            unlisted collectives use ``RINGCOMM_ALGO`` or ``auto``.
        segment_bytes: pipeline segment size (default ``RINGCOMM_SEGMENT_BYTES`` or 512 KiB).
        tuning_file: JSON tuning table for ``auto`` (default ``RINGCOMM_TUNING``).
    """

    algorithms: dict[str, str] = dataclasses.field(default_factory=dict)
    segment_bytes: int | None = None
    tuning_file: str | None = None


def _parse_algo_env(value: str) -> dict[str, str]:
    """``RINGCOMM_ALGO``: ``ring`` (every collective that has one) or ``allreduce=ring,broadcast=tree``."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in value.split(","))):
        if "=" in item:
            coll, name = (s.strip() for s in item.split("=", 1))
            out[coll] = name
        else:
            for coll, algos in REGISTRY.items():
                if item in algos or item == "auto":
                    out[coll] = item
            if not any(item in a for a in REGISTRY.values()) and item != "auto":
                raise ValueError(f"ringcomm: RINGCOMM_ALGO names unknown algorithm {item!r}")
    return out


def _check_algo(collective: str, name: str) -> None:
    if collective not in REGISTRY:
        raise ValueError(f"ringcomm: unknown collective {collective!r}; known: {sorted(REGISTRY)}")
    if name != "auto" and name not in REGISTRY[collective]:
        raise ValueError(f"ringcomm: no {collective} algorithm {name!r}; available: "
                         f"{['auto', *REGISTRY[collective]]}")


class ProcessGroupRingcomm(dist.ProcessGroup):
    """A torch process group whose collectives run ringcomm's algorithms.

    Created by torch through the registered backend creator; users get it from
    ``dist.init_process_group("ringcomm")`` or ``dist.new_group(..., backend="ringcomm")``.
    """

    def __init__(self, rank: int, size: int, transport: Transport, timeout: timedelta,
                 options: Options | None = None, group_id: str = ""):
        super().__init__(rank, size)
        self._tp = transport
        self._timeout_s = timeout.total_seconds()
        self._group_name = group_id
        self._group_desc = ""
        options = options or Options()
        env_algos = _parse_algo_env(os.environ.get("RINGCOMM_ALGO", ""))
        self._algos: dict[str, str] = {c: "auto" for c in REGISTRY}
        for coll, name in {**env_algos, **options.algorithms}.items():
            _check_algo(coll, name)
            self._algos[coll] = name
        seg = options.segment_bytes or int(os.environ.get("RINGCOMM_SEGMENT_BYTES",
                                                          DEFAULT_SEGMENT_BYTES))
        if seg <= 0:
            raise ValueError(f"ringcomm: segment_bytes must be positive, got {seg}")
        self.segment_bytes = seg
        self._tuning = select.load_tuning(options.tuning_file)
        self._logged_choices: set = set()
        self._fingerprints: dict[int, str] = {}
        self._check_consistency = os.environ.get("RINGCOMM_DEBUG", "").upper() == "DETAIL"
        self._engine = Engine(transport, self._describe)

    # -- identity -------------------------------------------------------------
    def getBackendName(self) -> str:
        return "ringcomm"

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def _describe(self) -> str:
        return f"group '{self._group_desc or self._group_name or '?'}'"

    def __repr__(self) -> str:
        return f"<ringcomm.ProcessGroup {self._describe()} rank {self.rank()}/{self.size()}>"

    # -- algorithm choice -----------------------------------------------------
    def set_algorithm(self, collective: str, name: str) -> None:
        """Use algorithm ``name`` (or ``"auto"``) for ``collective`` on this group.

        Every rank of the group must make the same choice before its next collective.
        """
        _check_algo(collective, name)
        self._algos[collective] = name

    def get_algorithm(self, collective: str) -> str:
        return self._algos[collective]

    def algorithm_for(self, collective: str, nbytes: int) -> str:
        """The algorithm a ``collective`` of ``nbytes`` per rank runs on this group."""
        name = self._algos[collective]
        if name == "auto":
            name = select.choose(self._tuning, collective, nbytes, self.size())
            if log.isEnabledFor(logging.INFO):
                key = (collective, name, max(nbytes, 1).bit_length())
                if key not in self._logged_choices:
                    self._logged_choices.add(key)
                    log.info("ringcomm auto: %s of %d B on %d ranks -> %s",
                             collective, nbytes, self.size(), name)
        return name

    def _algorithm(self, collective: str, nbytes: int) -> tuple[str, Callable]:
        name = self.algorithm_for(collective, nbytes)
        try:
            return name, REGISTRY[collective][name]
        except KeyError:
            raise ValueError(f"ringcomm {collective}: tuning chose unknown algorithm {name!r}") from None

    # -- plumbing -------------------------------------------------------------
    def _timeout(self, opts: Any) -> float:
        t = getattr(opts, "timeout", None)
        if isinstance(t, timedelta) and t.total_seconds() > 0:
            return t.total_seconds()
        return self._timeout_s

    def _submit(self, op: str, fn: Callable[[], Any], opts: Any) -> dist.Work:
        return self._engine.submit(op, fn, async_op=bool(getattr(opts, "asyncOp", True)),
                                   timeout_s=self._timeout(opts))

    def _check(self, t: Any, op: str, what: str = "tensor") -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ringcomm {op}: {what} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"ringcomm {op}: {what} has layout {t.layout}; only dense tensors")
        if t.device != self._tp.device and t.device.type != self._tp.device.type:
            if t.device.type == "cuda":
                raise ValueError(f"ringcomm {op}: {what} is on {t.device}, but CUDA tensors "
                                 "need the NCCL transport, which this ringcomm build does not "
                                 "have yet; move the tensor to the CPU")
            raise ValueError(f"ringcomm {op}: {what} is on {t.device}; ringcomm supports "
                             f"{self._tp.device.type} tensors")
        return t

    def _single(self, tensors: list, op: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise ValueError(f"ringcomm {op}: expected a list with exactly one tensor "
                             f"(one device per process), got {len(tensors)}")
        return self._check(tensors[0], op)

    def _consistency_check(self, op: str, fields: list[int]) -> None:
        """RINGCOMM_DEBUG=DETAIL: every rank must run the same collective with the same
        sizes; compare a fingerprint across ranks before running it."""
        if not self._check_consistency or self.size() == 1:
            return
        self._fingerprints.setdefault(zlib.crc32(op.encode()), op)
        mine = torch.tensor([zlib.crc32(op.encode()), *fields], dtype=torch.int64)
        everyone = mine.repeat(self.size())
        chunks = list(everyone.view(self.size(), -1).unbind(0))
        REGISTRY["allgather"]["ring"](self._tp, chunks, segment_bytes=1 << 20)
        rows = everyone.view(self.size(), -1)
        bad = [r for r in range(self.size()) if not torch.equal(rows[r], mine)]
        if bad:
            theirs = "; ".join(f"rank {r}: {self._fingerprints.get(rows[r, 0].item(), '?')} "
                               f"{rows[r, 1:].tolist()}" for r in bad)
            raise RuntimeError(f"collective mismatch: rank {self.rank()} runs {op} {fields}, "
                               f"but {theirs}")

    # -- collectives ----------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """In-place allreduce of ``tensors[0]`` (torch's ``dist.all_reduce``)."""
        opts = opts or dist.AllreduceOptions()
        t = self._single(tensors, "allreduce")
        op = ops.resolve(opts.reduceOp, t.dtype, "allreduce")
        nbytes = t.numel() * t.element_size()
        name, algo = self._algorithm("allreduce", nbytes)
        size, seg = self.size(), self.segment_bytes

        def run():
            self._consistency_check("allreduce", [t.numel(), int(op), _dtype_code(t.dtype)])
            with _flat(t) as flat:
                if flat.numel():
                    algo(self._tp, flat, op, segment_bytes=seg)
                    ops.finalize_(flat, op, size)
            return tensors

        return self._submit(f"allreduce[{name}]", run, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """In-place broadcast of ``tensors[0]`` from ``opts.rootRank``."""
        opts = opts or dist.BroadcastOptions()
        t = self._single(tensors, "broadcast")
        root = self._root(opts.rootRank, "broadcast")
        if getattr(opts, "rootTensor", 0) != 0:
            raise ValueError(f"ringcomm broadcast: rootTensor must be 0, got {opts.rootTensor}")
        name, algo = self._algorithm("broadcast", t.numel() * t.element_size())
        seg = self.segment_bytes

        def run():
            self._consistency_check("broadcast", [t.numel(), root])
            with _flat(t, copy_in=True) as flat:
                if flat.numel():
                    algo(self._tp, _bytes(flat), root, segment_bytes=seg)
            return tensors

        return self._submit(f"broadcast[{name}]", run, opts)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        """``dist.all_gather``: ``output_lists[0][i]`` receives rank i's ``inputs[0]``."""
        opts = opts or dist.AllgatherOptions()
        t = self._single(inputs, "allgather")
        if len(output_lists) != 1:
            raise ValueError(f"ringcomm allgather: expected one output list, got {len(output_lists)}")
        outs = output_lists[0]
        if len(outs) != self.size():
            raise ValueError(f"ringcomm allgather: output list has {len(outs)} tensors, "
                             f"expected one per rank ({self.size()})")
        for i, o in enumerate(outs):
            self._check(o, "allgather", f"output tensor {i}")
            if o.dtype != t.dtype:
                raise ValueError(f"ringcomm allgather: output tensor {i} has dtype {o.dtype}, "
                                 f"input has {t.dtype}")
        me = outs[self.rank()]
        if me.numel() != t.numel():
            raise ValueError(f"ringcomm allgather: output tensor {self.rank()} has "
                             f"{me.numel()} elements, the input has {t.numel()}")
        name, algo = self._algorithm("allgather", t.numel() * t.element_size())
        seg = self.segment_bytes

        def run():
            self._consistency_check("allgather", [t.numel()])
            with contextlib.ExitStack() as stack:
                flats = [stack.enter_context(_flat(o, copy_in=False)) for o in outs]
                flats[self.rank()].copy_(t.reshape(-1))
                if any(f.numel() for f in flats):
                    algo(self._tp, [_bytes(f) for f in flats], segment_bytes=seg)
            return output_lists

        return self._submit(f"allgather[{name}]", run, opts)

    def barrier(self, opts: Any = None) -> dist.Work:
        """Returns (or its Work completes) once every rank of the group has entered."""
        name, algo = self._algorithm("barrier", 0)

        def run():
            self._consistency_check("barrier", [])
            algo(self._tp, segment_bytes=self.segment_bytes)
            return []

        return self._submit(f"barrier[{name}]", run, opts)

    # -- helpers --------------------------------------------------------------
    def _root(self, root: int, op: str) -> int:
        if not 0 <= root < self.size():
            raise ValueError(f"ringcomm {op}: root rank {root} is out of range for a group "
                             f"of {self.size()}")
        return root

    # -- lifecycle ------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the progress thread and release the communicators."""
        self._engine.shutdown()
        self._tp.close()

    def abort(self) -> None:
        self.shutdown()


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Non-reducing collectives move bytes: one code path for every dtype."""
    return t.view(torch.uint8)


@contextlib.contextmanager
def _flat(t: torch.Tensor, copy_in: bool = True) -> Iterator[torch.Tensor]:
    """A 1-D contiguous view of ``t``; a non-contiguous ``t`` gets a temporary copy
    that is written back afterwards."""
    if t.is_contiguous():
        yield t.view(-1)
        return
    tmp = t.contiguous() if copy_in else torch.empty(t.shape, dtype=t.dtype, device=t.device)
    yield tmp.view(-1)
    t.copy_(tmp)
