"""manifest.json: what a checkpoint folder holds, and the checks that it is all there.

The manifest lists every file of the checkpoint with its size and xxh3-128 checksum, the
format name and version, the step and time, the metrics and retention rules given at save
time, and one entry per component (model, optimizer, ...) with its ``kind``: ``"tensors"``
(a plain safetensors state dict) or ``"tree"`` (a JSON document plus, when it holds
tensors, a safetensors file; see :mod:`._codec`) or ``"dcp"`` (a sharded model whose
pieces are in the ``sharded/`` sub-folder, :mod:`._sharded`; added in format version 1
without a break: a reader refuses a kind it does not know, by name). A checkpoint written
by several ranks records ``world_size`` and one ``rank_NNNNN`` tree per rank after the
first (its RNG states and data position). The manifest carries a checksum of its own
content too, so a flipped bit in it is caught like one in any other file. Files a manifest
does not list are never opened.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from toolkit.checkpoints._codec import TreeError, decode, encode
from toolkit.checkpoints._files import CHECKSUM, checksum, read_json

__all__ = [
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "DamagedCheckpointError",
    "Manifest",
    "check_metrics",
    "file_problems",
    "manifest_document",
    "read_manifest",
]

FORMAT = "toolkit-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_SELF = f"manifest_{CHECKSUM}"
_SUFFIXES = (".json", ".safetensors")
_SUBFOLDERS = ("sharded",)  # the only sub-folder a manifest may list files in


class DamagedCheckpointError(RuntimeError):
    """A checkpoint folder whose manifest or files do not match what was written.

    Attributes:
        path: the checkpoint folder.
        problems: one line per problem, each starting with the path of the file concerned.

    Example:
        >>> from pathlib import Path
        >>> from toolkit.checkpoints import DamagedCheckpointError
        >>> problems = ["ckpt/step_1/manifest.json: missing"]
        >>> error = DamagedCheckpointError(Path("ckpt/step_1"), problems)
        >>> error.problems
        ('ckpt/step_1/manifest.json: missing',)
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
    """The parsed manifest of one checkpoint folder.

    Attributes:
        path: the checkpoint folder.
        step: ``state.step`` when it was saved.
        time: save time (seconds since the epoch).
        metrics: the ``metrics`` given to ``save_checkpoint`` (str -> float).
        rules: the retention rules recorded at save time (a dict), or ``None``.
        components: component name -> its entry (``kind``, files, class, ...).
        files: file name -> ``{"size": bytes, "xxh3_128": hex digest}``.
        world_size: how many ranks wrote it (1 for a single process).
    """

    path: Path
    step: int
    time: float
    metrics: Mapping[str, float]
    rules: Mapping[str, Any] | None
    components: Mapping[str, Mapping[str, Any]]
    files: Mapping[str, Mapping[str, Any]]
    world_size: int = 1

    @property
    def size(self) -> int:
        """Bytes of the files the manifest lists."""
        return sum(int(entry["size"]) for entry in self.files.values())


def check_metrics(metrics: Any) -> dict[str, float]:
    """``metrics`` as a flat ``{str: float}``, or a ValueError saying what is wrong."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ValueError(
            f"save_checkpoint: metrics must be a flat mapping of str to number, e.g. "
            f"{{'val/loss': 0.25}}; got {type(metrics).__name__}."
        )
    out = {}
    for key, value in metrics.items():
        if (
            not isinstance(key, str)
            or isinstance(value, bool)
            or not isinstance(value, (int, float))
        ):
            raise ValueError(
                f"save_checkpoint: metrics[{key!r}] must be a number under a str key; got "
                f"{type(value).__name__}. Pass python floats, e.g. float(loss)."
            )
        out[key] = float(value)
    return out


def _canonical(document: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in document.items() if k != _SELF}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def manifest_document(
    *,
    step: int,
    time: float,
    metrics: Mapping[str, float],
    rules: Mapping[str, Any] | None,
    components: Mapping[str, Mapping[str, Any]],
    files: Mapping[str, Mapping[str, Any]],
    world_size: int = 1,
) -> dict[str, Any]:
    """The JSON document of a manifest, with its own checksum."""
    encoded_metrics, _ = encode(dict(metrics), "metrics")  # NaN/inf become tags
    document: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "time": time,
        "metrics": encoded_metrics,
        "rules": dict(rules) if rules is not None else None,
        "checksum": CHECKSUM,
        "components": {name: dict(entry) for name, entry in components.items()},
        "files": {name: dict(entry) for name, entry in files.items()},
    }
    if world_size != 1:
        document["world_size"] = world_size
    document[_SELF] = xxhash.xxh3_128_hexdigest(_canonical(document))
    return document


def _bad_name(name: Any) -> bool:
    # Only plain, visible file names of the two formats: no paths out of the folder, no
    # other file kinds (nothing on the load path opens anything but JSON and safetensors).
    if isinstance(name, str) and name.count("/") == 1:
        folder, name = name.split("/")
        if folder not in _SUBFOLDERS:
            return True
    return (
        not isinstance(name, str)
        or name != os.path.basename(name)
        or name in ("", ".", "..", MANIFEST)
        or name.startswith(".")
        or "\\" in name
        or not name.endswith(_SUFFIXES)
    )


def read_manifest(folder: str | os.PathLike[str]) -> Manifest:
    """Parse and check ``folder/manifest.json`` (not the files it lists).

    Raises:
        DamagedCheckpointError: the manifest is missing, unreadable or inconsistent.
        ValueError: it is another format, or a version newer than this toolkit reads.
    """
    folder = Path(folder)
    path = folder / MANIFEST
    try:
        document = read_json(path)
    except FileNotFoundError:
        raise DamagedCheckpointError(folder, [f"{path}: missing"]) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DamagedCheckpointError(folder, [f"{path}: unreadable ({error})"]) from None
    if not isinstance(document, dict):
        raise DamagedCheckpointError(folder, [f"{path}: not a JSON object"])
    if document.get(_SELF) != xxhash.xxh3_128_hexdigest(_canonical(document)):
        raise DamagedCheckpointError(
            folder, [f"{path}: content does not match its own checksum (edited or corrupted)"]
        )
    if document.get("format") != FORMAT:
        raise ValueError(
            f"{path}: expected a manifest of format {FORMAT!r}, got "
            f"{document.get('format')!r}; this folder is not a toolkit checkpoint."
        )
    version = document.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise ValueError(
            f"{path}: checkpoint format version {version!r} is newer than the {VERSION} this "
            "toolkit reads; upgrade toolkit to load it."
        )
    problems = []
    step, time_ = document.get("step"), document.get("time")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        problems.append(f"{path}: 'step' is {step!r}, not an int >= 0")
    if not isinstance(time_, (int, float)) or isinstance(time_, bool):
        problems.append(f"{path}: 'time' is {time_!r}, not a number")
    files = document.get("files")
    if not isinstance(files, dict):
        problems.append(f"{path}: 'files' is not an object")
        files = {}
    for name, entry in files.items():
        if _bad_name(name):
            problems.append(
                f"{path}: lists {name!r}, not a .json/.safetensors name in the folder "
                f"(or in its {'/'.join(_SUBFOLDERS)}/ sub-folder)"
            )
        elif (
            not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or not isinstance(entry.get(CHECKSUM), str)
        ):
            problems.append(f"{path}: entry of {name!r} lacks an int 'size' or a '{CHECKSUM}'")
    components = document.get("components")
    if not isinstance(components, dict) or not all(
        isinstance(entry, dict) for entry in components.values()
    ):
        problems.append(f"{path}: 'components' is not an object of objects")
        components = {}
    for name, entry in components.items():
        for file in _component_files(entry):
            if file not in files:
                problems.append(f"{path}: component {name!r} uses {file!r}, which is not listed")
    try:
        metrics = decode(document.get("metrics") or {}, {}, "metrics")
    except (TreeError, KeyError, TypeError, AttributeError):
        problems.append(f"{path}: 'metrics' is not an object of numbers")
        metrics = {}
    if not isinstance(metrics, dict) or not all(
        isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool))
        for v in metrics.values()
    ):
        problems.append(f"{path}: 'metrics' is not an object of numbers")
        metrics = {}
    rules = document.get("rules")
    if rules is not None and not isinstance(rules, dict):
        problems.append(f"{path}: 'rules' is not an object")
        rules = None
    world = document.get("world_size", 1)
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        problems.append(f"{path}: 'world_size' is {world!r}, not an int >= 1")
        world = 1
    if problems:
        raise DamagedCheckpointError(folder, problems)
    assert isinstance(step, int) and isinstance(time_, (int, float))  # checked above
    return Manifest(
        path=folder,
        step=step,
        time=float(time_),
        metrics={k: float(v) for k, v in metrics.items()},
        rules=rules,
        components=components,
        files=files,
        world_size=world,
    )


def _component_files(entry: Mapping[str, Any]) -> list[str]:
    return [entry[key] for key in ("file", "json", "tensors") if isinstance(entry.get(key), str)]


def file_problems(manifest: Manifest, *, checksums: bool = True) -> list[str]:
    """The listed files that are missing, of another size or (``checksums``) altered.

    Each problem starts with the file's path. Sizes are checked before checksums, so a
    truncated file is reported as such without reading it.
    """
    problems = []
    for name, entry in manifest.files.items():
        path = manifest.path / name
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        if not stat.S_ISREG(info.st_mode):
            problems.append(f"{path}: not a regular file")
            continue
        if info.st_size != entry["size"]:
            problems.append(
                f"{path}: {info.st_size} bytes, the manifest says {entry['size']} "
                f"({'truncated' if info.st_size < entry['size'] else 'grown'})"
            )
            continue
        if checksums:
            digest = checksum(path)
            if digest != entry[CHECKSUM]:
                problems.append(
                    f"{path}: {CHECKSUM} checksum {digest}, the manifest says "
                    f"{entry[CHECKSUM]} (corrupted)"
                )
    return problems
