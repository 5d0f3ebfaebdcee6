"""The CUDA path (NCCL through CuPy) on CPU machines: the process group's NCCL lane
runs here on CPU tensors with ringcomm.testing.FakeNccl, which has CuPy's
interface (pointers, byte counts, type codes, groups) and enforces NCCL's rules
through the simulator. Only the stream calls differ from a GPU run."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ringcomm
from ringcomm.front.process_group import ProcessGroupRingcomm
from ringcomm.testing import FakeNccl, check_collectives, nccl_groups
from ringcomm.transport import nccl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# 4 and 5 ranks add time, not cases, to 2 and 3 (a size no power of two): make test-wide
@pytest.mark.parametrize("size", [1, 2, 3, pytest.param(4, marks=pytest.mark.wide),
                                  pytest.param(5, marks=pytest.mark.wide)])
def test_every_collective_and_algorithm_matches_the_oracle(size):
    # CuPy 13 hands out tuple ids, CuPy 14 bytes: both forms, alternately.
    lib = FakeNccl("tuple" if size % 2 else "bytes")
    counts = nccl_groups(size, lambda pg: check_collectives(pg, "cpu"), lib=lib)
    # allreduce: 4 algorithms x 4 dtypes x 5 ops alone
    assert min(counts) > 200
    assert lib.calls["allReduce"] > 0 and lib.calls["reduceScatter"] > 0
    if size > 1:
        assert lib.calls["groupStart"] > 0
        assert lib.calls["send"] > 0 and lib.calls["recv"] > 0


def test_the_oracle_check_catches_a_wrong_result():
    class Corrupt(FakeNccl):
        def NcclCommunicator(self, ndev, uid, rank):  # noqa: N802
            comm = super().NcclCommunicator(ndev, uid, rank)
            real = comm.allReduce

            def off_by_one(send, recv, count, dtype, op, stream):
                real(send, recv, count, dtype, op, stream)
                if count and dtype == 7:  # float32
                    from ringcomm.testing.fake_nccl import memory_at as _memory
                    _memory(recv, count, dtype).add_(1)
            comm.allReduce = off_by_one
            return comm

    with pytest.raises(RuntimeError, match=r"allreduce\[native\] torch.float32 SUM: differs"):
        nccl_groups(2, lambda pg: check_collectives(
            pg, "cpu", dtypes=(torch.float32,), reduce_ops=("SUM",),
            algorithms={"allreduce": ["native"]}), lib=Corrupt())


def test_every_schedule_step_is_one_nccl_group():
    class Counting(FakeNccl):
        def groupStart(self):  # noqa: N802
            self.mine.n = getattr(self.mine, "n", 0) + 1
            super().groupStart()

    lib = Counting()
    lib.mine = threading.local()

    def body(pg):
        pg.set_algorithm("allreduce", "ring")
        pg.allreduce([torch.ones(12)]).wait()  # sets up the communicator
        lib.mine.n = 0
        pg.allreduce([torch.ones(12)]).wait()
        return lib.mine.n

    # ring allreduce on 3 ranks: 2 reduce-scatter + 2 allgather steps
    assert nccl_groups(3, body, lib=lib) == [4, 4, 4]


def test_point_to_point_uses_a_pair_communicator():
    def body(pg):
        r, p = pg.rank(), pg.size()
        got = torch.zeros(4)
        if r % 2 == 0:
            pg.send([torch.full((4,), float(r))], (r + 1) % p).wait()
            pg.recv([got], (r - 1) % p).wait()
        else:
            pg.recv([got], (r - 1) % p).wait()
            pg.send([torch.full((4,), float(r))], (r + 1) % p).wait()
        with pytest.raises(ValueError, match="any rank needs MPI"):
            pg.recv_anysource([got])
        return got[0].item(), pg.lanes.pair_peers()

    out = nccl_groups(4, body)
    assert [v for v, _ in out] == [3.0, 0.0, 1.0, 2.0]
    # one communicator per direction: each rank sends to one neighbour, hears the other
    # with each neighbour, a communicator for each direction
    assert [peers for _, peers in out] == [
        [(q, way) for q in sorted({(r - 1) % 4, (r + 1) % 4}) for way in ("recv", "send")]
        for r in range(4)]


def test_bad_inputs_raise_before_anything_is_enqueued():
    lib = FakeNccl()

    def body(pg):
        before = dict(lib.calls)
        with pytest.raises(ValueError, match="not contiguous; NCCL needs contiguous"):
            pg.allreduce([torch.ones(4, 4).t()])
        with pytest.raises(ValueError, match="one call takes tensors of one device"):
            pg.allgather([[torch.empty(2), torch.empty(2, device="meta")]], [torch.ones(2)])
        with pytest.raises(ValueError, match="not supported"):
            pg.allreduce([torch.ones(2, device="meta")])
        pg.set_algorithm("allreduce", "native")
        with pytest.raises(ValueError, match="NCCL's own\\) cannot reduce torch.int16"):
            pg.allreduce([torch.ones(3, dtype=torch.int16)])
        o = dist.AllreduceOptions()
        o.reduceOp = dist.ReduceOp.BAND
        with pytest.raises(ValueError, match="NCCL has no ReduceOp.BAND"):
            pg.allreduce([torch.ones(3, dtype=torch.int32)], o)
        pg.set_algorithm("gather", "native")
        outs = [[torch.empty(2), torch.empty(2)]] if pg.rank() == 0 else []
        with pytest.raises(ValueError, match="NCCL has no gather of its own"):
            pg.gather(outs, [torch.ones(2)], dist.GatherOptions())
        # a ring of int16 (which NCCL cannot reduce) is fine: ringcomm reduces locally
        pg.set_algorithm("allreduce", "ring")
        t = torch.ones(3, dtype=torch.int16)
        pg.allreduce([t]).wait()
        assert t.tolist() == [2, 2, 2]
        return {k: lib.calls[k] - before.get(k, 0) for k in ("allReduce", "reduce", "send")}

    enqueued = nccl_groups(2, body, lib=lib)
    assert all(d["allReduce"] == 0 and d["reduce"] == 0 for d in enqueued)


def test_cpu_tensors_without_mpi_name_the_reason():
    pg = ProcessGroupRingcomm(0, 1, None, timedelta(seconds=5), store=dist.HashStore(),
                              cpu_error="ImportError: libmpi.so not found")
    with pytest.raises(ValueError, match="libmpi.so not found.*pip install mpich"):
        pg.allreduce([torch.ones(2)])
    pg.shutdown()


def test_a_missing_cupy_names_the_extra_to_install(monkeypatch):
    # as on a machine without CuPy, whether or not this one has it
    monkeypatch.setattr(nccl, "_lib", None)
    monkeypatch.setattr(nccl, "_lib_error", "CuPy is not usable here (ImportError: no cupy)")
    pg = ProcessGroupRingcomm(0, 1, None, timedelta(seconds=5), store=dist.HashStore(),
                              cpu_error="unused", nccl_device_type="cpu")
    with pytest.raises(ValueError, match=r"ringcomm\[cuda12\].*ringcomm\[cuda13\]"):
        pg.allreduce([torch.ones(2)])
    pg.shutdown()


def test_a_collective_past_the_timeout_aborts_and_later_calls_fail_at_once():
    lib = FakeNccl()

    def body(pg):
        if pg.rank() == 1:
            pg.allreduce([torch.ones(2)]).wait()  # set-up: both ranks
            time.sleep(4)  # misses the next collective, but stays alive
            return None
        pg.allreduce([torch.ones(2)]).wait()
        start = time.monotonic()
        o = dist.AllreduceOptions()
        o.timeout = timedelta(seconds=1)
        # enqueued, as on a GPU: pending until the watchdog gives up on it
        work = pg.allreduce([torch.ones(2)], o)
        pending = not work.is_completed()
        with pytest.raises(dist.DistBackendError, match=r"allreduce\[\w+\] timed out after 1s"):
            work.wait()
        took = time.monotonic() - start
        start = time.monotonic()
        with pytest.raises(dist.DistBackendError, match="unusable after an earlier failure"):
            pg.broadcast([torch.ones(2)], dist.BroadcastOptions())
        return took, time.monotonic() - start, pending

    took, then, pending = nccl_groups(2, body, lib=lib, timeout_s=20)[0]
    assert pending and took < 3 and then < 0.5
    assert lib.calls["abort"] >= 1


def test_consistency_check_runs_over_the_nccl_path(monkeypatch):
    monkeypatch.setenv("RINGCOMM_DEBUG", "DETAIL")

    def body(pg):
        n = 4 if pg.rank() == 0 else 5
        with pytest.raises(dist.DistBackendError, match="collective mismatch"):
            pg.allreduce([torch.ones(n)])

    nccl_groups(2, body)


def test_unique_id_survives_the_store_in_every_cupy_form():
    raw = bytes(range(128))
    signed = tuple(x - 256 if x > 127 else x for x in raw)  # CuPy 13, x86-64
    unsigned = tuple(raw)  # CuPy 13 where char is unsigned (aarch64)
    for uid in (raw, signed, unsigned):
        assert nccl.decode_id(nccl.encode_id(uid)) == uid


def test_nccl_version_strings():
    class Lib:
        def __init__(self, code):
            self.code = code

        def get_version(self):
            return self.code

    assert nccl.version(Lib(22703)) == "2.27.3"
    assert nccl.version(Lib(2804)) == "2.8.4"


def _python(code: str, path: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, ROOT]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_import_works_without_cupy_and_never_loads_it(tmp_path):
    out = _python("""
        import sys, ringcomm, torch.distributed as dist
        assert "ringcomm" in dist.Backend.backend_list
        assert not any(m == "cupy" or m.startswith("cupy.") for m in sys.modules)
        from ringcomm.transport import nccl
        try:
            nccl.load()
        except nccl.NcclUnavailable as e:
            print("unavailable:", e)
        else:
            print("available")
    """, str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "available" in out.stdout


@pytest.mark.parametrize("given,want", [(None, "1"), ("0", "0")])
def test_nccl_is_told_to_launch_in_issue_order_unless_the_user_says(tmp_path, given, want):
    # kernels of several communicators run at once on one GPU (channels, pair
    # communicators): NCCL >= 2.26 then needs NCCL_LAUNCH_ORDER_IMPLICIT=1, set
    # before NCCL reads its settings
    env = {} if given is None else {"NCCL_LAUNCH_ORDER_IMPLICIT": given}
    out = _python(f"""
        import os
        os.environ.pop("NCCL_LAUNCH_ORDER_IMPLICIT", None)
        os.environ.update({env!r})
        from ringcomm.transport import nccl
        try:
            nccl.load()
        except nccl.NcclUnavailable:
            pass
        print("value:", os.environ.get("NCCL_LAUNCH_ORDER_IMPLICIT"))
    """, str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert f"value: {want}" in out.stdout, out.stdout


@pytest.mark.parametrize("nccl_loads", [False, True])
def test_import_with_a_cupy_that_does_or_does_not_load_nccl(tmp_path, nccl_loads):
    pkg = tmp_path / "cupy" / "cuda"
    pkg.mkdir(parents=True)
    (tmp_path / "cupy" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "nccl.py").write_text(f"available = {nccl_loads}\n")
    out = _python("""
        import ringcomm
        from ringcomm.transport import nccl
        try:
            print("loaded", nccl.load().__name__)
        except nccl.NcclUnavailable as e:
            print("refused", e)
    """, str(tmp_path))
    assert out.returncode == 0, out.stderr
    if nccl_loads:
        assert "loaded cupy.cuda.nccl" in out.stdout
    else:
        assert "refused" in out.stdout and "cannot load the NCCL library" in out.stdout
        assert "ringcomm[cuda12]" in out.stdout


@pytest.mark.parametrize("size", [2, 3])
def test_gather_into_one_tensor_as_torch_2_15_calls_it(size):
    # torch 2.15's dist.gather_single calls ProcessGroup.gather_single(output, input, opts)
    def body(pg):
        me, root = pg.rank(), size - 1
        x = torch.arange(4.0) + 10 * me
        out = torch.empty(size, 4) if me == root else torch.empty(0)
        o = dist.GatherOptions()
        o.rootRank = root
        pg.gather_single(out, x, o).wait()
        if me == root:
            with pytest.raises(ValueError, match="output has 5 elements, expected"):
                pg.gather_into_tensor(torch.empty(5), x, o)
        return out

    want = torch.stack([torch.arange(4.0) + 10 * r for r in range(size)])
    assert torch.equal(nccl_groups(size, body)[size - 1], want)


@pytest.mark.parametrize("size", [2, 3])
def test_synchronous_calls_through_torchs_functions_on_the_device_lane(size):
    """dist.all_reduce and dist.barrier as a training loop calls them, synchronous and
    again and again: from the second call of a shape the group's short path takes
    them, which hands the device lane's engine a synchronous call as it hands the
    CPU lane's (the stand-in world: torch's functions over FakeNccl). Sums against
    the oracle; an asynchronous call between them too."""
    from ringcomm.testing import nccl_world

    def body(rank: int):
        t = torch.full((8,), float(rank + 1))
        got = []
        for step in range(4):
            t.fill_(float(rank + 1 + step))
            dist.all_reduce(t)
            got.append(t.clone())
            dist.barrier()
        w = torch.ones(3) * rank
        dist.all_reduce(w, async_op=True).wait()
        return got, w

    total = sum(range(1, size + 1))
    for got, w in nccl_world(size, body):
        assert [g.tolist() for g in got] == [[float(total + size * s)] * 8 for s in range(4)]
        assert w.tolist() == [float(sum(range(size)))] * 3
