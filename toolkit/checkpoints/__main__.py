"""``python -m toolkit.checkpoints DIR [--verify]``: see :mod:`toolkit.checkpoints`."""

from toolkit.checkpoints._cli import main

raise SystemExit(main())
