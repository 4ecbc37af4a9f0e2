"""save_checkpoint and save_in_background: a TrainState as a folder of safetensors and JSON.

Layout of one checkpoint folder (every file listed, with size and checksum, in
``manifest.json``; see :mod:`toolkit.checkpoints._manifest`)::

    manifest.json
    model.safetensors                       unwrapped state dict, tied tensors stored once
    optimizer.json  [optimizer.safetensors] state keyed by parameter name, param groups
    scheduler.json  [scheduler.safetensors]
    scaler.json                             GradScaler state, when there is an enabled one
    state.json      [state.safetensors]     TrainState's other fields (step, window, ...)
    extras.json     [extras.safetensors]    state.extras (EMA weights, best scores, ...)
    rng.json         rng.safetensors        python, numpy, torch (and CUDA) RNG states
    objects.json    [objects.safetensors]   extra stateful objects given as objects=

A ``.safetensors`` file in brackets exists only when its tree holds tensors. JSON
documents follow :mod:`._codec`.

A data-parallel model (DDP or FSDP2; see :func:`group_of`) is saved by all
ranks of its group together. DDP: rank 0 writes the files above, and every other rank
``r`` adds ``rank_0000r.json``/``.safetensors`` (its RNG states and data position).
FSDP2 (a model with DTensor parameters): the model, the optimizer's tensors and DTensors
in ``extras`` go to ``sharded/`` instead (:mod:`._sharded`), one file per rank, and
``model.safetensors`` is absent. Either way rank 0 writes the manifest and renames the
folder once every rank has written its part.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from toolkit.checkpoints._codec import encode, host_tensor, separate_shared
from toolkit.checkpoints._files import (
    CHECKSUM,
    checksum,
    fsync_dir,
    new_token,
    temp_name,
    write_json,
    write_tensors,
)
from toolkit.checkpoints._manifest import MANIFEST, check_metrics, manifest_document
from toolkit.checkpoints._model_state import model_tensors
from toolkit.checkpoints._optim_names import named_state, parameter_names
from toolkit.checkpoints._retention import Retention
from toolkit.checkpoints._rng import capture_rng
from toolkit.checkpoints._sharded import SHARDS, is_dtensor, is_sharded, save_shards, template_state
from toolkit.distributed._collectives import Group, agree, broadcast_int, group_of, rank_of
from toolkit.step._components import check_objects, fields_of
from toolkit.step._state import TrainState

__all__ = ["MODEL_METADATA", "rank_component", "save_checkpoint", "save_in_background"]

# A model file opened by other tools (transformers, the hub) is expected to say "pt".
MODEL_METADATA = {"format": "pt"}


@dataclasses.dataclass(frozen=True)
class _Tree:
    """One tree component ready to write: its JSON document and CPU tensors."""

    document: Any
    tensors: dict[str, torch.Tensor]
    info: dict[str, Any]  # extra manifest entries (class names)


@dataclasses.dataclass(frozen=True)
class _Snapshot:
    """Everything a checkpoint holds, gathered in memory before any file is written."""

    step: int
    model: dict[str, torch.Tensor]
    aliases: dict[str, str]
    trees: dict[str, _Tree]
    metrics: dict[str, float]
    rules: dict[str, Any] | None
    shards: dict[str, torch.Tensor]  # keys -> tensors for sharded/ (FSDP2), else empty
    rank: _Tree  # this rank's RNG states and data position (written by ranks > 0)


def rank_component(rank: int) -> str:
    """The component (and file stem) of rank ``rank``'s own state in a multi-rank checkpoint."""
    return f"rank_{rank:05d}"


def _tree(
    tree: Any,
    root: str,
    copy: bool,
    *,
    shards: dict[str, torch.Tensor] | None = None,
    info: dict[str, Any] | None = None,
) -> _Tree:
    """Encode ``tree``; with ``shards`` (a sharded save), its DTensors go there instead."""
    if shards is None:
        document, tensors = encode(tree, root, copy=copy)
    else:
        document, tensors = encode(tree, root, copy=copy, external=is_dtensor)
        for name in [n for n, t in tensors.items() if is_dtensor(t)]:
            shards[name] = tensors.pop(name)
    return _Tree(document, tensors, info or {})


def _sharded_parts(
    state: TrainState, shards: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, _Tree]]:
    """FSDP2: the model's and the optimizer's tensors go to ``shards``; JSON stays."""
    if state.optimizer is not None:
        parameter_names(state.model, state.optimizer)  # the clear error for a stray tensor
    model_state, optimizer_state = template_state(state.model, state.optimizer)
    shards.update({f"model/{name}": value for name, value in model_state.items()})
    trees = {}
    if optimizer_state is not None:
        assert state.optimizer is not None
        document, tensors = encode(optimizer_state, "optimizer", external=lambda t: True)
        shards.update(tensors)
        info = {"class": type(state.optimizer).__name__}
        trees["optimizer"] = _Tree(document, {}, info)
    return {}, trees


def _snapshot(
    state: TrainState,
    objects: dict[str, Any],
    metrics: dict[str, float],
    rules: Retention | None,
    copy: bool,
) -> _Snapshot:
    who = "save_checkpoint"
    shards: dict[str, torch.Tensor] | None = None
    aliases: dict[str, str] = {}
    if is_sharded(state.model):
        shards = {}
        model, trees = _sharded_parts(state, shards)
    else:
        model, aliases = model_tensors(state.model, who)
        model = {name: host_tensor(value, copy) for name, value in model.items()}
        separate_shared(model)  # distinct views of one buffer (tied ones are aliases already)
        trees = {}
    if state.optimizer is not None and shards is None:
        trees["optimizer"] = _tree(
            named_state(state.model, state.optimizer),
            "optimizer",
            copy,
            info={"class": type(state.optimizer).__name__},
        )
    if state.scheduler is not None:
        trees["scheduler"] = _tree(
            state.scheduler.state_dict(),
            "scheduler",
            copy,
            info={"class": type(state.scheduler).__name__},
        )
    if state.scaler is not None and state.scaler.is_enabled():
        trees["scaler"] = _tree(
            state.scaler.state_dict(), "scaler", copy, info={"class": type(state.scaler).__name__}
        )
    trees["state"] = _tree(fields_of(state), "state", copy, shards=shards)
    trees["extras"] = _tree(dict(state.extras), "extras", copy, shards=shards)
    rng = capture_rng()
    trees["rng"] = _tree(rng, "rng", copy)
    if objects:
        trees["objects"] = _tree(
            {name: obj.state_dict() for name, obj in objects.items()},
            "objects",
            copy,
            shards=shards,
            info={"classes": {name: type(obj).__name__ for name, obj in objects.items()}},
        )
    own = {"rng": rng, "data_state": dict(state.data_state)}
    return _Snapshot(
        step=state.step,
        model=model,
        aliases=aliases,
        trees=trees,
        metrics=metrics,
        rules=rules.to_document() if rules is not None else None,
        shards=shards or {},
        rank=_tree(own, "rank", copy),
    )


def _entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, CHECKSUM: checksum(path)}


def _write_file(folder: Path, name: str, write: Any, files: dict[str, Any]) -> None:
    path = folder / name
    write(path)
    files[name] = _entry(path)


def _write_tree(
    folder: Path, name: str, tree: _Tree, files: dict[str, Any], components: dict[str, Any]
) -> None:
    entry: dict[str, Any] = {"kind": "tree", "json": f"{name}.json", **tree.info}
    _write_file(folder, f"{name}.json", lambda p: write_json(p, tree.document), files)
    if tree.tensors:
        entry["tensors"] = f"{name}.safetensors"
        _write_file(folder, f"{name}.safetensors", lambda p: write_tensors(p, tree.tensors), files)
    components[name] = entry


def _write_parts(snapshot: _Snapshot, folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write rank 0's files of the snapshot into ``folder``: ``(files, components)``."""
    files: dict[str, Any] = {}
    components: dict[str, Any] = {}
    if snapshot.shards:
        components["model"] = {"kind": "dcp", "folder": SHARDS, "prefix": "model/"}
    else:
        _write_file(
            folder,
            "model.safetensors",
            lambda p: write_tensors(p, snapshot.model, MODEL_METADATA),
            files,
        )
        components["model"] = {
            "kind": "tensors",
            "file": "model.safetensors",
            "aliases": snapshot.aliases,
        }
    for name, tree in snapshot.trees.items():
        _write_tree(folder, name, tree, files, components)
    return files, components


def _write_manifest(
    snapshot: _Snapshot,
    folder: Path,
    files: dict[str, Any],
    components: dict[str, Any],
    world_size: int = 1,
) -> None:
    document = manifest_document(
        step=snapshot.step,
        time=time.time(),
        metrics=snapshot.metrics,
        rules=snapshot.rules,
        components=components,
        files=files,
        world_size=world_size,
    )
    write_json(folder / MANIFEST, document)
    fsync_dir(folder)


def _write(snapshot: _Snapshot, folder: Path) -> None:
    """Write every file of the snapshot into the (new, empty) ``folder``; manifest last."""
    if snapshot.shards:
        save_shards(snapshot.shards, folder, None)
    files, components = _write_parts(snapshot, folder)
    if snapshot.shards:
        _add_shards(folder, files)
    _write_manifest(snapshot, folder, files, components)


def _add_shards(folder: Path, files: dict[str, Any]) -> None:
    shards = folder / SHARDS
    for name in sorted(os.listdir(shards)):
        files[f"{SHARDS}/{name}"] = _entry(shards / name)
    fsync_dir(shards)


def _publish(temp: Path, path: Path) -> None:
    """Give ``temp`` the name ``path``; a crash leaves the old or the new folder findable.

    A folder cannot replace a non-empty one in a single rename, so an existing ``path`` is
    first renamed to a hidden ``.old-`` sibling; :func:`toolkit.checkpoints.clean_temporaries`
    puts such a sibling back when a crash left no ``path``, and removes it otherwise.
    """
    parent = path.parent
    if not path.exists():
        os.rename(temp, path)
        fsync_dir(parent)
        return
    old = parent / temp_name("old", path.name)
    os.rename(path, old)
    fsync_dir(parent)
    os.rename(temp, path)
    fsync_dir(parent)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    state: TrainState,
    path: str | os.PathLike[str],
    *,
    objects: Mapping[str, Any] | None = None,
    metrics: Mapping[str, float] | None = None,
    rules: Retention | None = None,
) -> Path:
    """Write ``state`` (and ``objects``) as a checkpoint folder, atomically.

    The folder holds the unwrapped model's tensors (no ``_orig_mod.``/``module.``
    prefixes; tied tensors once) in ``model.safetensors``, which ``safetensors`` and
    ``load_state_dict(strict=True)`` open alone; the optimizer's state keyed by parameter
    names; the scheduler, the GradScaler (when enabled), the TrainState counters and
    ``extras``, the Python/NumPy/torch(/CUDA) RNG states and each object's
    ``state_dict()``, as JSON plus safetensors for their tensors; and ``manifest.json``
    with the size and xxh3 checksum of every file. Nothing is pickled.

    Plugin state (``state.extras``), object state and any new TrainState field must be a
    tree of dicts (str keys; or int/float/bool/None/str/tuple keys), lists, tuples, ints,
    floats (inf and NaN too), bools, ``None``, strings and tensors (any dtype and device).
    Anything else is refused before any file is written, naming its path.

    The files go to a hidden temporary sibling ``.tmp-<name>-<pid>-<hex>`` and are fsync'ed,
    then the folder is renamed to ``path`` and the parent fsync'ed. An existing checkpoint at
    ``path`` is replaced so that a crash at any point leaves the old or the new one (see
    :func:`toolkit.checkpoints.clean_temporaries`). The caller waits for all of it;
    :func:`toolkit.checkpoints.save_in_background` waits only for a host copy.

    A data-parallel model (DDP or FSDP2, with more than one rank in its data-parallel
    group) is saved by every rank of the group together: call it on every rank with the
    same ``path`` (on a file system all ranks see). DDP: rank 0 writes the files above and
    each other rank its own RNG states and data position (``rank_0000N``). FSDP2: every
    rank writes its shards of the model, the optimizer and DTensors in ``extras`` through
    ``torch.distributed.checkpoint`` into ``sharded/``; rank 0 the rest. Rank 0 renames the
    folder once all have written, and every rank returns, or raises the same error. To
    save from one rank alone, pass a state whose model is ``unwrap(model)`` (DDP).

    Args:
        state: the state to save, at an update boundary (no open accumulation window).
        path: the checkpoint folder to create, e.g. ``"runs/a/ckpt/step_000100"``.
        objects: extra stateful objects by name (anything with ``state_dict()`` and
            ``load_state_dict()``, e.g. a stateful DataLoader); pass the same names to
            :func:`load_checkpoint`.
        metrics: flat ``{name: number}`` recorded in the manifest (for best-K retention and
            ``python -m toolkit.checkpoints``).
        rules: the retention rules in force, recorded in the manifest so the shell tool can
            say which rule keeps each checkpoint.

    Returns:
        The checkpoint folder's path.

    Raises:
        ValueError: the accumulation window is open (``state.window.micro_step > 0``); the
            state was already passed to a train step (save the one it returned); a metric
            is not a number; ``path`` exists and is not a checkpoint; the optimizer
            holds a tensor that is not a model parameter.
        TypeError: state that breaks the rule above (the message names its path), or bad
            ``objects``.
        OSError: writing failed (e.g. ``ENOSPC``); the message names ``path``. The
            temporary folder is removed and earlier checkpoints are untouched.

    Example:
        >>> import torch
        >>> from safetensors.torch import load_file
        >>> from toolkit import TrainState, save_checkpoint
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))
        >>> path = save_checkpoint(state, "ckpt/step_000000", metrics={"val/loss": 0.5})
        >>> sorted(load_file(path / "model.safetensors"))
        ['bias', 'weight']
    """
    path = Path(path)
    group = group_of(state.model) if isinstance(state, TrainState) else None
    if group is not None:
        return _save_together(state, path, objects, metrics, rules, group)
    return _write_snapshot(_prepare(state, path, objects, metrics, rules, copy=False), path)


def save_in_background(
    state: TrainState,
    path: str | os.PathLike[str],
    *,
    objects: Mapping[str, Any] | None = None,
    metrics: Mapping[str, float] | None = None,
    rules: Retention | None = None,
) -> Future[Path]:
    """Like :func:`toolkit.save_checkpoint`, but write the files in a background thread.

    The caller is blocked only while the state is copied to host memory (every tensor,
    plus the JSON values and RNG states, as they are at the call); training can then go on
    and change the model in place while the copy is written, fsync'ed and renamed exactly
    as ``save_checkpoint`` does. The copy costs host memory the size of the checkpoint
    until the write ends. The thread is not a daemon: a normal interpreter exit waits for
    the write. Wait for one save (``future.result()``) before starting the next into the
    same folder, and prune old checkpoints or move a pointer only once it has succeeded.

    Args:
        state: the state to save, at an update boundary.
        path: the checkpoint folder to create.
        objects: extra stateful objects by name (their ``state_dict()`` is taken now).
        metrics: flat ``{name: number}`` recorded in the manifest.
        rules: the retention rules in force, recorded in the manifest.

    Returns:
        A ``concurrent.futures.Future`` whose ``result()`` is the checkpoint's path, or
        raises what the write raised (e.g. an ``OSError`` naming ``path``).

    Raises:
        ValueError, TypeError: at the call, as :func:`toolkit.save_checkpoint` (nothing is
            written then).

    Example:
        >>> import torch
        >>> from toolkit import TrainState, load_checkpoint
        >>> from toolkit.checkpoints import save_in_background
        >>> state = TrainState(model=torch.nn.Linear(1, 1))
        >>> pending = save_in_background(state.replace(step=3), "ckpt/step_000003")
        >>> with torch.no_grad():
        ...     _ = state.model.weight.add_(1.0)  # training goes on; the copy is already taken
        >>> load_checkpoint(pending.result(), like=state).step
        3
    """
    path = Path(path)
    if isinstance(state, TrainState) and group_of(state.model) is not None:
        raise ValueError(
            "save_in_background: the model is data parallel (DDP or FSDP2), whose ranks "
            "save together; their exchanges would share the training's process group from "
            "a background thread. Use save_checkpoint, on every rank."
        )
    snapshot = _prepare(state, path, objects, metrics, rules, copy=True)
    future: Future[Path] = Future()

    def write() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(_write_snapshot(snapshot, path))
        except BaseException as error:  # handed to whoever waits on the future
            future.set_exception(error)

    threading.Thread(target=write, name=f"save_checkpoint {path}").start()
    return future


def _prepare(
    state: TrainState,
    path: Path,
    objects: Mapping[str, Any] | None,
    metrics: Mapping[str, float] | None,
    rules: Retention | None,
    copy: bool,
) -> _Snapshot:
    """Check the arguments and gather everything in memory; nothing is written yet."""
    who = "save_checkpoint"
    if not isinstance(state, TrainState):
        raise TypeError(f"{who}: expected a TrainState, got {type(state).__name__}.")
    if getattr(state, "_consumed", False):
        raise ValueError(
            f"{who}: this TrainState (step {state.step}) was passed to a train step, which "
            "returned its successor; its counters are behind the model. Save the state the "
            "step returned: state, out = step(state, batch)."
        )
    if state.window.micro_step > 0:
        raise ValueError(
            f"{who}: the accumulation window is open (state.window.micro_step="
            f"{state.window.micro_step}), and its gradients are in no state dict; save "
            "after the update that closes the window (when out.updated is true)."
        )
    if rules is not None and not isinstance(rules, Retention):
        raise TypeError(f"{who}: rules must be a Retention or None; got {type(rules).__name__}.")
    if path.exists() and not (path / MANIFEST).is_file():
        raise ValueError(
            f"{who}: {path} exists and is not a checkpoint folder (no {MANIFEST}); refusing "
            "to replace it. Pick another path or remove it."
        )
    return _snapshot(state, check_objects(objects, who), check_metrics(metrics), rules, copy)


def _write_snapshot(snapshot: _Snapshot, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.parent / temp_name("tmp", path.name)
    try:
        temp.mkdir()
        _write(snapshot, temp)
        _publish(temp, path)
    except BaseException as error:
        shutil.rmtree(temp, ignore_errors=True)
        wrapped = _wrapped(error, path)
        if wrapped is error:
            raise
        raise wrapped from error
    return path


def _wrapped(error: BaseException, path: Path) -> BaseException:
    """An I/O failure as an OSError naming the checkpoint; any other error as it is."""
    code = _os_error_code(error)
    if code is None:
        return error
    wrapped = OSError(
        code,
        f"save_checkpoint: could not write the checkpoint {path} ({_reason(error)}); "
        "earlier checkpoints are untouched and the temporary folder was removed. Free "
        "space or save elsewhere.",
    )
    wrapped.__cause__ = error
    return wrapped


def _save_together(
    state: TrainState,
    path: Path,
    objects: Mapping[str, Any] | None,
    metrics: Mapping[str, float] | None,
    rules: Retention | None,
    group: Group,
) -> Path:
    """The ranks of ``group`` write one checkpoint; every rank sees the same outcome.

    Phases, each closed by :func:`agree` (one small all-reduce): check and
    gather in memory; rank 0 makes the temporary folder (its name drawn by rank 0 and
    broadcast); every rank writes its part (sharded tensors through DCP, the rank's own
    RNG and data position) and rank 0 the rest; rank 0 checksums every file, writes the
    manifest and renames the folder. A failure anywhere removes the temporary folder.
    """
    who = "save_checkpoint"
    rank, size = rank_of(group)
    snapshot: _Snapshot | None = None
    error: BaseException | None = None
    try:
        snapshot = _prepare(state, path, objects, metrics, rules, copy=False)
    except Exception as caught:
        error = caught
    agree(error, group, who)
    assert snapshot is not None
    temp = path.parent / temp_name("tmp", path.name, broadcast_int(new_token(), group))
    error = None
    try:
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            temp.mkdir()
    except Exception as caught:
        error = _wrapped(caught, path)
    agree(error, group, who)
    files: dict[str, Any] = {}
    components: dict[str, Any] = {}
    for phase in ("write", "publish"):
        error = None
        try:
            if phase == "write":
                if snapshot.shards:
                    save_shards(snapshot.shards, temp, group)
                if rank == 0:
                    files, components = _write_parts(snapshot, temp)
                else:
                    _write_tree(temp, rank_component(rank), snapshot.rank, {}, {})
            elif rank == 0:
                for other in range(1, size):
                    _list_tree(temp, rank_component(other), files, components, rank=other)
                if snapshot.shards:
                    _add_shards(temp, files)
                _write_manifest(snapshot, temp, files, components, size)
                _publish(temp, path)
        except Exception as caught:
            error = _wrapped(caught, path)
        try:
            agree(error, group, who)
        except BaseException:
            if rank == 0:
                shutil.rmtree(temp, ignore_errors=True)
            raise
    return path


def _list_tree(
    folder: Path, name: str, files: dict[str, Any], components: dict[str, Any], **info: Any
) -> None:
    """Enter a tree another rank wrote into ``folder`` in ``files`` and ``components``."""
    entry: dict[str, Any] = {"kind": "tree", "json": f"{name}.json", **info}
    files[f"{name}.json"] = _entry(folder / f"{name}.json")
    if (folder / f"{name}.safetensors").exists():
        entry["tensors"] = f"{name}.safetensors"
        files[f"{name}.safetensors"] = _entry(folder / f"{name}.safetensors")
    components[name] = entry


def _os_error_code(error: BaseException) -> int | None:
    """The errno of an I/O failure; safetensors reports them as "... (os error N)"."""
    if isinstance(error, OSError):
        return error.errno if error.errno is not None else 0
    found = re.search(r"\(os error (\d+)\)", str(error))
    return int(found.group(1)) if found else None


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error)
