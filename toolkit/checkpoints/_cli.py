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


def _size(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    value = size / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _rules(infos: Sequence[CheckpointInfo]) -> tuple[Retention | None, str]:
    """The rules recorded by the newest checkpoint that recorded any, and its name."""
    for info in reversed(infos):
        if info.rules is not None:
            return info.rules, info.name
    return None, ""


def _kept_by(infos: Sequence[CheckpointInfo], rules: Retention | None) -> dict[str, str]:
    readable = [(c.name, c.step, c.metrics) for c in infos if c.step is not None]
    # Without recorded rules only the newest is known to be kept.
    reasons = retain(readable, rules or Retention(keep_last=0))
    if rules is None:
        return {name: "newest" if why else "-" for name, why in reasons.items()}
    return {
        name: ", ".join(why) or "none (pruned at the next save)" for name, why in reasons.items()
    }


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    right = {0}  # the step column
    return [
        "  ".join(
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ).rstrip()
        for row in rows
    ]


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
        checked: manifests, sizes and checksums
        0
    """
    parser = argparse.ArgumentParser(
        prog="python -m toolkit.checkpoints",
        description="List the checkpoints of a folder (step, time, size, metrics, which "
        "retention rule keeps each); --verify also checks every file's checksum.",
    )
    parser.add_argument("dir", type=Path, help="a folder of checkpoints, or one checkpoint")
    parser.add_argument(
        "--verify", action="store_true", help="check every checksum; exit 1 on damage"
    )
    args = parser.parse_args(argv)
    root: Path = args.dir
    if not root.is_dir():
        print(f"{root}: no such folder", file=sys.stderr)
        return 2
    if (root / MANIFEST).is_file():  # one checkpoint folder
        infos = [_info(root, checksums=args.verify)]
        pointer = None
        leftovers: list[str] = []
    else:
        infos = list_checkpoints(root, checksums=args.verify)
        pointer = read_pointer(root)
        leftovers = sorted(
            p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".old-", ".del-"))
        )
    total = sum(c.size for c in infos)
    plural = "" if len(infos) == 1 else "s"
    head = f"{root}: {len(infos)} checkpoint{plural}, {_size(total)}"
    if pointer is not None:
        head += f"; latest: {pointer.name}"
    print(head)
    rules, source = _rules(infos)
    if rules is not None:
        print(f"retention (recorded by {source}): {rules.describe()}")
    checked = "manifests, sizes and checksums" if args.verify else "manifests and sizes"
    if infos:
        kept = _kept_by(infos, rules)
        rows = [["step", "name", "saved", "size", "metrics", "kept by", "check"]]
        for c in infos:
            saved = time.localtime(c.time) if c.time is not None else None
            rows.append(
                [
                    "-" if c.step is None else str(c.step),
                    c.name,
                    "-" if saved is None else time.strftime("%Y-%m-%d %H:%M:%S", saved),
                    "-" if c.step is None else _size(c.size),
                    ", ".join(f"{k}={v:.4g}" for k, v in sorted(c.metrics.items())) or "-",
                    kept.get(c.name, "-"),
                    "ok" if c.intact else "DAMAGED",
                ]
            )
        lines = _table(rows)
        print(lines[0])
        for c, line in zip(infos, lines[1:]):
            print(line)
            for problem in c.problems:
                print(f"    {problem}")
    print(f"checked: {checked}" + ("" if args.verify else " (--verify also checks checksums)"))
    for name in leftovers:
        print(f"leftover of an interrupted save or prune: {name} (clean_temporaries removes it)")
    damaged = sum(not c.intact for c in infos)
    if damaged:
        print(f"{damaged} of {len(infos)} checkpoint{plural} damaged")
    return 1 if args.verify and damaged else 0
