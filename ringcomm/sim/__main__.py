"""``python -m ringcomm.sim``: see :mod:`ringcomm.sim.cli`."""
import sys

from ringcomm.sim.cli import main

sys.exit(main())
