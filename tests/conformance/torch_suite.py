"""torch's own distributed test suite, ``DistributedTest._DistTestBase`` (the suite
gloo, nccl and mpi run), against ringcomm: one spawned process per rank.

Not collected by a plain ``pytest`` run (its name does not start with ``test_``):
``make conformance`` runs all of it through ``scripts/conformance.py``, and
``tests/test_conformance.py`` runs the part that fits CI's time.

Environment (set here when absent): ``BACKEND=ringcomm``, ``WORLD_SIZE=3``,
``TEMP_DIR`` (a fresh directory; spawned ranks inherit it).

The suite gates some tests on backend names rather than on what a backend does.
Where ringcomm does what the gate stands for on CPU tensors, the gate is opened
for it: :data:`GATES` lists each one (the suite's text, and how many times it
must appear, so a torch upgrade that changes a gate fails here loudly instead of
silently skipping). Tests that need something torch itself offers only to gloo
are named in :data:`NOT_FOR_RINGCOMM` with the reason.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import unittest

os.environ.setdefault("BACKEND", "ringcomm")
os.environ.setdefault("WORLD_SIZE", "3")
if "TEMP_DIR" not in os.environ:
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="ringcomm-conformance-")

import ringcomm  # noqa: E402,F401  (registers the backend in every spawned rank)
from torch.testing._internal import common_distributed  # noqa: E402

SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"

#: (the suite's text, what it becomes, how many times it appears)
GATES = [
    # require_backend_is_available({... "gloo" ...}): what gloo offers on CPU
    ("    if BACKEND not in backends:\n",
     "    if BACKEND not in backends and not (BACKEND == 'ringcomm' and 'gloo' in backends):\n",
     1),
    # all_to_all and all_to_all_single on CPU tensors
    ('BACKEND != "mpi", "Only MPI supports CPU all_to_all_single"',
     'BACKEND not in ("mpi", "ringcomm"), "Only MPI supports CPU all_to_all_single"', 8),
    ('BACKEND != "mpi", "Only MPI supports all_to_all"',
     'BACKEND not in ("mpi", "ringcomm"), "Only MPI supports all_to_all"', 4),
    # batch_isend_irecv on CPU tensors
    ('BACKEND != "gloo", "GLOO Batch Send Recv CPU"',
     'BACKEND not in ("gloo", "ringcomm"), "GLOO Batch Send Recv CPU"', 2),
    # per-call timeouts
    ('BACKEND != "gloo", "Only gloo backend supports timeouts"',
     'BACKEND not in ("gloo", "ringcomm"), "Only gloo backend supports timeouts"', 4),
    # Work.get_future()
    ('BACKEND != "mpi" and BACKEND != "nccl" and BACKEND != "gloo",',
     'BACKEND not in ("mpi", "nccl", "gloo", "ringcomm"),', 5),
    # the CPU module of the no_sync tests (a branch inside the test, by name)
    ('            if BACKEND == "mpi" or BACKEND == "gloo":\n',
     '            if BACKEND in ("mpi", "gloo", "ringcomm"):\n', 1),
    # DistributedDataParallel on CPU
    ('BACKEND != "nccl" and BACKEND != "gloo",\n            "Only Nccl & Gloo backend support '
     'DistributedDataParallel"',
     'BACKEND not in ("nccl", "gloo", "ringcomm"),\n            "Only Nccl & Gloo backend '
     'support DistributedDataParallel"', 2),
]

#: the torch whose suite the counts in GATES are those of
GATES_TORCH = "2.13"

#: tests a gate above opens that ringcomm cannot pass, and why
NOT_FOR_RINGCOMM = {
    name: "torch implements monitored_barrier for gloo only (dist.monitored_barrier refuses "
          "other backends by name)"
    for name in ("test_monitored_barrier_failure_order", "test_monitored_barrier_gloo",
                 "test_monitored_barrier_gloo_rank_0_timeout",
                 "test_monitored_barrier_gloo_subgroup", "test_monitored_barrier_wait_all_ranks",
                 "test_monitored_barrier_allreduce_hang",
                 "test_monitored_barrier_allreduce_hang_wait_all_ranks")
}


def _load_suite():
    """Import the suite's module with :data:`GATES` applied to its source."""
    if SUITE_MODULE in sys.modules:
        return sys.modules[SUITE_MODULE]
    spec = importlib.util.find_spec(SUITE_MODULE)
    source = open(spec.origin).read()
    # the counts are those of the torch the suite's results are recorded on; another
    # torch's suite may gate fewer or more tests, but every gate must still be there
    import torch

    recorded = torch.__version__.startswith(GATES_TORCH + ".")
    for old, new, count in GATES:
        found = source.count(old)
        if found != count if recorded else not found:
            raise RuntimeError(f"torch's distributed_test has {found} of the gate {old!r}, "
                               f"expected {count if recorded else 'some'}: update GATES in "
                               f"{__file__}")
        source = source.replace(old, new)
    module = importlib.util.module_from_spec(spec)
    sys.modules[SUITE_MODULE] = module
    # dont_inherit: this file's "from __future__ import annotations" must not turn the
    # suite's annotations into strings (DDP checks a comm hook's annotation)
    exec(compile(source, spec.origin, "exec", dont_inherit=True), module.__dict__)
    return module


# ringcomm has what these feature sets stand for on CPU tensors; the suite's
# decorators read them when its module is imported.
for feature in ("subgroup", "ddp", "plugin"):
    common_distributed.DistTestCases.backend_feature[feature].add("ringcomm")
_suite = _load_suite()

from torch.testing._internal.common_utils import run_tests  # noqa: E402


class TestDistBackendWithSpawn(_suite.TestDistBackend, _suite.DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


for _name, _why in NOT_FOR_RINGCOMM.items():
    setattr(TestDistBackendWithSpawn, _name,
            unittest.skip(_why)(getattr(TestDistBackendWithSpawn, _name)))


if __name__ == "__main__":
    run_tests()
