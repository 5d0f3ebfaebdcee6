"""torch's backend contract on ringcomm, on whichever torch runs the tests
(``make test-compat`` runs these on the newest and the oldest supported torch):
``_get_backend`` and its flags, ``batch_isend_irecv``, ``split_group``,
``set_timeout``, ``get_error``, another backend's ``pg_options`` and
``device_id`` against gloo on the same torch (tests/ranks/contract_check.py); the
backend found by name, without ``import ringcomm``; an NCCL lane connected and
bound by ``device_id`` over the NCCL stand-in; refusals of bad input."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch

from conftest import ROOT, _env, assert_checks, mpirun, torchrun

pytestmark = pytest.mark.compat


# torchrun's launch in make test; mpiexec's in make test-wide (make test's time)
@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.wide),
                               pytest.param(3, marks=pytest.mark.wide)])
def test_contract_matches_gloo_mpiexec(n):
    out = mpirun(n, "contract_check.py", timeout=180).stdout
    assert_checks(out, f"contract_check mpiexec n={n}", n)


def test_contract_matches_gloo_torchrun():
    out = torchrun(2, "contract_check.py", timeout=180).stdout
    assert_checks(out, "contract_check torchrun n=2", 2)


def test_device_id_binds_the_group():
    # torch >= 2.15 takes a CPU device_id; older torch refuses it for every
    # backend, which the program checks is what happened
    out = mpirun(2, "contract_check.py", "device_id", timeout=180).stdout
    assert_checks(out, "contract_check device_id n=2", 2)
    assert "init_process_group(device_id=cpu:0)" in out


def _fresh(code: str) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter that never imports ringcomm itself."""
    env = _env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29561"})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT / "tests",
                          env=env, capture_output=True, text=True, timeout=120)


BY_NAME = """
    import sys, torch, torch.distributed as dist
    dist.init_process_group("ringcomm")
    assert "ringcomm" in sys.modules, "ringcomm was not loaded"
    t = torch.ones(3)
    dist.all_reduce(t)
    assert dist.get_backend() == "ringcomm" and t.tolist() == [1.0, 1.0, 1.0]
    print("by name: ok", type(dist.group.WORLD).__name__)
    dist.destroy_process_group()
"""


def test_backend_found_by_name_without_import():
    """torch >= 2.15 loads a backend it does not know from the entry-point group
    ``torch.distributed.backends``: ringcomm's (pyproject.toml) registers it.
    Older torch has no such group: there ``import ringcomm`` stays needed, and the
    name is refused as unknown."""
    proc = _fresh(BY_NAME)
    if torch.__version__ >= "2.15":
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "by name: ok ProcessGroupRingcomm" in proc.stdout
    else:
        assert proc.returncode != 0 and "ringcomm" in proc.stderr.lower(), proc.stderr[-2000:]


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="torch.distributed.backends") if e.name == "ringcomm"]
    assert len(found) == 1, found
    registrar = found[0].load()
    assert callable(registrar)
    registrar()  # idempotent: ringcomm registered itself when it was imported
    import torch.distributed as dist
    assert "RINGCOMM" in dist.Backend._plugins


def test_device_id_connects_and_binds_the_nccl_lane():
    """``eager_connect_single_device`` (torch calls it for ``device_id``) makes the
    NCCL communicators at once, on every rank, and binds the group; a bound group's
    barrier and collectives then run on that lane (over the NCCL stand-in, CPU
    tensors taking the NCCL path)."""
    import threading

    from ringcomm.testing import FakeNccl, nccl_groups

    made: list[int] = []
    lock = threading.Lock()

    class Counting(FakeNccl):
        def NcclCommunicator(self, ndev, uid, rank):  # noqa: N802
            with lock:
                made.append(rank)
            return super().NcclCommunicator(ndev, uid, rank)

    lib = Counting()

    def body(pg):
        dev = torch.device("cpu", 0)
        pg._get_backend(dev).eager_connect_single_device(dev)
        assert pg.bound_device_id == dev
        with lock:
            mine = made.count(pg.rank())
        opts = torch.distributed.BarrierOptions()
        opts.device = pg.bound_device_id
        pg.barrier(opts).wait()
        t = torch.full((6,), float(pg.rank() + 1))
        pg.allreduce([t]).wait()
        return mine, t.tolist()

    results = nccl_groups(3, body, lib=lib)
    assert all(mine == 1 for mine, _ in results), results  # made at the call, not later
    assert all(t == [6.0] * 6 for _, t in results), results


def test_contract_refuses_bad_input():
    from ringcomm.testing import nccl_groups

    def body(pg):
        for bad in (timedelta(0), timedelta(seconds=-3), 5):
            with pytest.raises(ValueError, match="positive"):
                pg.set_timeout(bad)
        with pytest.raises(RuntimeError, match="xpu"):
            pg._get_backend(torch.device("xpu"))
        with pytest.raises(ValueError, match="meta"):
            pg.eager_connect_single_device(torch.device("meta"))
        with pytest.raises(ValueError, match="distinct ranks"):
            pg.split_group([0, 0])
        pg.set_timeout(timedelta(seconds=7))
        assert pg.options._timeout == timedelta(seconds=7)

    nccl_groups(2, body)


def test_pg_options_of_another_backend_warn_and_bad_ones_raise():
    import torch.distributed as dist

    from ringcomm.front.contract import options_from_torch

    with pytest.warns(UserWarning, match="_Options are another backend's"):
        assert options_from_torch(dist.ProcessGroupGloo._Options()) is None
    with pytest.raises(TypeError, match="pg_options must be ringcomm.Options"):
        options_from_torch({"num_channels": 2})


def test_too_old_torch_fails_at_import_naming_both_versions():
    code = """
        import torch
        torch.__version__ = torch.torch_version.TorchVersion("2.6.0")
        import ringcomm
    """
    proc = _fresh(code)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "ImportError: ringcomm needs torch >= 2.7; this is torch 2.6.0", last
