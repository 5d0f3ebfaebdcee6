"""``python -m ringcomm.trace merge OUT IN...``: see :mod:`ringcomm.trace`."""
import sys

from ringcomm.trace.merging import main

sys.exit(main())
