"""``python -m ringcomm.bench ...``: the same as ``scripts/compare_collectives.py``."""
import sys

from ringcomm.bench.cli import main

sys.exit(main(prog="python -m ringcomm.bench"))
