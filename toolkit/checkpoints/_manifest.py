"""manifest.json: what a checkpoint folder holds, and the checks that it is all there.

The manifest lists every file of the checkpoint with its size and xxh3-128 checksum, the
format name and version, the step and time, the metrics and retention rules given at save
time, the class of each saved object, the model's tied-tensor aliases, whether the model
is in the ``sharded/`` sub-folder (:mod:`._model_state`), how many ranks wrote it, the run's
``settings``, whether retention reduced it to model-only (``model_only``) and, for a
``trainable_only`` save, the fingerprint of the frozen parameters it lacks (``frozen``). A
component ``name`` is present when ``name.json`` is listed (with ``name.safetensors`` when
it holds tensors). It carries a checksum of its own content too, so a flipped bit in it is
caught like one in any other file. Files a manifest does not list are never opened.
"""

import dataclasses
import json
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from toolkit._checks import check
from toolkit.checkpoints._codec import TreeError, decode, encode
from toolkit.checkpoints._components import COMPONENTS
from toolkit.checkpoints._files import (
    CHECKSUM,
    checksum,
    fsync_dir,
    read_json,
    replace_file,
    write_json,
)
from toolkit.checkpoints._model_state import SHARDS
from toolkit.checkpoints._retention import retention_from_document

FORMAT = "toolkit-checkpoint"
VERSION = 2  # 2: no "components"; optimizer state through torch.distributed.checkpoint
MANIFEST = "manifest.json"
_SELF = f"manifest_{CHECKSUM}"


class DamagedCheckpointError(RuntimeError):
    """A checkpoint folder whose manifest or files do not match what was written.

    Attributes:
        path: the checkpoint folder.
        problems: one line per problem, each starting with the path of the file concerned.

    Example:
        >>> from pathlib import Path
        >>> from toolkit.checkpoints import DamagedCheckpointError
        >>> error = DamagedCheckpointError(Path("ckpt/step_1"), ["ckpt/step_1/x.json: missing"])
        >>> error.problems
        ('ckpt/step_1/x.json: missing',)
    """

    def __init__(self, path: Path, problems: list[str] | tuple[str, ...]) -> None:
        self.path = Path(path)
        self.problems = tuple(problems)
        lines = "\n  ".join(self.problems)
        super().__init__(
            f"checkpoint {self.path} is damaged ({len(self.problems)} problem(s)):\n  {lines}\n"
            "Load an earlier checkpoint; resume='latest' skips damaged ones."
        )


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The parsed manifest of one checkpoint folder (see the module docstring)."""

    path: Path
    step: int
    time: float
    metrics: Mapping[str, float]
    files: Mapping[str, Mapping[str, Any]]
    rules: Mapping[str, Any] | None = None
    classes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    sharded: bool = False
    world_size: int = 1
    mesh: Mapping[str, int] = dataclasses.field(default_factory=dict)  # the layout's sizes
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    model_only: bool = False
    frozen: str | None = None  # a trainable-only save's fingerprint of the frozen parameters

    @property
    def size(self) -> int:
        """Bytes of the files the manifest lists."""
        return sum(int(entry["size"]) for entry in self.files.values())

    def has(self, component: str) -> bool:
        """Whether the checkpoint holds ``component`` (e.g. ``"scheduler"``)."""
        return f"{component}.json" in self.files


def check_metrics(metrics: Any) -> dict[str, float]:
    """``metrics`` as a flat ``{str: float}``, or a ValueError saying what is wrong."""
    who, expected = "save_checkpoint", "a flat mapping of str to number, e.g. {'val/loss': 0.25}"
    check(isinstance(metrics, Mapping), who, "metrics", expected, type(metrics).__name__)
    for key, value in metrics.items():
        ok = isinstance(key, str) and type(value) in (int, float)
        fix = "Pass python floats, e.g. float(loss)."
        check(ok, who, f"metrics[{key!r}]", "a number under a str key", type(value).__name__, fix)
    return {key: float(value) for key, value in metrics.items()}


def _digest(document: Mapping[str, Any]) -> str:
    """The manifest's own checksum: of its canonical JSON without that checksum."""
    body = {k: v for k, v in document.items() if k != _SELF}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return xxhash.xxh3_128_hexdigest(text.encode())


def manifest_document(*, metrics: Mapping[str, float], **fields: Any) -> dict[str, Any]:
    """The JSON document of a manifest (``step``, ``time``, ``files``, ...), self-checksummed."""
    document = {"format": FORMAT, "version": VERSION, "checksum": CHECKSUM, **fields}
    document["metrics"] = encode(dict(metrics), "metrics")[0]  # NaN/inf become tags
    document[_SELF] = _digest(document)
    return document


def listing(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file under ``folder`` (``sharded/``'s too) with its size and checksum."""
    files = [file for file in sorted(folder.rglob("*")) if file.is_file()]
    found = {f.relative_to(folder).as_posix(): (f.stat().st_size, checksum(f)) for f in files}
    return {name: {"size": size, CHECKSUM: digest} for name, (size, digest) in found.items()}


# Only plain, visible .json/.safetensors names in the folder or its sharded/ (no manifest):
# no paths out of it, no other file kinds (the load path opens nothing but JSON and safetensors).
_NAME = re.compile(rf"({SHARDS}/)?(?!{re.escape(MANIFEST)}$)[^./\\][^/\\]*\.(json|safetensors)")


def _parsed(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    try:
        document = read_json(path)
    except (OSError, ValueError, RecursionError) as error:  # not JSON, or not a regular file
        what = "missing" if isinstance(error, FileNotFoundError) else f"unreadable ({error})"
        raise DamagedCheckpointError(folder, [f"{path}: {what}"]) from None
    what = "content does not match its own checksum (edited or corrupted)"
    if not isinstance(document, dict) or document.get(_SELF) != _digest(document):
        what = what if isinstance(document, dict) else "not a JSON object"
        raise DamagedCheckpointError(folder, [f"{path}: {what}"])
    kind = (document.get("format"), document.get("version"))
    if kind != (FORMAT, VERSION):
        raise ValueError(
            f"{path}: expected a {FORMAT!r} manifest of version {VERSION}, got {kind[0]!r} "
            f"version {kind[1]!r}; load it with the toolkit version that wrote it."
        )
    return document


def _fields(document: dict[str, Any]) -> dict[str, Any] | None:
    """The Manifest fields of a parsed document, or None when it is not of that shape."""
    names = [field.name for field in dataclasses.fields(Manifest)[1:]]
    fields = {name: document[name] for name in names if document.get(name) is not None}
    kinds = {"step": int, "files": dict, "aliases": dict, "classes": dict, "sharded": bool}
    kinds.update(world_size=int, model_only=bool, settings=dict, frozen=str, mesh=dict)
    try:
        metrics = decode(fields["metrics"], {}, "metrics")
        settings = decode(fields.get("settings", {}), {}, "settings")
        fields.update(time=float(fields["time"]), metrics=metrics, settings=settings)
        retention_from_document(fields.get("rules", {}))
        entries = fields["files"].values()
        ok = all(type(fields.get(k, t())) is t for k, t in kinds.items()) and fields["step"] >= 0
        ok = ok and all(type(value) in (int, float) for value in metrics.values())
        ok = ok and all(type(e["size"]) is int and type(e[CHECKSUM]) is str for e in entries)
        ok = ok and all(type(v) is str for v in fields.get("aliases", {}).values())
        ok = ok and all(type(v) is int for v in fields.get("mesh", {}).values())
        return fields if ok and type(fields.get("classes", {}).get("objects", {})) is dict else None
    except (TreeError, KeyError, TypeError, AttributeError, ValueError, RecursionError):
        return None


def step_of(folder: Path) -> int | None:
    """The step a checkpoint folder's name states, as the checkpoints plugin names them
    (``step_`` and six digits or more: ``step_000100`` is 100), else None."""
    named = re.fullmatch(r"step_(\d{6,})", folder.name)
    return int(named[1]) if named else None


def read_manifest(folder: str | os.PathLike[str]) -> Manifest:
    """Parse and check ``folder/manifest.json`` (not the files it lists).

    Raises:
        DamagedCheckpointError: the manifest is missing, unreadable or not of its shape.
        ValueError: it is another format, or another version than this toolkit reads.
    """
    folder = Path(folder)
    path, document = folder / MANIFEST, _parsed(folder)
    files = document["files"] if isinstance(document.get("files"), dict) else {}
    bad = [n for n in files if not (isinstance(n, str) and _NAME.fullmatch(n))]
    where = f"not a .json/.safetensors name in the folder (or in its {SHARDS}/ sub-folder)"
    problems = [f"{path}: lists {name!r}, {where}" for name in bad]
    fields = _fields(document)
    if fields is None:
        problems.append(f"{path}: not a manifest (step, time, files or metrics malformed)")
    elif step_of(folder) not in (None, fields["step"]):  # a step_000006 of step 10**30
        problems.append(f"{path}: step {fields['step']}, the folder's name {folder.name!r}")
    if problems:
        raise DamagedCheckpointError(folder, problems)
    return Manifest(path=folder, **fields)  # type: ignore[arg-type]


def verified_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of ``path`` after checking every file it lists (sizes and checksums)."""
    manifest = read_manifest(path)
    if problems := file_problems(manifest, checksums=True):
        raise DamagedCheckpointError(manifest.path, problems)
    return manifest


def file_problems(manifest: Manifest, *, checksums: bool = True) -> list[str]:
    """The listed files that are missing, of another size or (``checksums``) altered.

    Sizes are checked before checksums, so a truncated file is reported as such without
    reading it. With a sharded model, files in ``sharded/`` the manifest does not list
    are problems too (DCP's reader lists that folder).
    """
    folder, inside = manifest.path, manifest.path.resolve()
    listed = {folder / name: entry for name, entry in manifest.files.items()}
    found = ((path, _file_problem(path, e, inside, checksums)) for path, e in listed.items())
    problems = [f"{path}: {problem}" for path, problem in found if problem]
    unlisted = sorted(set((folder / SHARDS).glob("*")) - listed.keys()) if manifest.sharded else []
    planted = "not listed in the manifest (planted or left over); remove it"
    return problems + [f"{path}: {planted}" for path in unlisted]


def _file_problem(path: Path, entry: Mapping[str, Any], inside: Path, checksums: bool) -> str:
    """What is wrong with one listed file; "" when nothing."""
    if not path.resolve().is_relative_to(inside):  # a sharded/ that is a link
        return "leads outside the checkpoint folder (a symbolic link)"
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_size != entry["size"]:
        grown = "truncated" if info.st_size < entry["size"] else "grown"
        return f"{info.st_size} bytes, the manifest says {entry['size']} ({grown})"
    if checksums and (digest := checksum(path)) != entry[CHECKSUM]:  # read once
        return f"{CHECKSUM} checksum {digest}, the manifest says {entry[CHECKSUM]} (corrupted)"
    return ""


def reduce_to_model(folder: Path) -> bool:
    """Make a checkpoint model-only (see ``Retention.keep_full``); False when it cannot be.

    The manifest is rewritten first (atomically) to list only the model, ``state`` and
    ``extras`` files, then the other files are removed: a crash in between leaves files
    that no manifest lists, never a manifest listing a missing file. A sharded checkpoint
    (its model and optimizer share files) or a model-only one is left as it is.
    """
    document = _parsed(folder)
    if document.get("sharded") or document.get("model_only"):
        return False
    files, kept = document["files"], [c.name for c in COMPONENTS if c.model_only]
    document["files"] = {n: e for n, e in files.items() if n.split(".")[0] in kept}
    document["model_only"] = True
    document[_SELF] = _digest(document)
    replace_file(folder / MANIFEST, lambda temp: write_json(temp, document))
    for name in files.keys() - document["files"].keys():
        (folder / name).unlink(missing_ok=True)
    fsync_dir(folder)
    return True
