"""``python -m lab ...`` runs the lab's command line."""

import sys

from .cli import main

sys.exit(main(sys.argv[1:]))
