"""save_checkpoint and save_in_background: a TrainState as a folder of safetensors and JSON.

A checkpoint folder holds ``manifest.json`` (every file with its size and checksum: see
:mod:`._manifest`), ``model.safetensors`` (the unwrapped state dict, tied tensors once;
trainable_only: no frozen parameters), a ``NAME.json`` (plus ``NAME.safetensors`` when its
tree holds tensors) for each component of :data:`._components.COMPONENTS` the run has, and
``rank_0000N.json`` with rank N's RNG states and data position (N > 0). FSDP2 (DTensor
parameters): the model, the optimizer's tensors and DTensors in the trees go to
``sharded/`` instead (:mod:`._model_state`), one file per rank. One path saves a single
process and the ranks of a data-parallel group alike.
"""

import dataclasses
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from toolkit._checks import check
from toolkit._rng import capture_rng
from toolkit.checkpoints._codec import encode, host_tensor, separate_shared
from toolkit.checkpoints._components import COMPONENTS, check_objects
from toolkit.checkpoints._files import fsync_dir, new_token, temp_name, write_json, write_tensors
from toolkit.checkpoints._manifest import MANIFEST, check_metrics, listing, manifest_document
from toolkit.checkpoints._model_state import is_sharded, model_part, save_shards, split_aliases
from toolkit.checkpoints._retention import Retention
from toolkit.distributed._collectives import Group, agree, broadcast_int, groups_of, rank_of
from toolkit.distributed._layout import current_layout
from toolkit.step._state import TrainState


@dataclasses.dataclass(frozen=True)
class _Snapshot:
    """Everything a checkpoint holds, gathered in memory before any file is written."""

    manifest: dict[str, Any]  # the manifest's fields but "files" and "time"
    trees: dict[str, tuple[Any, dict[str, torch.Tensor]]]  # name -> (document, tensors)
    shards: dict[str, torch.Tensor]  # keys -> tensors for sharded/ (FSDP2), else empty
    own: tuple[Any, dict[str, torch.Tensor]]  # this rank's RNG states and data position


def rank_component(rank: int) -> str:
    """The component (and file stem) of rank ``rank``'s own state in a multi-rank checkpoint."""
    return f"rank_{rank:05d}"


def _snapshot(
    state: TrainState, objects: dict[str, Any], copy: bool, trainable: bool, recorded: dict
) -> _Snapshot:
    """Everything to write; ``recorded``: manifest fields (metrics, rules, settings)."""
    sharded = is_sharded(state.model)
    whole, frozen = model_part(state.model, trainable, "save_checkpoint")
    model, aliases = split_aliases(whole, "save_checkpoint")
    shards = {f"model/{name}": value for name, value in model.items()} if sharded else {}
    trees: dict[str, Any] = {}
    if not sharded:
        trees["model"] = (None, {name: host_tensor(value, copy) for name, value in model.items()})
        separate_shared(trees["model"][1])  # distinct views of one buffer
    for component in COMPONENTS:
        if (tree := component.take(state, objects)) is None:
            continue
        outside = component.shard if sharded else None
        document, tensors = encode(tree, component.name, copy=copy, external=outside)
        shards.update({n: tensors.pop(n) for n in list(tensors) if outside and outside(tensors[n])})
        trees[component.name] = (document, tensors)
    classes = {c.name: c.kind(state, objects) for c in COMPONENTS if c.kind and c.name in trees}
    own = encode({"rng": capture_rng(), "data_state": dict(state.data_state)}, "rank", copy=copy)
    fields = {"step": state.step, "classes": classes, "aliases": aliases, "sharded": sharded}
    return _Snapshot({**fields, "frozen": frozen, **recorded}, trees, shards, own)


def _write_parts(snapshot: _Snapshot, folder: Path, rank: int) -> None:
    """Write this rank's files of the snapshot into ``folder``."""
    trees = snapshot.trees if rank == 0 else {rank_component(rank): snapshot.own}
    for name, (document, tensors) in trees.items():
        if name != "model":  # the model: a plain state dict that safetensors opens alone
            write_json(folder / f"{name}.json", document)
        if tensors or name == "model":
            write_tensors(folder / f"{name}.safetensors", tensors)


def _publish(temp: Path, path: Path) -> None:
    """Give ``temp`` the name ``path``; a crash leaves the old or the new folder findable.

    A folder cannot replace a non-empty one in a single rename, so an existing ``path`` is
    first renamed to a hidden ``.old-`` sibling; :func:`toolkit.checkpoints.clean_temporaries`
    puts such a sibling back when a crash left no ``path``, and removes it otherwise.
    """
    old = path.parent / temp_name("old", path.name)
    if path.exists():
        os.rename(path, old)
        fsync_dir(path.parent)
    os.rename(temp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    state: TrainState, path: str | os.PathLike[str], *, objects: Mapping[str, Any] | None = None,
    metrics: Mapping[str, float] | None = None, rules: Retention | None = None,
    settings: Mapping[str, Any] | None = None, trainable_only: bool = False,
) -> Path:  # fmt: skip
    """Write ``state`` (and ``objects``) as a checkpoint folder, atomically.

    The folder holds the unwrapped model's tensors (no ``_orig_mod.``/``module.`` prefixes;
    tied tensors once) in ``model.safetensors``, which ``safetensors`` opens alone; a model
    without tied weights loads it with ``load_state_dict(strict=True)``, one with tied
    weights (a GPT-2's ``lm_head.weight``) with ``strict=False``, the tie filling the name
    stored once (``export_model`` writes every name, ``export_pretrained`` the Hugging Face
    layout); the optimizer's state keyed by parameter names; the scheduler, the GradScaler
    (when enabled), the TrainState counters and ``extras``, the Python/NumPy/torch(/CUDA)
    RNG states and each object's ``state_dict()``, as JSON plus safetensors for their
    tensors; and ``manifest.json`` with the size and xxh3 checksum of every file. Nothing is
    pickled.

    Plugin state (``state.extras``), object state and any new TrainState field must be a
    tree of dicts (str keys; or int/float/bool/None/str/tuple keys), lists, tuples, ints,
    floats (inf and NaN too), bools, ``None``, strings and tensors (any dtype and device).
    Subclasses of str, int, float and dict (``torch.__version__``, enums, ``defaultdict``)
    and NumPy scalars are stored as their base type. Anything else is refused before any
    file is written, naming its path.

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
        settings: the run's configuration (JSON values, tuples and inf/NaN kept), recorded
            in the manifest; read back as ``verified_manifest(path).settings``.
        trainable_only: save, of the model, only the parameters that train
            (``requires_grad``, e.g. a LoRA adapter) and the buffers (BatchNorm's running
            statistics change in training), not the frozen parameters: the manifest records
            their fingerprint instead (xxh3-128 of names, dtypes, shapes and bytes: one pass
            over them per save), and :func:`load_checkpoint` loads such a checkpoint only
            into a template whose frozen parameters match it, leaving them as they are. Not
            for an FSDP2 model. ``export_model`` of such a folder is refused (it lacks the
            base): load it into the model and export the state.

    Returns:
        The checkpoint folder's path.

    Raises:
        ValueError: the accumulation window is open (``state.window.micro_step > 0``); the
            state was already passed to a train step (save the one it returned); a metric
            is not a number; ``settings`` hold tensors; ``path`` exists and is not a
            checkpoint; the optimizer holds a tensor that is not a model parameter;
            ``trainable_only`` for an FSDP2 model.
        TypeError (toolkit.checkpoints.TreeError): state or ``settings`` that break the
            rule above (the message names its path); ``state`` not a TrainState, ``rules``
            not a Retention, or bad ``objects``.
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
    group = groups_of(state.model).everyone if isinstance(state, TrainState) else None
    args = (state, Path(path), False, objects, metrics, rules, settings, trainable_only)
    snapshot = on_rank0(group, "save_checkpoint", _prepare, *args, every=True)
    return _write(snapshot, Path(path), group)


def on_rank0(
    group: Group | None, who: str, work: Callable[..., Any], *args: Any, every: bool = False
) -> Any:
    """``work(*args)`` on rank 0 alone (``None`` on the others), or on ``every`` rank; an
    error of any rank raised on every rank, as ``who``'s."""
    error, result = None, None
    try:
        if every or rank_of(group)[0] == 0:
            result = work(*args)
    except Exception as caught:
        error = caught
    agree(error, group, who)
    return result


def save_in_background(
    state: TrainState, path: str | os.PathLike[str], *, objects: Mapping[str, Any] | None = None,
    metrics: Mapping[str, float] | None = None, rules: Retention | None = None,
    settings: Mapping[str, Any] | None = None, trainable_only: bool = False,
) -> Future[Path]:  # fmt: skip
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
        objects, metrics, rules, settings, trainable_only: as for ``save_checkpoint``,
            taken at the call (the objects' ``state_dict()`` and the fingerprint of the
            frozen parameters too).

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
    if isinstance(state, TrainState) and groups_of(state.model).everyone is not None:
        raise ValueError(
            "save_in_background: expected a model of this process alone, got a data-parallel "
            "one (DDP or FSDP2), whose ranks save together; use save_checkpoint on every rank."
        )
    snapshot = _prepare(state, path, True, objects, metrics, rules, settings, trainable_only)
    # Its worker is joined at interpreter exit (as a non-daemon thread would be).
    pool = ThreadPoolExecutor(1, thread_name_prefix=f"save_checkpoint {path}")
    future = pool.submit(_write, snapshot, path, None)
    pool.shutdown(wait=False)  # the submitted write still runs
    return future


def _prepare(
    state: TrainState, path: Path, copy: bool, objects: Mapping[str, Any] | None = None,
    metrics: Mapping[str, float] | None = None, rules: Retention | None = None,
    settings: Mapping[str, Any] | None = None, trainable_only: bool = False,
) -> _Snapshot:  # fmt: skip
    """Check the arguments and gather everything in memory; nothing is written yet."""
    who = "save_checkpoint"
    check(isinstance(state, TrainState), who, "state", "a TrainState", state, "", TypeError)
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
    named = re.fullmatch(r"step_(\d{6,})", path.name)  # a load refuses another step's name
    what = f"named after the state's step (step_{state.step:06d}), or not step_NNNNNN"
    check(not named or int(named[1]) == state.step, who, "path", what, path.name)
    ok = rules is None or isinstance(rules, Retention)
    check(ok, who, "rules", "a Retention or None", rules, "", TypeError)
    if path.exists() and not (path / MANIFEST).is_file():
        raise ValueError(
            f"{who}: {path} exists and is not a checkpoint folder (no {MANIFEST}); refusing "
            "to replace it. Pick another path or remove it."
        )
    document, tensors = encode(dict(settings or {}), "settings")
    check(not tensors, who, "settings", "a tree of JSON values (no tensors)", list(tensors))
    recorded = {"metrics": check_metrics(metrics or {}), "rules": rules and rules.to_document()}
    recorded["settings"] = document
    return _snapshot(state, check_objects(objects, who), copy, trainable_only, recorded)


def _write(snapshot: _Snapshot, path: Path, group: Group | None) -> Path:
    """The ranks of ``group`` (or this process alone) write one checkpoint, atomically.

    Phases, each closed by :func:`agree` (one small all-reduce; nothing alone): rank 0
    makes the temporary folder (its name drawn by rank 0 and broadcast); every rank writes
    its part (sharded tensors through DCP, a rank's own RNG and data position) and rank 0
    the rest; rank 0 checksums every file, writes the manifest and renames the folder. A
    failure anywhere removes the temporary folder, and every rank raises it.
    """
    rank, size = rank_of(group)
    temp = path.parent / temp_name("tmp", path.name, broadcast_int(new_token(), group))
    for phase in ("folder", "write", "publish"):
        error = None
        try:
            if phase == "folder" and rank == 0:
                path.parent.mkdir(parents=True, exist_ok=True)
                temp.mkdir()
            elif phase == "write":
                if snapshot.shards:
                    save_shards(snapshot.shards, temp, group)
                _write_parts(snapshot, temp, rank)
            elif phase == "publish" and rank == 0:
                fields = {**snapshot.manifest, "world_size": size, "files": listing(temp)}
                if (layout := current_layout()) is not None:
                    fields["mesh"] = layout.sizes()
                write_json(temp / MANIFEST, manifest_document(**fields, time=time.time()))
                fsync_dir(temp)
                _publish(temp, path)
        except BaseException as caught:
            error = _wrapped(caught, path)
        try:
            agree(error, group, "save_checkpoint")
        except BaseException:
            if rank == 0:
                shutil.rmtree(temp, ignore_errors=True)
            raise
    return path


def _wrapped(error: BaseException, path: Path) -> BaseException:
    """An I/O failure as an OSError naming the checkpoint; any other error as it is.

    safetensors reports I/O failures as "... (os error N)".
    """
    found = re.search(r"\(os error (\d+)\)", str(error))
    if not isinstance(error, OSError) and found is None:
        return error
    code = error.errno if isinstance(error, OSError) else int(found.group(1))  # type: ignore[union-attr]
    reason = getattr(error, "strerror", None) or str(error)
    fix = "earlier checkpoints are untouched and the temporary folder was removed. Free space"
    wrapped = OSError(code or 0, f"save_checkpoint: could not write the checkpoint {path} "
                      f"({reason}); {fix} or save elsewhere.")  # fmt: skip
    wrapped.__cause__ = error
    return wrapped
