"""``python -m meshtorch``."""

from meshtorch.cli import main

raise SystemExit(main())
