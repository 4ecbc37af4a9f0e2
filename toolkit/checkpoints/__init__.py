"""Checkpoint folders: helpers for a folder of checkpoints, and a shell tool to inspect one.

    python -m toolkit.checkpoints runs/a/ckpt            # list: step, time, size, metrics,
                                                         # which retention rule keeps each
    python -m toolkit.checkpoints runs/a/ckpt --verify   # check as a load does (checksums,
                                                         # headers, trees); exit 1 on damage

``DIR`` may also be a single checkpoint folder. Exit status: 0 when fine (listing
reports damage found by the cheap checks but still exits 0), 1 when ``--verify`` found
damage, 2 when ``DIR`` does not exist or is not a folder.

The functions below are what the ``checkpoints`` plugin of :func:`toolkit.run` is built
on; :func:`toolkit.save_checkpoint` and :func:`toolkit.load_checkpoint` write and read one
checkpoint.
"""

from toolkit.checkpoints._codec import TreeError
from toolkit.checkpoints._folder import (
    POINTER,
    CheckpointInfo,
    clean_temporaries,
    latest_checkpoint,
    list_checkpoints,
    load_latest,
    main,
    prune_checkpoints,
    read_pointer,
    verify_checkpoint,
    write_pointer,
)
from toolkit.checkpoints._manifest import DamagedCheckpointError
from toolkit.checkpoints._retention import Retention, retain
from toolkit.checkpoints._save import save_in_background

__all__ = [
    "POINTER", "CheckpointInfo", "DamagedCheckpointError", "Retention", "TreeError",
    "clean_temporaries", "latest_checkpoint", "list_checkpoints", "load_latest", "main",
    "prune_checkpoints", "read_pointer", "retain", "save_in_background", "verify_checkpoint",
    "write_pointer",
]  # fmt: skip
