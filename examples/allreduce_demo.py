"""The same unchanged script under both launchers:

    mpiexec -n 4 python examples/allreduce_demo.py
    torchrun --nproc-per-node 4 examples/allreduce_demo.py
"""
import sys

import ringcomm.demo

if __name__ == "__main__":
    sys.exit(ringcomm.demo.main())
