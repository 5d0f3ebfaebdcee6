"""The algorithm library (ringcomm/library) under real launchers, against gloo:
world sizes 2, 3 and 5 under mpiexec and 2 under torchrun, hierarchical on a real
multi-host layout (RINGCOMM_LOCAL_SIZE=2 under mpiexec on 3 and 5 ranks; on real
hosts in tests/test_multinode.py). One launch per case checks every
algorithm, op, dtype and size (tests/ranks/library_check.py); world sizes 1 and 4
are covered in-process (tests/test_library.py)."""
from __future__ import annotations

import pytest

from conftest import assert_checks, mpirun, torchrun

#: case -> (launcher, ranks, extra environment, expected host layout, options). Every
#: dtype under mpiexec; under torchrun, which adds only the launcher, two (--quick).
CASES = {
    "mpiexec n=2": (mpirun, 2, None, "none", ()),
    "mpiexec n=3 local_size=2": (mpirun, 3, {"RINGCOMM_LOCAL_SIZE": "2"}, "0,0,1", ()),
    "mpiexec n=5 local_size=2": (mpirun, 5, {"RINGCOMM_LOCAL_SIZE": "2"}, "0,0,1,1,2", ()),
    "torchrun n=2": (torchrun, 2, None, "none", ("--quick",)),
}


#: the cases make test leaves to make test-wide: 2 ranks under mpiexec and torchrun's 2
#: (mpiexec's 3 covers them) and 5 oversubscribed ranks (14 s here)
WIDE = ("mpiexec n=2", "mpiexec n=5 local_size=2", "torchrun n=2")


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.wide) if c in WIDE else c
                                  for c in CASES])
def test_library_against_gloo(case):
    launch, n, env, hosts, extra = CASES[case]
    out = launch(n, "library_check.py", "--hosts", hosts, *extra, timeout=240, env=env).stdout
    assert_checks(out, f"library_check {case}", n)
