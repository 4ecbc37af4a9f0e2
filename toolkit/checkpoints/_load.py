"""load_checkpoint: verify a checkpoint folder, compare it with a template, restore in order.

Only JSON and safetensors are read, and only the files the manifest lists, after their
sizes and checksums were checked. Every check runs before anything is touched (the
content a save writes, then every difference from the template: :mod:`._fit`); then the
components are restored in the order of :data:`._components.COMPONENTS`. A data-parallel
template is loaded by every rank of its group together: the ranks agree on the outcome of
the checks before any rank restores.
"""

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from safetensors.torch import load_file

from toolkit._checks import check_type, warn
from toolkit._rng import restore_rng
from toolkit.checkpoints._codec import TreeError, decode
from toolkit.checkpoints._components import COMPONENTS, Restoring, check_objects, fields_of
from toolkit.checkpoints._files import read_json
from toolkit.checkpoints._fit import compare, field_values, kind_of, model_fit
from toolkit.checkpoints._manifest import DamagedCheckpointError, Manifest, verified_manifest
from toolkit.checkpoints._model_state import SHARDS, expand, load_shards, model_state, saved_shapes
from toolkit.checkpoints._save import on_rank0, rank_component
from toolkit.distributed._collectives import Group, groups_of, rank_of
from toolkit.step._state import TrainState, WindowState

# Optimizers whose per-parameter state tensors have their parameter's shape and dtype.
MIRRORED = {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta"}
MIRRORED |= {"Rprop", "ASGD", "SparseAdam", "Muon"}


def _tensors(manifest: Manifest, name: str, owned: bool = False) -> dict[str, torch.Tensor]:
    """A listed safetensors file's tensors: memory-mapped, or (``owned``) in memory of their
    own; the model file holds every tensor the manifest's aliases name."""
    try:
        if name not in manifest.files:
            raise FileNotFoundError("the manifest does not list it")
        # pread: kept tensors (optimizer state) must not stay mapped onto a file that may change.
        tensors = load_file(manifest.path / name, backend="pread" if owned else "mmap")
        if name == "model.safetensors" and not set(manifest.aliases.values()) <= tensors.keys():
            raise KeyError("the manifest's aliases name tensors it lacks")
        return tensors
    except Exception as error:  # checksum-valid but not safetensors: written by something else
        problem = f"{manifest.path / name}: not a safetensors file of this checkpoint ({error})"
        raise DamagedCheckpointError(manifest.path, [problem]) from None


def _shapes(manifest: Manifest) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Each key of ``sharded/`` with its whole shape and dtype ({} for a plain checkpoint)."""
    try:  # DCP's reader of the headers of sharded/'s files
        return saved_shapes(manifest.path) if manifest.sharded else {}
    except Exception as error:
        problem = f"{manifest.path / SHARDS}: unreadable ({error})"
        raise DamagedCheckpointError(manifest.path, [problem]) from None


def read_tree(
    manifest: Manifest, name: str, *, like: Any = None,
    sharded: Callable[[str, Any], torch.Tensor] | None = None,
) -> Any:  # fmt: skip
    """Component ``name`` of a verified checkpoint, decoded (see :func:`._codec.decode`)."""
    stored, document = f"{name}.safetensors", manifest.path / f"{name}.json"
    tensors = _tensors(manifest, stored, owned=True) if stored in manifest.files else {}
    try:  # UnicodeDecodeError and json's errors are ValueErrors
        tree = decode(read_json(document), tensors, name, like=like, sharded=sharded)
    except (TreeError, KeyError, TypeError, AttributeError, ValueError, RecursionError) as error:
        tree = error
    if not isinstance(tree, dict):  # every component is a JSON object
        bad = f"not JSON, or not a tree this format writes ({tree!r:.200})"
        problem = f"{document}: {str(tree)[:400] if isinstance(tree, TreeError) else bad}"
        raise DamagedCheckpointError(manifest.path, [problem])
    return tree


def _empty(manifest: Manifest, prefix: str = "") -> dict[str, torch.Tensor]:
    """New tensors of the saved shapes for the sharded keys starting with ``prefix``."""
    shapes = _shapes(manifest).items()
    return {k: torch.empty(s, dtype=dtype) for k, (s, dtype) in shapes if k.startswith(prefix)}


def full_model(manifest: Manifest, partial: bool = False) -> dict[str, torch.Tensor]:
    """The whole model state dict of a verified checkpoint, of either layout.

    A sharded model's pieces are put together in this process (no process group needed).
    A trainable-only checkpoint holds no frozen parameters: refused unless ``partial``.
    """
    if manifest.frozen and not partial:
        raise ValueError(
            f"{manifest.path} holds the trainable parameters only (trainable_only=True), "
            "not the frozen base; load it into the model (load_checkpoint) and export that: "
            "export_model(state), or export_pretrained(state) for a peft adapter."
        )
    if not manifest.sharded:
        return expand(_tensors(manifest, "model.safetensors"), manifest.aliases)
    load_shards(model := _empty(manifest, "model/"), manifest.path, None)
    return {key.removeprefix("model/"): value for key, value in model.items()}


def full_tree(manifest: Manifest, name: str) -> Any:
    """Component ``name`` of a verified checkpoint with its sharded tensors put together."""
    shapes = _empty(manifest, f"{name}/")  # this component's sharded keys only
    used: dict[str, torch.Tensor] = {}  # a key not in the files: a KeyError, damage
    tree = read_tree(manifest, name, sharded=lambda key, _: used.setdefault(key, shapes[key]))
    if used:
        load_shards(used, manifest.path, None)
    return tree


def _differences(
    manifest: Manifest, like: TrainState, objects: dict[str, Any], trees: dict[str, Any],
    templates: dict[str, Any],
) -> list[str]:  # fmt: skip
    """How the decoded components differ from the template (the model aside): first the
    recorded classes (the objects' one by one), then each component's ``fit``."""
    has = [c.name for c in COMPONENTS if c.kind is not None and trees.get(c.name) is not None]
    saved = {name: manifest.classes.get(name) for name in has}
    live = {c.name: kind for c in COMPONENTS if c.kind and (kind := c.kind(like, objects))}
    if like.scaler is None and "scaler" in saved:  # one is built for the saved state
        live["scaler"] = saved["scaler"]
    recorded = saved.pop("objects", None) or {}  # of the objects the tree holds (it decides)
    saved_objects = {name: recorded.get(name) for name in trees.get("objects") or {}}
    out = compare("objects", saved_objects, live.pop("objects", None) or {})
    out += compare("components", saved, live)
    for c in COMPONENTS:
        saved_tree, template = trees.get(c.name), templates.get(c.name)
        if c.fit and saved_tree is not None and template is not None:
            alike = saved.get(c.name) == live.get(c.name)  # of the same class, or of none
            out += c.fit(f"{manifest.path}/{c.name}.json", saved_tree, template, like, alike)
    return out


def load_checkpoint(
    path: str | os.PathLike[str], like: TrainState, *, objects: Mapping[str, Any] | None = None,
    rng: bool = True, allow_nonfinite: bool = False,
) -> TrainState:  # fmt: skip
    """Restore a checkpoint into the objects of a template state built the normal way.

    Every file the manifest lists is checked (a regular file inside the folder, its size
    and xxh3 checksum) first; files it does not list are never opened, and only JSON and
    safetensors are read (nothing is unpickled). Then what no save writes is refused
    (counters below 0 or not ints, an open window, RNG states a generator refuses,
    non-finite hyperparameters), and what the checkpoint says about itself must agree (the
    optimizer's state with its parameters' shapes and dtypes, the manifest's step with
    ``state.json``'s and the folder's name, an EMA with the model's names and shapes, no
    NaN or inf in the model unless ``allow_nonfinite``); then the checkpoint is compared with
    the template (the model: names, shapes, dtypes and ties). In the
    optimizer, scheduler, scaler and each ``extras`` entry that holds tensors (an EMA's):
    every tensor of the same shape and dtype, a number (not NaN) where the template has
    one. In the optimizer and the scheduler's and scaler's settings (constructor
    arguments, base learning rates): finite numbers where the template's are, an int > 0
    where the template's is (``StepLR``'s ``step_size``), each parameter group through its
    optimizer's own argument checks. Counters (``ReduceLROnPlateau``'s bad epochs) and the
    ``extras`` entries without tensors are not compared, so a template that trained on (a
    live state) takes an earlier checkpoint. *All* differences are reported at once. A
    refused load changes nothing. Then the objects are restored in place in this order:
    the extra ``objects`` (only they can check their state), the model
    (``load_state_dict(strict=True)`` on the unwrapped model; tied weights stay tied), the
    scheduler, the optimizer (after the scheduler, whose loading changes the optimizer's
    learning rates, pytorch#119168: the saved rates win), the GradScaler, and last the RNG
    states.

    TrainState fields missing from an older checkpoint keep the template's values.

    A checkpoint saved with ``trainable_only=True`` holds no frozen parameters: the
    template's must match the fingerprint it records (else a ValueError: build the
    template on the same base model), and they stay as the template has them.

    A data-parallel template (DDP or FSDP2) is loaded on every rank of its group together
    (all load, or all raise the same error). Each rank gets its own saved RNG states and
    data position; a rank the checkpoint has none for (it was written by fewer ranks)
    keeps its seeding and rank 0's data position, with a warning. A sharded (FSDP2)
    checkpoint loads into any sharding, a DDP model or a plain one, on any number of ranks;
    a plain one into an FSDP2 model too. The sharded files are read with ``safetensors``
    through DCP's Hugging Face storage reader (no pickle), after the manifest's checks and
    a check that ``sharded/`` holds no file the manifest does not list.

    Args:
        path: a checkpoint folder written by :func:`save_checkpoint`.
        like: the template: a TrainState with the same kind of model, optimizer,
            scheduler (and scaler) as the saved run, e.g. freshly built.
        objects: the extra stateful objects saved with ``objects=``, by the same names.
        rng: restore the Python, NumPy, torch and CUDA RNG states.
        allow_nonfinite: load model weights that hold NaN or inf (else they are damage).

    Returns:
        A new TrainState with the template's handles (now holding the saved state), every
        saved non-handle field, and the saved ``extras`` (template entries the checkpoint
        lacks are kept). When the checkpoint holds a GradScaler and the template none, a
        ``torch.amp.GradScaler`` for the model's device is built and loaded.

    Raises:
        DamagedCheckpointError: a listed file is missing, truncated, corrupted or not a
            regular file inside the folder, the manifest is damaged, a file holds what
            no save writes, or the checkpoint disagrees with itself; the message names each
            file (and tensor).
        ValueError: the checkpoint does not fit the template (the message lists every
            difference; a trainable-only one's frozen parameters among them), it is of
            another format or version, or it is model-only (``Retention.keep_full``) and
            the template has an optimizer.
        TypeError: ``like`` is not a TrainState, or bad ``objects``.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, load_checkpoint, save_checkpoint
        >>> def build():
        ...     model = torch.nn.Linear(2, 1)
        ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     return TrainState(model=model, optimizer=optimizer)
        >>> path = save_checkpoint(build().replace(step=7), "ckpt/step_000007")
        >>> state = load_checkpoint(path, like=build())
        >>> state.step
        7
    """
    who = "load_checkpoint"
    check_type(isinstance(like, TrainState), who, "like", "a TrainState (the template)", like)
    objects, group = check_objects(objects, who), groups_of(like.model).everyone
    plan = on_rank0(group, who, _plan, path, like, objects, rng, allow_nonfinite, group, every=True)
    return plan()  # every rank restores, or none


def _rank_state(manifest: Manifest, rank: int, trees: dict[str, Any]) -> dict[str, Any]:
    """The fields rank ``rank`` has of its own; its RNG states go into ``trees["rng"]``.

    A rank the checkpoint has no state for (it was written by fewer ranks) is warned
    about and keeps its seeding and rank 0's data position.
    """
    if rank == 0:
        return {}
    trees["rng"] = None
    if manifest.has(name := rank_component(rank)):
        own = read_tree(manifest, name)
        if own.keys() != {"rng", "data_state"}:
            raise DamagedCheckpointError(manifest.path, [f"{manifest.path / name}.json: malformed"])
        trees["rng"] = own["rng"]
        return {"data_state": own["data_state"]}
    warn(
        f"load_checkpoint: {manifest.path} holds no RNG states or data position for rank "
        f"{rank} (it was written by {manifest.world_size} rank(s)); this rank keeps its own "
        "RNG seeding and rank 0's data position (the model and optimizer are restored)."
    )
    return {}


def _read(manifest: Manifest, like: TrainState | None, out: list[str]) -> tuple[dict, ...]:
    """``(trees, templates, shards, kinds)``: each component the checkpoint holds, decoded
    against its template (``trees["model"]``: the saved model state dict, or (sharded) the
    template's); the templates; what DCP fills in place: each sharded tensor (the
    template's, once its saved shape matches); each saved model tensor's (shape, dtype).
    Without a template (``like=None``): every listed JSON file, its sharded tensors as
    stand-ins of their saved shapes."""
    shapes, shards = _shapes(manifest), dict[str, torch.Tensor]()

    def take(key: str, template: Any) -> torch.Tensor:
        size, dtype = shapes[key]  # a key not in the files: a KeyError, damage
        saved = f"shape {list(size)}"
        live = f"shape {list(template.shape)}" if isinstance(template, torch.Tensor) else "none"
        if like is not None and saved == live:
            return shards.setdefault(key, template)
        line = f"sharded tensors: {key!r}: {saved} in the checkpoint, {live} in the template"
        if like is not None and line not in out:  # a tensor held twice is stored once
            out.append(line)
        # A stand-in of the saved shape and dtype: the extras' comparison quotes it.
        return torch.empty(size, dtype=dtype, device="meta")

    if manifest.sharded:
        model = model_state(like.model) if like is not None else {}
        shards.update({f"model/{name}": value for name, value in model.items()})
        saved = {k[6:]: kind for k, kind in shapes.items() if k[:6] == "model/"}
    else:
        model = expand(_tensors(manifest, "model.safetensors"), manifest.aliases)
        saved = {n: (t.shape, t.dtype) for n, t in model.items()}  # every name, aliases too
    if like is not None:
        aliases = {} if manifest.sharded else manifest.aliases
        out += model_fit(like.model, saved, aliases, manifest.frozen)
        has = [c for c in COMPONENTS if manifest.has(c.name)]
        templates = {c.name: c.template(like, manifest.sharded) for c in has}
    else:
        templates = {n[:-5]: None for n in manifest.files if n.endswith(".json") and "/" not in n}
    trees = {n: read_tree(manifest, n, like=t, sharded=take) for n, t in templates.items()}
    return {**trees, "model": model}, templates, shards, saved


def _itself(manifest: Manifest, trees: Mapping[str, Any], model: Mapping, finite: bool) -> list:
    """Where a checkpoint disagrees with itself, seen on what a load reads anyway: optimizer
    parameters that are no floating tensor of the saved model; per-parameter state of
    another shape or dtype than its parameter's (optimizers of :data:`MIRRORED`; a scalar
    ``step`` is fine); an EMA (``extras[key]["params"]``, ``["buffers"]``) of names or
    shapes the saved model lacks; ``finite``: NaN or inf in the model file's tensors."""
    out, partial = [], manifest.frozen is not None  # trainable-only: frozen names are absent
    have = {n: f"shape {list(shape)} {dtype}" for n, (shape, dtype) in model.items()}
    optimizer = trees.get("optimizer") or {"state": {}, "param_groups": []}
    where, states = f"{manifest.path}/optimizer.json", optimizer["state"]
    mirrored = manifest.classes.get("optimizer") in MIRRORED
    for name in {n for g in optimizer["param_groups"] for n in g["params"]} | states.keys():
        dtype, state = model.get(name, (0, torch.int8))[1], states.get(name)
        if not (dtype.is_floating_point or dtype.is_complex or (partial and name not in model)):
            out.append(f"{where}: parameter {name!r}, in the model {have.get(name, 'absent')}")
        pairs = state.items() if mirrored and name in have and type(state) is dict else ()
        for key, value in pairs:
            if isinstance(value, torch.Tensor) and value.dim() and kind_of(value) != have[name]:
                out.append(f"{where}: state[{name!r}][{key!r}]: {kind_of(value)}, of {have[name]}")
    for key, entry in (trees.get("extras") or {}).items():
        ema = entry if isinstance(entry, dict) and isinstance(entry.get("params"), dict) else {}
        buffers: Any = ema.get("buffers") if isinstance(ema.get("buffers"), dict) else {}
        for name, value in {**ema.get("params", {}), **buffers}.items():
            shape = getattr(value, "shape", None)
            if (name in model or not partial) and shape != model.get(name, (None,))[0]:
                where = f"{manifest.path}/extras.json: [{key!r}][{name!r}]"
                out.append(f"{where}: {kind_of(value)}, in the model {have.get(name, 'absent')}")
    unique = {id(t): (n, t) for n, t in trees["model"].items() if t.dtype.is_floating_point}
    for name, t in unique.values() if finite and not manifest.sharded else ():
        if not t.sum().isfinite() and not t.isfinite().all():  # a sum (or overflow): 15x faster
            out.append(f"{manifest.path}/model.safetensors: {name!r} holds NaN or inf "
                       "(load_checkpoint(..., allow_nonfinite=True) loads it)")  # fmt: skip
    return out


def _content_problems(
    manifest: Manifest, trees: Mapping[str, Any], fields: Mapping | None, model: Mapping,
    finite: bool,
) -> list[str]:  # fmt: skip
    """What no save writes, found without a template (a load and verify_checkpoint refuse it).

    A component that is not a JSON object; an optimizer state without parameter groups or
    with a non-finite hyperparameter; RNG states that a generator refuses (tried on new
    ones); TrainState fields that TrainState refuses, a negative counter or an open window,
    a step other than the manifest's; then :func:`_itself` once the optimizer state is sound.
    """
    folder = manifest.path
    optimizer: Any = trees.get("optimizer") or {"state": {}, "param_groups": []}
    groups = optimizer.get("param_groups")
    ok = isinstance(optimizer.get("state"), dict) and isinstance(groups, list)
    ok = ok and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
    ok = ok and all(type(name) is str for g in groups for name in g["params"])
    ok = ok and all(math.isfinite(v) for v in optree.tree_leaves(groups) if type(v) is float)
    out = [] if ok else [f"{folder}/optimizer.json: not parameter groups of finite numbers"]
    for name, tree in trees.items():
        try:
            if tree is not None and (name == "rng" or name.startswith("rank_")):
                restore_rng(tree if name == "rng" else tree["rng"], trial=True)
        except Exception as error:  # whatever a generator raises: the states stay unused
            out.append(f"{folder / name}.json: RNG states that a generator refuses ({error})")
    try:
        state = TrainState(model=torch.nn.Module(), **(fields or {}))
        guard = all(type(n) is int and n >= 0 for n in state.guard)
        bad = "" if guard and state.window == WindowState() else "an open window or a bad counter"
    except (TypeError, ValueError) as error:
        bad = str(error)
    if not bad and (step := (fields or {}).get("step", manifest.step)) != manifest.step:
        bad = f"step {step}, the manifest's is {manifest.step}"
    out += [f"{folder}/state.json: not what a save writes ({bad})"] if bad else []
    return out + (_itself(manifest, trees, model, finite) if ok else [])


def content_problems(manifest: Manifest, allow_nonfinite: bool = False) -> list[str]:
    """What a load refuses in a checkpoint whose files are intact, found without a template.

    Every safetensors header and JSON tree is read (tensors the trees name must be in
    their files, the model's aliases in the model file, sharded keys in ``sharded/``),
    then :func:`_content_problems`; with a template, a load also compares shapes, dtypes
    and hyperparameters with it.
    """
    differences: list[str] = []
    try:
        trees, _, _, model = _read(manifest, None, differences)
    except DamagedCheckpointError as error:
        return list(error.problems)
    live = fields_of(TrainState(model=torch.nn.Module()), plain=False)
    fields = field_values(trees.get("state", {}), live, differences)
    return _content_problems(manifest, trees, fields, model, not allow_nonfinite) + differences


def _plan(
    path: str | os.PathLike[str], like: TrainState, objects: dict[str, Any], rng: bool,
    allow_nonfinite: bool, group: Group | None,
) -> Callable[[], TrainState]:  # fmt: skip
    """Read and check everything against the template; return the restore, to call once all
    ranks of ``group`` agree (nothing is touched before)."""
    manifest = verified_manifest(path)
    if manifest.model_only and like.optimizer is not None:
        raise ValueError(
            f"load_checkpoint: {manifest.path} is model-only (keep_full removed its optimizer"
            " state); pass a template without optimizer, or resume from a full checkpoint."
        )
    differences: list[str] = []
    trees, templates, shards, model = _read(manifest, like, differences)
    own = _rank_state(manifest, rank_of(group)[0], trees)
    trees["rng"] = trees.get("rng") if rng else None
    live = fields_of(like, plain=False)
    fields = {**field_values(trees.get("state") or {}, live, differences), **own}
    if damage := _content_problems(manifest, trees, fields, model, not allow_nonfinite):
        raise DamagedCheckpointError(manifest.path, damage)
    differences += _differences(manifest, like, objects, trees, templates)
    if differences:
        raise ValueError(
            f"load_checkpoint: {manifest.path} does not fit the template state ({len(differences)}"
            f" difference(s)):\n  " + "\n  ".join(differences) + "\nBuild the template like the "
            "saved run (same model, optimizer, scheduler and plugins), or load the model alone "
            "with safetensors.torch.load_file."
        )
    scaler = like.scaler
    if trees.get("scaler") is not None and scaler is None:  # one is built for the saved state
        scaler = torch.amp.GradScaler(next((p.device.type for p in like.model.parameters()), "cpu"))
    # A new state, not like.replace(): the template may carry a train step's "consumed" mark.
    values = {field.name: getattr(like, field.name) for field in dataclasses.fields(like)}
    values.update(fields, extras={**like.extras, **(trees.get("extras") or {})}, scaler=scaler)
    state = TrainState(**values)
    restoring = Restoring(manifest, objects, shards, group)

    def restore() -> TrainState:
        """Restore in the table's order, which keeps each object's saved values."""
        for component in COMPONENTS:
            if component.put is not None and trees.get(component.name) is not None:
                component.put(state, trees[component.name], restoring)
        return state

    return restore
