#!/usr/bin/env python3
"""Compare collective algorithms side by side: the entry point of
:mod:`ringcomm.bench` as a script (the same as ``python -m ringcomm.bench``).

    mpiexec -n 2 python scripts/compare_collectives.py -b 4 -e 64M -f 2 -c
    torchrun --nproc-per-node 2 scripts/compare_collectives.py -b 4 -e 64M

See docs/benchmarks.md for the flags and the output.
"""
import sys

from ringcomm.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
