"""What torch asks of a backend besides its collectives, for a ringcomm group on
every supported torch.

torch reaches a group's backend through ``pg._get_backend(device)`` (and, from
2.15, ``get_backend`` and ``dist.get_backend_impl``) and reads flags and methods
there: ``batch_isend_irecv`` reads ``supports_coalescing``;
``init_process_group(device_id=...)`` reads ``supports_splitting``, then calls
``eager_connect_single_device``; ``new_group`` and ``split_group`` split from the
bound device's backend; ``set_timeout`` and ``get_error`` go to it. A built-in
backend is a C++ ``Backend`` registered per device on a C++ ``ProcessGroup``.

A ringcomm group is one Python ``ProcessGroup`` serving both of its devices (CPU
over MPI, CUDA over NCCL), so it is its own backend for either: ``_get_backend``
returns the group, and this mixin gives it the contract's names. Measured on torch
2.15, where ``Backend`` can be subclassed from Python, a ringcomm ``Backend`` under
torch's ``ProcessGroup`` would pay the dispatcher and a C++-to-Python crossing on
every call (``scripts/bench_front.py``); one Python front answers torch the same
on every version instead.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ringcomm.settings import Options

__all__ = ["TorchContract", "BackendView", "options_from_torch", "forward_collectives",
           "never_a_split_source"]

_ErrorType = torch._C._distributed_c10d.ErrorType


def _device(device: Any) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def options_from_torch(pg_options: Any) -> Options | None:
    """ringcomm's settings from the ``pg_options`` a user or framework passed.

    Another backend's options (Megatron hands ``ProcessGroupNCCL.Options`` to
    ``new_group`` whatever the backend) are accepted with a warning that names what
    is ignored, as ringcomm has no use for them; the group's timeout comes from the
    ``timeout`` argument either way.

    Raises:
        TypeError: ``pg_options`` is neither ringcomm's nor any backend's options.
    """
    if pg_options is None or isinstance(pg_options, Options):
        return pg_options
    if isinstance(pg_options, torch._C._distributed_c10d.Backend.Options):
        fields = sorted(n for n in dir(pg_options) if not n.startswith("_")
                        and not callable(getattr(pg_options, n, None)))
        warnings.warn(f"ringcomm: pg_options of type {type(pg_options).__qualname__} are "
                      f"another backend's; ringcomm ignores them ({', '.join(fields)}) and "
                      "takes its settings from ringcomm.Options and the environment",
                      stacklevel=3)
        return None
    raise TypeError(f"ringcomm: pg_options must be ringcomm.Options (or another backend's "
                    f"Options, which are ignored), got {type(pg_options).__name__}")


def _backend_base() -> type:
    """torch's C++ ``Backend`` where Python can subclass it (torch >= 2.15), else
    ``object``: torch 2.15 hands a group's backend to C++ (``split_from`` of a new
    group), which takes only a real ``Backend``; older torch reads it from Python."""
    base = torch._C._distributed_c10d.Backend
    try:
        base(0, 1)
    except TypeError:  # "No constructor defined!"
        return object
    return base


class BackendView(_backend_base()):
    """What ``_get_backend(device)`` returns for a ringcomm group, for either of its
    devices: the backend-level names torch reads, each answered by the group.

    Holds the group weakly (the group holds its view), so it raises once the group
    is gone.
    """

    #: torch posts a Python group's ``batch_isend_irecv`` operations one by one
    #: whatever this says (it coalesces only its own C++ groups). None of ringcomm's
    #: can block another: MPI's are non-blocking, and on NCCL each direction of a pair
    #: of ranks has a communicator (and stream) of its own
    #: (:meth:`ringcomm.front.lanes.Lanes.pair`).
    supports_coalescing = False
    #: ``split_group`` and, from a bound device, ``new_group`` (:meth:`TorchContract.split_group`)
    supports_splitting = True
    supports_shrinking = False
    supports_time_estimate = False
    _supports_time_estimate = False

    def __init__(self, group: "TorchContract"):
        if type(self).__mro__[1] is not object:
            super().__init__(group._rank, group._size)
        self._group = weakref.ref(group)

    @property
    def group(self) -> "TorchContract":
        g = self._group()
        if g is None:
            raise RuntimeError("ringcomm: the process group of this backend is gone")
        return g

    def getBackendName(self) -> str:
        return "ringcomm"

    def name(self) -> str:
        return "ringcomm"

    def rank(self) -> int:
        return self.group._rank

    def size(self) -> int:
        return self.group._size

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    def eager_connect_single_device(self, device: Any) -> None:
        self.group.eager_connect_single_device(device)

    def perform_nocolor_split(self, device: Any) -> None:
        """A rank outside a new group does nothing: MPI makes a group's communicator
        among its members only, and NCCL's are made on their first collective. (torch
        no longer calls it: :func:`never_a_split_source`.)"""

    def _set_sequence_number_for_group(self) -> None:
        """Nothing to agree on: every rank numbers its calls from the group's start."""

    def _get_sequence_number_for_group(self) -> int:
        return self.group.seq

    @property
    def options(self) -> Options:
        return self.group.options

    def set_timeout(self, timeout: timedelta) -> None:
        self.group.set_timeout(timeout)

    _set_default_timeout = set_timeout

    def get_error(self) -> Any:
        return self.group.get_error()

    def reconfigure(self, opts: Any = None) -> Any:
        return self.group.reconfigure(opts)

    def split(self, ranks: list[int], opts: Any = None) -> Any:
        return self.group.split_group(ranks, opts=opts)


def _forward(name: str) -> Any:
    def method(self: BackendView, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.group, name)(*args, **kwargs)
    method.__name__ = name
    return method


class TorchContract:
    """The backend contract torch reads off a group (mixed into
    :class:`ringcomm.front.process_group.ProcessGroupRingcomm`)."""

    #: methods torch binds with an options argument that are not collectives, and
    #: that ringcomm refuses with a reason
    REFUSED = ("reconfigure",)

    _view: BackendView | None = None

    # -- the backend of a device ------------------------------------------------
    def _get_backend(self, device: Any) -> BackendView:
        """The backend torch finds for ``device``: one view of this group, for CPU
        and its NCCL device type.

        Raises:
            RuntimeError: another device type (torch's callers expect a
                RuntimeError where a group has no backend for a device).
        """
        kind = _device(device).type
        if kind not in self._served_types():
            raise RuntimeError(f"No backend type associated with device type {kind}: "
                               f"ringcomm serves {' and '.join(self._served_types())}")
        if self._view is None:
            self._view = BackendView(self)
        return self._view

    get_backend = _get_backend

    def _served_types(self) -> tuple[str, ...]:
        nccl = self.lanes.nccl_type
        return ("cpu",) if nccl == "cpu" else ("cpu", nccl)

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(t) for t in self._served_types()]

    def eager_connect_single_device(self, device: Any) -> None:
        """Bind the group to ``device`` (``init_process_group(device_id=...)``) and
        make its communicators now, on every rank alike: NCCL's for a CUDA device
        (MPI's exist from the start).

        Raises:
            ValueError: a device ringcomm cannot serve, or CuPy with NCCL missing
                for a CUDA device; the message names the device and what is missing.
        """
        dev = _device(device)
        what = f"init_process_group(device_id={dev})"
        if dev.type not in self._served_types():
            raise ValueError(f"ringcomm {what}: ringcomm runs CPU tensors over MPI and "
                             f"{self.lanes.nccl_type} tensors over NCCL, not {dev.type}")
        if dev.type == self.lanes.nccl_type:
            self.lanes.for_device(dev, what)
            self.lanes.bound = dev
        self.bound_device_id = dev

    def get_group_store(self) -> Any:
        return self._torch_store

    # -- settings, timeout, errors ------------------------------------------------
    @property
    def options(self) -> Options:
        """The group's settings (what ``new_group``/``split_group`` pass on to a
        child), with ``_timeout``, the name torch reads a backend's timeout by."""
        opts = dataclasses.replace(self._options)
        opts._timeout = timedelta(seconds=self.timeout_s)
        return opts

    def set_timeout(self, timeout: timedelta) -> None:
        """The time limit of every later collective, point-to-point message and
        NCCL set-up of this group (``dist.set_timeout`` on torch >= 2.15).

        Raises:
            ValueError: ``timeout`` is not a positive ``timedelta``.
        """
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            raise ValueError(f"ringcomm set_timeout: the timeout must be a positive "
                             f"datetime.timedelta, got {timeout!r}")
        self.timeout_s = timeout.total_seconds()
        self.lanes.set_timeout(self.timeout_s)

    def reconfigure(self, opts: Any = None) -> Any:
        """torch 2.15's change of a group's peers in place (``ReconfigureOptions``):
        refused, naming what to do instead.

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError(f"ringcomm reconfigure ({self._describe()}): changing a group's "
                           "peers in place is not supported; make a new group of the new "
                           "members (dist.new_group, or destroy_process_group and "
                           "init_process_group)")

    def get_error(self) -> Any:
        """``ErrorType.TIMEOUT`` once a collective timed out, ``COMM_ERROR`` once one
        failed otherwise (the group refuses later calls then), else ``SUCCESS``."""
        err = self.lanes.error()
        if err is None:
            return _ErrorType.SUCCESS
        return _ErrorType.TIMEOUT if getattr(err, "timed_out", False) else _ErrorType.COMM_ERROR

    # -- new groups ---------------------------------------------------------------
    def split_group(self, ranks: list[int], timeout: timedelta | None = None,
                    opts: Any = None, group_name: str | None = None,
                    group_desc: str | None = None, device_types: Any = None) -> Any:
        """The ringcomm group of ``ranks`` (ranks of this group), for
        ``dist.split_group`` and, from a bound device, ``new_group``: None on a
        rank outside it. Every member calls it; the others return at once.

        Raises:
            ValueError: ``ranks`` are not distinct ranks of this group.
        """
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < self._size for r in ranks):
            raise ValueError(f"ringcomm split_group: ranks {ranks} must be distinct ranks "
                             f"of a group of {self._size}")
        if self._rank not in ranks:
            return None
        # the creator torch has for ringcomm (front/create.py registered it): found
        # there, not imported, since the creator's module imports this group's
        creator = dist.Backend._plugins["RINGCOMM"].creator_fn
        name = group_name or f"{self.getGroupName()}:split:{'-'.join(map(str, ranks))}"
        spec = dist.distributed_c10d._DistributedBackendOptions()
        spec.store = dist.PrefixStore(f"ringcomm/split/{name}/", self._torch_store)
        spec.group_rank = ranks.index(self._rank)
        spec.group_size = len(ranks)
        spec.timeout = timeout or timedelta(seconds=self.timeout_s)
        spec.group_id = name
        members = self._global_ranks or list(range(self._size))
        spec.global_ranks_in_group = [members[r] for r in ranks]
        child = creator(spec, opts if opts is not None else self._options)
        child.setGroupName(name)
        child.setGroupDesc(group_desc or f"{self.getGroupDesc() or name}:split")
        if self.bound_device_id is not None:
            child.eager_connect_single_device(self.bound_device_id)
        return child


def never_a_split_source() -> None:
    """Keep torch from offering a ringcomm group as the split source of a new group.

    With the default group bound to a device (``init_process_group(device_id=...)``),
    torch's ``new_group`` asks ``_get_split_source`` for the default group's backend
    of that device, so that a new NCCL group can be split from it
    (``ncclCommSplit``), and calls its ``perform_nocolor_split`` on ranks outside the
    new group. A ringcomm group says ``supports_splitting`` (torch reads the same flag
    before ``eager_connect_single_device`` and in ``split_group``), but no other
    backend can split from it: ``ProcessGroupNCCL.Options.split_from`` takes only a
    ``ProcessGroupNCCL``, so ``new_group(backend="nccl")`` raised a TypeError from
    inside torch, and a backend created by its plugin creator never reads the source.
    Wrapping ``_get_split_source`` so it answers None for a ringcomm group makes
    every new group start on its own, as with an unbound default group. Idempotent;
    a torch without the function needs nothing.
    """
    c10d = dist.distributed_c10d
    original = getattr(c10d, "_get_split_source", None)
    if original is None or getattr(original, "_ringcomm_wrapped", False):
        return

    @functools.wraps(original)  # __wrapped__: torch's own, for tests
    def _get_split_source(pg: Any, *args: Any, **kwargs: Any) -> Any:
        # (torch 2.15 adds the requested backend, and offers a source only for the
        # parent's own backend; older torch offers it to any backend)
        source = original(pg, *args, **kwargs)
        return None if isinstance(source, BackendView) else source

    _get_split_source._ringcomm_wrapped = True  # type: ignore[attr-defined]
    c10d._get_split_source = _get_split_source


def forward_collectives(names: Any) -> None:
    """Give :class:`BackendView` the group's collective methods ``names`` (torch's
    C++ ``Backend`` has its own, which would refuse)."""
    for name in names:
        setattr(BackendView, name, _forward(name))
