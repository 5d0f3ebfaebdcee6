"""FakeNccl stays honest: its module functions, communicator methods, argument lists
and constants are those of the real ``cupy.cuda.nccl``, compared with it wherever it
can be imported (``make check-nccl-api`` installs CuPy and NCCL's wheel, which import
without a GPU). Its communicator methods carry no Python signatures, but their
docstrings do (``NcclCommunicator.send(self, intptr_t sendbuf, ...)``)."""
from __future__ import annotations

import inspect
import re

import pytest

from ringcomm.testing.fake_nccl import FakeNccl, _FakeComm, _RecordingComm
from ringcomm.transport import nccl as transport


def _real():
    try:
        from cupy.cuda import nccl
    except Exception as e:  # noqa: BLE001 - ImportError, or CUDA missing underneath
        pytest.skip(f"cupy.cuda.nccl cannot be imported here ({type(e).__name__}: {e})")
    if not getattr(nccl, "available", False):
        pytest.skip("CuPy is installed but cannot load NCCL")
    return nccl


def _public(cls) -> list[str]:
    return [n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")]


def _doc_params(fn) -> list[str]:
    """Parameter names from a Cython docstring's first line, ``self`` left out."""
    head = (fn.__doc__ or "").strip().splitlines()[0]
    m = re.match(r"[\w.]+\((.*)\)", head)
    assert m, f"no signature in the docstring of {fn!r}: {head!r}"
    params = [p.strip().split()[-1].split("=")[0] for p in m.group(1).split(",") if p.strip()]
    return [p for p in params if p != "self"]


def test_the_communicator_methods_and_their_arguments_are_the_real_ones():
    nccl = _real()
    for fake in (_FakeComm, _RecordingComm):
        for name in _public(fake):
            real = getattr(nccl.NcclCommunicator, name, None)
            assert real is not None, f"{fake.__name__}.{name}: cupy's NcclCommunicator has none"
            ours = [p for p in inspect.signature(getattr(fake, name)).parameters if p != "self"]
            theirs = _doc_params(real)
            assert ours == theirs, f"{fake.__name__}.{name}{tuple(ours)} != cupy's {tuple(theirs)}"


def test_the_module_functions_ringcomm_calls_exist():
    nccl = _real()
    for name in ("get_version", "get_unique_id", "groupStart", "groupEnd", "NcclCommunicator"):
        assert hasattr(FakeNccl, name) and hasattr(nccl, name), name
    assert isinstance(nccl.get_version(), int)
    uid = nccl.get_unique_id()
    fake_form = "bytes" if isinstance(uid, (bytes, bytearray)) else "tuple"
    assert type(FakeNccl(id_form=fake_form).get_unique_id()) is type(uid)
    # the store's round trip gives back what this CuPy's communicator takes
    assert transport.decode_id(transport.encode_id(uid)) == (bytes(uid) if fake_form == "bytes"
                                                             else tuple(uid))


def test_type_and_op_codes_are_nccls():
    nccl = _real()
    names = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
             "int64": "NCCL_INT64", "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32",
             "float64": "NCCL_FLOAT64", "bfloat16": "NCCL_BFLOAT16"}
    for dtype, code in transport.DTYPE_CODES.items():
        const = names[str(dtype).rsplit(".", 1)[-1]]
        assert getattr(nccl, const) == code, (dtype, const, getattr(nccl, const), code)
    from ringcomm import ops
    for op, const in ((ops.SUM, "NCCL_SUM"), (ops.PRODUCT, "NCCL_PROD"),
                      (ops.MAX, "NCCL_MAX"), (ops.MIN, "NCCL_MIN")):
        assert getattr(nccl, const) == transport.OP_CODES[op.value], const


def test_its_errors_read_as_cupys_and_ncclgetlasterror_is_found():
    nccl = _real()
    from ringcomm.testing.fake_nccl import FakeNcclError

    for status in transport.ERROR_NAMES:
        if status in transport.CUPY_UNNAMED:  # CuPy's table stops at 6: a KeyError
            for cls in (nccl.NcclError, FakeNcclError):
                with pytest.raises(KeyError) as e:
                    cls(status)
                assert transport.nccl_status(e.value) == status, cls
            continue
        real, fake = nccl.NcclError(status), FakeNcclError(status)
        assert real.status == fake.status == status
        assert str(real).split(":")[0] == str(fake).split(":")[0] == transport.ERROR_NAMES[status]
    nccl.get_version()  # the library is loaded
    assert transport._find_get_last_error(), "ncclGetLastError not found in the loaded NCCL"
    assert isinstance(transport.last_error(nccl), str)
