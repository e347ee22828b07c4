"""``python -m meshtorch``: the command line (see :mod:`meshtorch.cli`)."""

import sys

from meshtorch.cli import main

sys.exit(main())
