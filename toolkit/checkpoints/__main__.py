"""``python -m toolkit.checkpoints DIR [--verify]``: see :mod:`toolkit.checkpoints`."""

from toolkit.checkpoints._folder import main

raise SystemExit(main())
