"""``python -m ringcomm.trace merge OUT IN...``: see :mod:`ringcomm.trace`."""
import sys

from ringcomm.trace import main

sys.exit(main())
