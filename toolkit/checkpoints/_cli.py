"""The shell tool of ``python -m toolkit.checkpoints``: list or verify a checkpoint folder."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from toolkit.checkpoints._folder import CheckpointInfo, _info, list_checkpoints, read_pointer
from toolkit.checkpoints._manifest import MANIFEST
from toolkit.checkpoints._retention import Retention, retain

__all__ = ["main"]


def _size(size: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _kept_by(infos: Sequence[CheckpointInfo], rules: Retention | None) -> dict[str, str]:
    readable = [(c.name, c.step, c.metrics) for c in infos if c.step is not None]
    # Without recorded rules only the newest is known to be kept.
    reasons = retain(readable, rules or Retention(keep_last=0))
    other = "-" if rules is None else "none (pruned at the next save)"
    return {name: ", ".join(why) or other for name, why in reasons.items()}


def _row(c: CheckpointInfo, kept: dict[str, str]) -> list[str]:
    saved = "-" if c.time is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.time))
    metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(c.metrics.items())) or "-"
    step, size = ("-", "-") if c.step is None else (str(c.step), _size(c.size))
    check = ("ok" if c.intact else "DAMAGED") + (", model-only" if c.model_only else "")
    check += ", trainable only" if c.trainable_only else ""
    return [step, c.name, saved, size, metrics, kept.get(c.name, "-"), check]


def _table(infos: Sequence[CheckpointInfo], rules: Retention | None) -> None:
    kept = _kept_by(infos, rules)
    rows = [["step", "name", "saved", "size", "metrics", "kept by", "check"]]
    rows += [_row(c, kept) for c in infos]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for c, row in zip([None, *infos], rows):
        cells = [row[0].rjust(widths[0])] + [cell.ljust(w) for cell, w in zip(row[1:], widths[1:])]
        print("  ".join(cells).rstrip())
        for problem in c.problems if c else ():
            print(f"    {problem}")


def main(argv: Sequence[str] | None = None) -> int:
    """List (and with ``--verify`` check) the checkpoints of a folder; see the module docs.

    Args:
        argv: the command-line arguments (``sys.argv[1:]`` when ``None``).

    Returns:
        The exit status: 0 fine, 1 damage found by ``--verify``, 2 no such folder.

    Raises:
        SystemExit: from argparse, on bad arguments (status 2).

    Example:
        >>> import torch
        >>> from toolkit import TrainState, save_checkpoint
        >>> from toolkit.checkpoints import main
        >>> _ = save_checkpoint(TrainState(model=torch.nn.Linear(1, 1)), "ckpt/step_000000")
        >>> main(["ckpt", "--verify"])  # doctest: +ELLIPSIS
        ckpt: 1 checkpoint, ... KiB
        step  name         saved ...  kept by  check
           0  step_000000  ...        newest   ok
        checked: manifests, sizes, checksums and contents
        0
    """
    parser = argparse.ArgumentParser(
        prog="python -m toolkit.checkpoints",
        description="List the checkpoints of a folder (step, time, size, metrics, which "
        "retention rule keeps each); --verify also checks every file's checksum and content.",
    )
    parser.add_argument("dir", type=Path, help="a folder of checkpoints, or one checkpoint")
    parser.add_argument("--verify", action="store_true", help="check as a load does")
    args = parser.parse_args(argv)
    root: Path = args.dir
    if not root.is_dir():
        print(f"{root}: no such folder", file=sys.stderr)
        return 2
    one = (root / MANIFEST).is_file()  # one checkpoint folder
    infos = [_info(root, args.verify)] if one else list_checkpoints(root, checksums=args.verify)
    pointer, names = (None, []) if one else (read_pointer(root), [p.name for p in root.iterdir()])
    leftovers = sorted(n for n in names if n.startswith((".tmp-", ".old-", ".del-")))
    plural = "" if len(infos) == 1 else "s"
    head = f"{root}: {len(infos)} checkpoint{plural}, {_size(sum(c.size for c in infos))}"
    print(head + (f"; latest: {pointer.name}" if pointer is not None else ""))
    rules, source = next(((c.rules, c.name) for c in reversed(infos) if c.rules), (None, ""))
    if rules is not None:
        print(f"retention (recorded by {source}): {rules.describe()}")
    checked = "manifests, sizes, checksums and contents" if args.verify else "manifests and sizes"
    if infos:
        _table(infos, rules)
    print(f"checked: {checked}" + ("" if args.verify else " (--verify: also checksums, contents)"))
    for name in leftovers:
        print(f"leftover of an interrupted save or prune: {name} (clean_temporaries removes it)")
    damaged = sum(not c.intact for c in infos)
    if damaged:
        print(f"{damaged} of {len(infos)} checkpoint{plural} damaged")
    return 1 if args.verify and damaged else 0
