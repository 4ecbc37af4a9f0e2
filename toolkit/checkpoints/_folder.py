"""A folder of checkpoints: listing, verifying, the newest intact one, pointer, cleanup, pruning,
and the shell tool of ``python -m toolkit.checkpoints`` (:func:`main`).

The folder (e.g. ``runs/a/ckpt/``) holds one sub-folder per checkpoint (any visible name;
the checkpoints plugin uses ``step_000100``), a ``latest`` pointer file naming the newest,
and, after a crash, hidden leftovers: ``.tmp-<name>-<pid>-<hex>`` (a save that did not
finish: never loaded, removed by :func:`clean_temporaries`), ``.old-<name>-...`` (a
checkpoint being replaced by a new one of the same name: put back when the new one never
got its name) and ``.del-<name>-...`` (a pruned checkpoint not yet fully removed). The
checkpoints plugin's lock file ``.lock`` (one run per folder) is no leftover: it stays.
Everything here reads the disk (the manifests), never a memory of earlier calls, so it
gives the same answers after a restart.
"""

import argparse
import dataclasses
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from toolkit._checks import check, warn
from toolkit.checkpoints._files import fsync_dir, read_regular, replace_file, temp_name, write_bytes
from toolkit.checkpoints._load import content_problems, load_checkpoint
from toolkit.checkpoints._manifest import (
    MANIFEST,
    DamagedCheckpointError,
    file_problems,
    read_manifest,
    reduce_to_model,
)
from toolkit.checkpoints._retention import Retention, retain, retention_from_document
from toolkit.checkpoints._save import on_rank0
from toolkit.distributed._collectives import broadcast_text, groups_of
from toolkit.step._state import TrainState

POINTER = "latest"


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint folder as found on disk.

    Attributes:
        path: the checkpoint folder.
        step: the saved ``state.step``, or ``None`` when the manifest cannot be read.
        time: save time (seconds since the epoch), or ``None``.
        size: bytes of the files the manifest lists (0 when unreadable).
        metrics: the metrics recorded at save time.
        rules: the retention rules recorded at save time, or ``None``.
        problems: what is wrong with it (each line starts with a path); empty when intact
            as far as it was checked (see ``checksums`` of :func:`list_checkpoints`).
        model_only: retention's ``keep_full`` reduced it to the model (resume skips it).
        trainable_only: it holds the trainable parameters only (``trainable_only=True``).

    Example:
        >>> from pathlib import Path
        >>> from toolkit.checkpoints import CheckpointInfo
        >>> info = CheckpointInfo(Path("ckpt/step_1"), 1, 0.0, 10, {}, None, ())
        >>> info.name, info.intact
        ('step_1', True)
    """

    path: Path
    step: int | None
    time: float | None
    size: int
    metrics: Mapping[str, float]
    rules: Retention | None
    problems: tuple[str, ...]
    model_only: bool = False
    trainable_only: bool = False

    @property
    def name(self) -> str:
        """The folder's name."""
        return self.path.name

    @property
    def intact(self) -> bool:
        """True when no problem was found."""
        return not self.problems


def _info(folder: Path, checksums: bool, allow_nonfinite: bool = False) -> CheckpointInfo:
    try:
        manifest = read_manifest(folder)
    except (DamagedCheckpointError, ValueError) as error:  # ValueError: another format
        problems = getattr(error, "problems", (str(error),))
        return CheckpointInfo(folder, None, None, 0, {}, None, tuple(problems))
    problems = file_problems(manifest, checksums=checksums)
    if checksums and not problems:  # what a load checks beyond the files' bytes
        problems = content_problems(manifest, allow_nonfinite)
    rules = retention_from_document(manifest.rules) if manifest.rules is not None else None
    fields = (manifest.step, manifest.time, manifest.size, manifest.metrics, rules)
    flags = (manifest.model_only, manifest.frozen is not None)
    return CheckpointInfo(folder, *fields, tuple(problems), *flags)


def list_checkpoints(
    root: str | os.PathLike[str], *, checksums: bool = False
) -> list[CheckpointInfo]:
    """Every checkpoint folder in ``root``, oldest first, damaged ones included.

    A checkpoint folder is any visible sub-folder (hidden leftovers of interrupted saves
    are not checkpoints). Each is checked: the manifest, the listed files' presence and
    sizes, and with ``checksums=True`` their checksums (this reads every byte).

    Args:
        root: the folder of checkpoints; a missing folder has none.
        checksums: also verify every file's checksum.

    Returns:
        One :class:`CheckpointInfo` each, sorted by step (unreadable ones first), then name.

    Raises:
        NotADirectoryError: ``root`` exists and is not a folder.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, save_checkpoint
        >>> from toolkit.checkpoints import list_checkpoints
        >>> state = TrainState(model=torch.nn.Linear(1, 1))
        >>> for step in (1, 2):
        ...     _ = save_checkpoint(state.replace(step=step), f"ckpt/step_{step:06d}")
        >>> [(c.name, c.step, c.intact) for c in list_checkpoints("ckpt")]
        [('step_000001', 1, True), ('step_000002', 2, True)]
    """
    root = Path(root)  # iterdir raises NotADirectoryError for a file
    visible = [e for e in root.iterdir() if not e.name.startswith(".")] if root.exists() else []
    infos = [_info(e, checksums) for e in visible if e.is_dir() and not e.is_symlink()]
    return sorted(infos, key=lambda c: (-1 if c.step is None else c.step, c.name))


def verify_checkpoint(path: str | os.PathLike[str]) -> list[str]:
    """Check one checkpoint folder as a load does, without a template.

    The manifest, every listed file (a regular file inside the folder, its size and
    checksum), every safetensors header and JSON tree, the RNG states and TrainState's
    fields, and what the checkpoint says about itself (optimizer state against the saved
    parameters, steps, an EMA against the model, no NaN or inf in the model); a load then
    compares shapes, dtypes and hyperparameters with its template.

    Args:
        path: the checkpoint folder.

    Returns:
        The problems found, one line each starting with the path concerned; empty when
        the checkpoint is intact.

    Raises:
        Nothing for damage (it is returned); OSError only if ``path`` cannot be listed.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, save_checkpoint
        >>> from toolkit.checkpoints import verify_checkpoint
        >>> path = save_checkpoint(TrainState(model=torch.nn.Linear(1, 1)), "ckpt/step_000000")
        >>> verify_checkpoint(path)
        []
        >>> (path / "model.safetensors").write_bytes(b"oops")
        4
        >>> verify_checkpoint(path)  # doctest: +ELLIPSIS
        ['ckpt/step_000000/model.safetensors: 4 bytes, the manifest says ... (truncated)']
    """
    return list(_info(Path(path), checksums=True).problems)


def latest_checkpoint(
    root: str | os.PathLike[str], *, checksums: bool = True, allow_nonfinite: bool = False
) -> Path | None:
    """The newest intact full checkpoint of ``root`` (highest step; not a model-only one),
    warning about damaged newer ones.

    Args:
        root: the folder of checkpoints.
        checksums: verify checksums too (reads every byte of the newest intact one and of
            any newer damaged ones); with ``False`` only manifests and sizes are checked, and
            :func:`load_checkpoint` verifies the rest (see :func:`load_latest`).
        allow_nonfinite: a checkpoint whose model holds NaN or inf is intact (with
            ``checksums``; else it is damaged, as :func:`load_checkpoint` finds it).

    Returns:
        The folder's path, or ``None`` when ``root`` holds no intact checkpoint.

    Raises:
        NotADirectoryError: ``root`` exists and is not a folder.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, save_checkpoint
        >>> from toolkit.checkpoints import latest_checkpoint
        >>> state = TrainState(model=torch.nn.Linear(1, 1))
        >>> for step in (5, 10):
        ...     _ = save_checkpoint(state.replace(step=step), f"ckpt/step_{step:06d}")
        >>> latest_checkpoint("ckpt").name
        'step_000010'
    """
    found = [c for c in list_checkpoints(root) if not c.model_only]  # no resuming from those
    unknown = [c for c in found if c.step is None]  # warned first: each might be the newest
    for info in unknown + [c for c in reversed(found) if c.step is not None]:
        if info.intact and checksums:
            info = _info(info.path, True, allow_nonfinite)
        if info.intact:
            return info.path
        lines = "\n  ".join(info.problems)
        warn(f"checkpoint {info.path} is damaged and skipped:\n  {lines}", UserWarning)
    return None


def load_latest(
    root: str | os.PathLike[str], like: TrainState, *, objects: Mapping[str, Any] | None = None,
    rng: bool = True, allow_nonfinite: bool = False,
) -> tuple[TrainState, Path] | None:  # fmt: skip
    """Load the newest checkpoint of ``root`` that is intact, falling back past damaged ones.

    Rank 0 (or this process alone) picks the newest checkpoint whose every checksum is
    right (damaged ones are skipped with a warning naming their files) and sends its name
    to the other ranks of a data-parallel template, so that all load the same one. A
    checkpoint that does not fit the template is *not* skipped: that error is raised,
    since an older checkpoint would not fit either.

    Args:
        root: the folder of checkpoints.
        like: the template state (see :func:`load_checkpoint`).
        objects: extra stateful objects, as for :func:`load_checkpoint`.
        rng: restore the RNG states.
        allow_nonfinite: load a model holding NaN or inf (else such a checkpoint is
            skipped as damaged), as for :func:`load_checkpoint`.

    Returns:
        ``(state, path)`` of the checkpoint loaded, or ``None`` when ``root`` holds no
        checkpoint folder at all (a fresh start).

    Raises:
        DamagedCheckpointError: every full checkpoint in ``root`` is damaged (the newest
            one's problems; each was warned about).
        ValueError: the newest intact checkpoint does not fit the template, or ``root``
            holds model-only checkpoints only (``Retention.keep_full``).

    Example:
        >>> import torch
        >>> from toolkit import TrainState, save_checkpoint
        >>> from toolkit.checkpoints import load_latest
        >>> state = TrainState(model=torch.nn.Linear(1, 1))
        >>> _ = save_checkpoint(state.replace(step=3), "ckpt/step_000003")
        >>> loaded, path = load_latest("ckpt", like=state)
        >>> loaded.step, path.name
        (3, 'step_000003')
        >>> load_latest("empty", like=state) is None
        True
    """
    group = groups_of(like.model).everyone if isinstance(like, TrainState) else None
    # One rank picks, so that ranks cannot disagree.
    picked = on_rank0(group, "load_latest", _pick, root, allow_nonfinite)
    if not (choice := broadcast_text(picked or "", group)):
        return None
    path = Path(root) / choice
    loaded = load_checkpoint(path, like, objects=objects, rng=rng, allow_nonfinite=allow_nonfinite)
    return loaded, path


def _pick(root: str | os.PathLike[str], allow_nonfinite: bool) -> str:
    """The name of ``root``'s newest intact full checkpoint, "" for none; an error when
    ``root`` holds checkpoints but none of them will do."""
    found = latest_checkpoint(root, allow_nonfinite=allow_nonfinite)
    infos = list_checkpoints(root) if found is None else []
    full = [c.path for c in infos if not c.model_only]
    if full:  # each was damaged: the newest one's problems, checksums included
        raise DamagedCheckpointError(full[-1], _info(full[-1], True, allow_nonfinite).problems)
    fix = "Its checkpoints are model-only (keep_full removed their optimizer state)."
    check(not infos, "load_latest", "root", "a folder of full checkpoints", str(root), fix)
    return found.name if found else ""


def write_pointer(root: str | os.PathLike[str], checkpoint: str | os.PathLike[str]) -> Path:
    """Atomically point ``root/latest`` at ``checkpoint`` (a text file holding its name).

    Args:
        root: the folder of checkpoints.
        checkpoint: a checkpoint folder inside ``root`` (or its name).

    Returns:
        The pointer file's path.

    Raises:
        ValueError: ``checkpoint`` is not a folder directly inside ``root``.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, save_checkpoint
        >>> from toolkit.checkpoints import read_pointer, write_pointer
        >>> path = save_checkpoint(TrainState(model=torch.nn.Linear(1, 1)), "ckpt/step_000000")
        >>> write_pointer("ckpt", path).read_text()
        'step_000000\\n'
        >>> read_pointer("ckpt").name
        'step_000000'
    """
    root, name = Path(root), Path(checkpoint).name
    ok = (root / name).is_dir() and not name.startswith(".")
    check(ok, "write_pointer", "checkpoint", f"a checkpoint folder inside {root}", str(checkpoint))
    replace_file(root / POINTER, lambda temp: write_bytes(temp, f"{name}\n".encode()))
    return root / POINTER


def read_pointer(root: str | os.PathLike[str]) -> Path | None:
    """The checkpoint folder ``root/latest`` names, or ``None`` (no pointer, or a bad one).

    Args:
        root: the folder of checkpoints.

    Returns:
        ``root / name`` when the pointer holds a plain name; the folder may be damaged or
        pruned since: check it (the newest intact checkpoint is what
        :func:`latest_checkpoint` finds, whatever the pointer says).

    Raises:
        Nothing.

    Example:
        >>> from toolkit.checkpoints import read_pointer
        >>> read_pointer("nowhere") is None
        True
    """
    try:
        name = read_regular(Path(root) / POINTER, limit=4096).decode().strip()
    except (OSError, ValueError):  # UnicodeDecodeError, not a small regular file
        return None
    plain = name and name == os.path.basename(name) and not name.startswith(".")
    return Path(root) / name if plain else None


def clean_temporaries(root: str | os.PathLike[str]) -> list[Path]:
    """Remove what interrupted saves and prunes left in ``root``; call it before a run starts.

    ``.tmp-*`` (an unfinished save) and ``.del-*`` (an unfinished prune) are deleted, and so
    are ``.tmp-*`` files of an interrupted pointer update. An ``.old-<name>-*`` folder (a
    checkpoint being replaced) is renamed back to ``<name>`` when no ``<name>`` exists (the
    replacement never got its name), and deleted otherwise. Do not call it while a save
    into ``root`` may be running (e.g. from another process): it would delete that save's
    temporary folder.

    Args:
        root: the folder of checkpoints (a missing one has nothing to clean).

    Returns:
        The paths removed (restored ``.old-`` folders are not listed).

    Raises:
        OSError: a leftover could not be removed.

    Example:
        >>> from pathlib import Path
        >>> from toolkit.checkpoints import clean_temporaries
        >>> Path("ckpt/.tmp-step_000009-123-abcd1234").mkdir(parents=True)
        >>> [p.name for p in clean_temporaries("ckpt")]
        ['.tmp-step_000009-123-abcd1234']
    """
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for entry in sorted(root.iterdir()):
        leftover = re.fullmatch(r"\.(tmp|old|del)-(.*)-[^-]*-[^-]*", entry.name)  # see temp_name
        if leftover is None:
            continue
        if leftover[1] == "old" and not (root / leftover[2]).exists():
            os.rename(entry, root / leftover[2])  # the new one never got its name: put back
            continue
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        removed.append(entry)
    fsync_dir(root)
    return removed


def prune_checkpoints(
    root: str | os.PathLike[str], rules: Retention, *, dry_run: bool = False
) -> list[Path]:
    """Delete the checkpoints of ``root`` that no retention rule keeps; reduce old ones.

    The decision is :func:`retain` over the checkpoints whose manifest can be read (step
    and metrics from disk); folders with an unreadable manifest are never deleted. Call it
    only after a save succeeded. Each folder is first renamed to a hidden ``.del-`` name,
    so a prune cut short never leaves a half-deleted folder that looks like a checkpoint.
    With ``rules.keep_full``, kept intact checkpoints older than the ``keep_full`` newest
    full ones are then reduced to model-only (see :class:`Retention`; sharded ones stay).

    Args:
        root: the folder of checkpoints.
        rules: the retention rules.
        dry_run: only return what would be deleted.

    Returns:
        The checkpoint folders deleted (or that would be), oldest first.

    Raises:
        OSError: a folder could not be removed.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, save_checkpoint
        >>> from toolkit.checkpoints import Retention, prune_checkpoints
        >>> state = TrainState(model=torch.nn.Linear(1, 1))
        >>> for step in (1, 2, 3):
        ...     _ = save_checkpoint(state.replace(step=step), f"ckpt/step_{step:06d}")
        >>> [p.name for p in prune_checkpoints("ckpt", Retention(keep_last=2))]
        ['step_000001']
    """
    root = Path(root)
    readable = [(c, c.step) for c in list_checkpoints(root) if c.step is not None]
    keep = retain([(c.name, step, c.metrics) for c, step in readable], rules)
    doomed = [c.path for c, _ in readable if not keep[c.name]]
    if dry_run:
        return doomed
    for path in doomed:
        hidden = root / temp_name("del", path.name)
        os.rename(path, hidden)
        fsync_dir(root)
        shutil.rmtree(hidden)
    full = [c for c, _ in readable if keep[c.name] and c.intact and not c.model_only]
    for info in full[: -rules.keep_full] if rules.keep_full else ():  # oldest first
        reduce_to_model(info.path)
    return doomed


def _size(size: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _table(infos: Sequence[CheckpointInfo], rules: Retention | None) -> None:
    readable = [(c.name, c.step, c.metrics) for c in infos if c.step is not None]
    # Without recorded rules only the newest is known to be kept.
    reasons = retain(readable, rules or Retention(keep_last=0))
    other = "-" if rules is None else "none (pruned at the next save)"
    rows = [["step", "name", "saved", "size", "metrics", "kept by", "check"]]
    for c in infos:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.time or 0))
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(c.metrics.items())) or "-"
        step, size = ("-", "-") if c.step is None else (str(c.step), _size(c.size))
        check = ("ok" if c.intact else "DAMAGED") + (", model-only" if c.model_only else "")
        check += ", trainable only" if c.trainable_only else ""
        kept = (", ".join(reasons[c.name]) or other) if c.name in reasons else "-"
        rows.append([step, c.name, "-" if c.time is None else stamp, size, metrics, kept, check])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for problems, row in zip([(), *(c.problems for c in infos)], rows):
        cells = [row[0].rjust(widths[0])] + [cell.ljust(w) for cell, w in zip(row[1:], widths[1:])]
        print("  ".join(cells).rstrip())
        for problem in problems:
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
    what = "List the checkpoints of a folder (step, time, size, metrics, which retention rule "
    what += "keeps each); --verify also checks every file's checksum and content."
    parser = argparse.ArgumentParser(prog="python -m toolkit.checkpoints", description=what)
    parser.add_argument("dir", type=Path, help="a folder of checkpoints, or one checkpoint")
    parser.add_argument("--verify", action="store_true", help="check as a load does")
    args = parser.parse_args(argv)
    root: Path = args.dir
    if not root.is_dir():
        print(f"{root}: no such folder", file=sys.stderr)
        return 2
    one = any(os.path.lexists(root / n) for n in (MANIFEST, "model.safetensors", "sharded"))
    infos = [_info(root, args.verify)] if one else list_checkpoints(root, checksums=args.verify)
    pointer, names = (None, []) if one else (read_pointer(root), [p.name for p in root.iterdir()])
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
    for name in sorted(n for n in names if n.startswith((".tmp-", ".old-", ".del-"))):
        print(f"leftover of an interrupted save or prune: {name} (clean_temporaries removes it)")
    if POINTER in names and (pointer is None or pointer.name not in {c.name for c in infos}):
        print(f"{root / POINTER}: ignored, not a small file naming a checkpoint folder here")
    for name in sorted(n for n in names if (root / n).is_symlink() and n != POINTER):
        print(f"{root / name}: ignored, a symbolic link (checkpoints are folders inside {root})")
    damaged = sum(not c.intact for c in infos)
    if damaged:
        print(f"{damaged} of {len(infos)} checkpoint{plural} damaged")
    return 1 if args.verify and damaged else 0
