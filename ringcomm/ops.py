"""Reduce ops, dtype rules and local (single-process) reductions.

:func:`reducer` gives torch's op for every dtype torch reduces (bfloat16 and
float16 included); CUDA lanes and whole-tensor steps use it.

The local work between a schedule's point-to-point messages stays on the calling
thread, as MPI's and gloo's reductions do: :func:`serial_reducer` and
:func:`serial_copy`, on operands over raw memory (:func:`memory`,
:func:`operand`). From :data:`PARALLEL_FROM` elements on, torch spreads an
elementwise op over its intra-op threads, which then spin for a while after it:
with more ranks on a host than cores per rank (mpiexec and srun leave torch one
thread per core in every rank), they take the cores that other ranks, and the
network progress of this one, need (docs/multi-node.md: across hosts over a slow
link, such ops made each exchange take several times the link's time).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

RedOpType = dist.ReduceOp.RedOpType

SUM = RedOpType.SUM
AVG = RedOpType.AVG
PRODUCT = RedOpType.PRODUCT
MIN = RedOpType.MIN
MAX = RedOpType.MAX
BAND = RedOpType.BAND
BOR = RedOpType.BOR
BXOR = RedOpType.BXOR

#: dtypes every reducing collective accepts (non-reducing ones move bytes and take any dtype).
REDUCE_DTYPES = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
})
_BITWISE = frozenset({BAND, BOR, BXOR})


def op_name(op: RedOpType) -> str:
    return str(op).rsplit(".", 1)[-1]


_resolved: dict = {}


def resolve(reduce_op, dtype: torch.dtype, collective: str) -> RedOpType:
    """Turn the op from torch's options into a RedOpType and check it suits ``dtype``.

    Args:
        reduce_op: ``opts.reduceOp`` (a ``dist.ReduceOp``) or a ``RedOpType``.
        dtype: dtype of the tensors being reduced.
        collective: name of the calling collective, for error messages.
    Raises:
        ValueError: the op is unknown, not supported (PREMUL_SUM), or not defined
            for ``dtype`` (bitwise ops on floating types, AVG on bool).
    """
    op = getattr(reduce_op, "op", reduce_op)
    # Every call of a training loop asks the same question. Keyed by the enum's
    # value: torch hands out a new enum object per call, and comparing them is slow.
    if (getattr(op, "value", None), dtype) in _resolved:
        return op
    if not isinstance(op, RedOpType):
        raise ValueError(f"ringcomm {collective}: unknown reduce op {reduce_op!r}")
    if op == RedOpType.PREMUL_SUM:
        raise ValueError(f"ringcomm {collective}: ReduceOp.PREMUL_SUM is not supported "
                         "(scale the tensor, then use SUM)")
    if dtype not in REDUCE_DTYPES:
        raise ValueError(f"ringcomm {collective}: dtype {dtype} cannot be reduced; "
                         f"supported: {sorted(str(d) for d in REDUCE_DTYPES)}")
    if op in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"ringcomm {collective}: ReduceOp.{op_name(op)} needs an integer "
                         f"or bool tensor, got {dtype}")
    if op == AVG and dtype == torch.bool:
        raise ValueError(f"ringcomm {collective}: ReduceOp.AVG is not defined for bool tensors")
    _resolved[(op.value, dtype)] = True
    return op


def _minimum(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.minimum(dst, src, out=dst)


def _maximum(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.maximum(dst, src, out=dst)


#: op value -> in-place reduction ``dst = dst (op) src`` (AVG reduces as SUM;
#: finalize_ divides)
_REDUCE = {SUM.value: torch.Tensor.add_, AVG.value: torch.Tensor.add_,
           PRODUCT.value: torch.Tensor.mul_, MIN.value: _minimum, MAX.value: _maximum,
           BAND.value: torch.Tensor.bitwise_and_, BOR.value: torch.Tensor.bitwise_or_,
           BXOR.value: torch.Tensor.bitwise_xor_}
#: op value -> ``dst = src (op) dst`` in place, through torch's ``out=`` form
_COMBINE = {SUM.value: torch.add, AVG.value: torch.add, PRODUCT.value: torch.mul,
            MIN.value: torch.minimum, MAX.value: torch.maximum,
            BAND.value: torch.bitwise_and, BOR.value: torch.bitwise_or,
            BXOR.value: torch.bitwise_xor}


def _src_first(combine):
    def reduce_src_first(dst: torch.Tensor, src: torch.Tensor) -> None:
        combine(src, dst, out=dst)
    return reduce_src_first


_REDUCE_SRC_FIRST = {v: _src_first(fn) for v, fn in _COMBINE.items()}
_AVG = AVG.value


def reducer(op: RedOpType, src_first: bool = False):
    """The in-place reduction ``fn(dst, src)`` of ``op``: ``dst = dst (op) src``, or
    ``dst = src (op) dst`` with ``src_first`` (AVG reduces as SUM; see finalize_)."""
    fn = (_REDUCE_SRC_FIRST if src_first else _REDUCE).get(op.value)
    if fn is None:  # resolve() keeps other ops out
        raise ValueError(f"ringcomm: no local reduction for {op!r}")
    return fn


#: from this many elements torch runs an elementwise op on its intra-op threads
#: (``at::internal::GRAIN_SIZE``)
PARALLEL_FROM = 32768
#: op value -> numpy's ufunc of it (single-threaded)
_NUMPY_UFUNC = {SUM.value: np.add, AVG.value: np.add, PRODUCT.value: np.multiply,
                MIN.value: np.minimum, MAX.value: np.maximum, BAND.value: np.bitwise_and,
                BOR.value: np.bitwise_or, BXOR.value: np.bitwise_xor}
#: dtypes numpy reduces as torch does (float16 is slow in numpy, bfloat16 absent)
_NUMPY_DTYPES = frozenset({torch.float32, torch.float64, torch.int8, torch.uint8,
                           torch.int16, torch.int32, torch.int64, torch.bool})
_threads = torch.get_num_threads


#: torch dtype -> numpy's, for the dtypes of _NUMPY_DTYPES
_NUMPY_OF = {d: torch.empty(0, dtype=d).numpy().dtype for d in _NUMPY_DTYPES}

# numpy's floating-point warnings are turned off around each reduction (an overflow
# gives inf, as in torch, and says nothing). ``np.errstate`` costs about 1 us a call,
# more than a 4 KiB add; numpy 2 keeps that state in a context variable, which is
# set directly where it exists (the same thing errstate does, for a tenth of the cost).
try:
    from numpy._core import _ufunc_config as _ufc
    _ERR_STATE, _QUIET = _ufc._extobj_contextvar, _ufc._make_extobj(all="ignore")
except (ImportError, AttributeError, TypeError):  # numpy 1.x: errstate
    _ERR_STATE = _QUIET = None


#: ufuncs whose output numpy takes only by keyword (a third positional argument to
#: minimum and maximum is deprecated)
_KEYWORD_OUT = frozenset({np.minimum, np.maximum})


def _quiet(ufunc, src_first: bool = False):
    """``ufunc(dst, src, out=dst)`` (``ufunc(src, dst, out=dst)`` with ``src_first``)
    with numpy's floating-point warnings off."""
    if _ERR_STATE is None:
        def reduce_quiet(dst: np.ndarray, src: np.ndarray) -> None:
            with np.errstate(all="ignore"):
                if src_first:
                    ufunc(src, dst, out=dst)
                else:
                    ufunc(dst, src, out=dst)
        return reduce_quiet
    var, quiet = _ERR_STATE, _QUIET
    # the output passed by position where numpy takes it so: no keywords to parse,
    # which after a pause saves about a microsecond of a 4 KiB add's five
    # (scripts/bench_steps.py, docs/data/steps_pause.json)
    by_position = ufunc not in _KEYWORD_OUT

    def reduce_quiet(dst: np.ndarray, src: np.ndarray) -> None:
        a, b = (src, dst) if src_first else (dst, src)
        token = var.set(quiet)
        try:
            if by_position:
                ufunc(a, b, dst)
            else:
                ufunc(a, b, out=dst)
        finally:
            var.reset(token)
    return reduce_quiet


def memory(ptr: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of CPU memory at address ``ptr`` as a uint8 array that holds no
    reference to the memory's owner: the form in which the point-to-point executor
    keeps a binding's local operands, like its persistent requests, valid whenever a
    tensor at that address is passed again and never keeping a caller's tensor alive."""
    if nbytes <= 0:
        return np.empty(0, dtype=np.uint8)
    return np.asarray(_Address(ptr, nbytes))


class _Address:
    """Memory by address, for numpy (its array interface); unlike a ctypes array of
    each size, it leaves no type behind per size."""

    __slots__ = ("__array_interface__",)

    def __init__(self, ptr: int, nbytes: int):
        self.__array_interface__ = {"data": (ptr, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}


def operand(mem: np.ndarray, dtype: torch.dtype) -> np.ndarray | torch.Tensor:
    """``mem`` (from :func:`memory`) as the operand :func:`serial_reducer`'s function
    takes for ``dtype``: a numpy array where numpy reduces ``dtype`` as torch does, a
    tensor over the same memory otherwise (float16, bfloat16)."""
    if dtype in _NUMPY_DTYPES:
        return mem.view(_NUMPY_OF[dtype])
    return torch.frombuffer(mem, dtype=dtype) if mem.size else torch.empty(0, dtype=dtype)


def serial_reducer(op: RedOpType, dtype: torch.dtype, src_first: bool = False):
    """:func:`reducer`'s ``fn(dst, src)`` (``dst = dst (op) src``, or ``src (op) dst``
    with ``src_first``) on :func:`operand` s of ``dtype``, kept on the calling thread
    at every size (see the module docstring): numpy's ufunc for the dtypes numpy
    reduces as torch does (a 4 KiB add costs half torch's; floating-point warnings
    off), else torch's op, on slices below :data:`PARALLEL_FROM` where torch would
    spread it over its threads. Results are torch's bit for bit, but for MIN and MAX
    with a NaN operand: numpy writes the canonical NaN where torch writes its own (a
    NaN either way, the same on every rank)."""
    if dtype in _NUMPY_DTYPES:
        ufunc = _NUMPY_UFUNC[op.value]
        if dtype.is_floating_point:
            return _quiet(ufunc, src_first)
        if ufunc in _KEYWORD_OUT:  # integers and bools never warn
            return ((lambda dst, src: ufunc(src, dst, out=dst)) if src_first
                    else (lambda dst, src: ufunc(dst, src, out=dst)))
        if src_first:
            return lambda dst, src: ufunc(src, dst, dst)
        return lambda dst, src: ufunc(dst, src, dst)
    fn = reducer(op, src_first)

    def reduce_serial(dst: torch.Tensor, src: torch.Tensor) -> None:
        n = dst.numel()
        if n < PARALLEL_FROM or _threads() == 1:
            fn(dst, src)
        else:
            for i in range(0, n, PARALLEL_FROM):
                fn(dst[i:i + PARALLEL_FROM], src[i:i + PARALLEL_FROM])
    return reduce_serial


#: ``dst[:] = src`` on :func:`memory` arrays of one size: numpy copies on this thread
serial_copy = np.copyto


def reduce_(dst: torch.Tensor, src: torch.Tensor, op: RedOpType,
            src_first: bool = False) -> None:
    """dst = dst (op) src (src (op) dst with ``src_first``), elementwise and in place."""
    reducer(op, src_first)(dst, src)


def finalize_(buf: torch.Tensor, op: RedOpType, world_size: int) -> None:
    """Post-processing after a reduction over ``world_size`` contributions.

    AVG divides the sum; integer tensors truncate toward zero, as NCCL's ncclAvg does.
    """
    if op.value != _AVG or world_size == 1:
        return
    if buf.dtype.is_floating_point or buf.dtype.is_complex:
        buf.div_(world_size)
    else:
        buf.copy_(torch.div(buf, world_size, rounding_mode="trunc"))


class Averaging:
    """How a reducing collective computes AVG, before and after its reduction.

    NCCL's ``ncclAvg`` on floating types multiplies each rank's input by 1/nRanks,
    rounded to the element type, and then sums (``ncclDevPreMulSum``), so an fp16
    sum that would overflow stays finite, and torch's ``nccl`` backend rounds so.
    ringcomm does the same on NCCL lanes (``premultiply``). Elsewhere (MPI lanes,
    and integers everywhere) AVG sums, then divides (:func:`finalize_`). Every
    other op passes through both steps untouched.
    """

    __slots__ = ("scale", "post", "size")

    def __init__(self, op: RedOpType, dtype: torch.dtype, world_size: int, premultiply: bool):
        self.size = world_size
        self.scale: float | None = None
        self.post: RedOpType | None = None
        if op.value != _AVG or world_size == 1:
            return
        if premultiply and (dtype.is_floating_point or dtype.is_complex):
            self.scale = float(torch.tensor(1.0 / world_size, dtype=dtype).real)
        else:
            self.post = op

    def before(self, buf: torch.Tensor) -> None:
        """Scale this rank's contribution, where AVG premultiplies."""
        if self.scale is not None:
            buf.mul_(self.scale)

    def after(self, buf: torch.Tensor) -> None:
        """Divide the sum, where AVG sums first."""
        if self.post is not None:
            finalize_(buf, self.post, self.size)
