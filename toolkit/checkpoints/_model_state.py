"""Model and optimizer state, and sharded files, through PyTorch's distributed checkpointing.

``torch.distributed.checkpoint.state_dict``: ``get_model_state_dict`` and
``get_optimizer_state_dict`` give plain names (no ``_orig_mod.``/``module.``), optimizer
state keyed by parameter name, and DTensors for a sharded (FSDP2) model; their ``set_``
twins load them back, whatever the sharding. A tied tensor is listed under each of its
names; safetensors refuses to write shared memory twice, so a file stores it under its
first name and records the others as *aliases*.

Sharded files: a checkpoint of a sharded model keeps its model, its optimizer's tensors
and any DTensor in ``extras`` in the ``sharded/`` sub-folder of the checkpoint: one
safetensors file per rank (``shard-0000N-model-00001-of-00001.safetensors``), written by
``torch.distributed.checkpoint`` (DCP) with its Hugging Face storage writer, each file's
header naming the offsets of the pieces it holds. Keys are ``model/<name>`` and
``<tree>/<path>`` (the JSON document of the tree refers to them with
``{"$tensor": key, "dcp": true}``). DCP's own file format pickles its metadata
(``.metadata``) and reads tensors with ``torch.load``; this layout has neither: the reader
(``HuggingFaceStorageReader``) builds DCP's metadata from the safetensors headers and reads
slices with ``safetensors`` alone. It lists the folder, so a load first checks that
``sharded/`` holds exactly the files the manifest lists, each of the right size and
checksum (see :func:`._manifest.file_problems`). Loading goes through DCP too, into the
template's own tensors, so a checkpoint written by any number of ranks loads into any
other sharding, a DDP model or a plain one.
"""

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from toolkit._checks import check
from toolkit._unwrap import unwrap
from toolkit.checkpoints._codec import TreeError, describe
from toolkit.checkpoints._files import CHECKSUM, fsync_dir

SHARDS = "sharded"  # the sub-folder of a checkpoint that holds DCP's files


def model_state(model: torch.nn.Module, whole: bool = False) -> dict[str, Any]:
    """The unwrapped model's state dict: DTensors kept sharded, no copies; ``whole``: a
    sharded model gathered (a collective), whole on rank 0's CPU."""
    options = StateDictOptions(full_state_dict=whole, cpu_offload=whole)
    return get_model_state_dict(unwrap(model), options=options)  # unwrap: DataParallel's too


def model_part(model: torch.nn.Module, trainable_only: bool, who: str) -> tuple[dict, str | None]:
    """The state dict and None; ``trainable_only``: without the frozen parameters, and a
    fingerprint of those: xxh3-128 of their names, dtypes, shapes and bytes (one pass)."""
    state, digest = model_state(model), xxhash.xxh3_128()
    if not trainable_only:
        return state, None
    check(not is_sharded(model), who, "trainable_only", "False for an FSDP2 model", True)
    named = unwrap(model).named_parameters(remove_duplicate=False)  # a tie under each name
    frozen = sorted({name for name, p in named if not p.requires_grad} & state.keys())
    for name in frozen:
        tensor = state.pop(name).detach()
        digest.update(f"{name} {tensor.dtype} {list(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).cpu().numpy())
    return state, f"{len(frozen)} tensors, {CHECKSUM} {digest.hexdigest()}"


def put_model(
    model: torch.nn.Module, state: Mapping[str, Any], full: bool = True, strict: bool = True
) -> None:
    """Load a whole state dict (or, ``full=False``, one sharded like the model); ``strict``
    unless it is the model's trainable part (its names were checked)."""
    if full and not is_sharded(model):  # set_model_state_dict would copy every tensor
        unwrap(model).load_state_dict(dict(state), strict=strict)
    else:
        options = StateDictOptions(full_state_dict=full)
        set_model_state_dict(unwrap(model), dict(state), options=options)


def parameter_names(model: torch.nn.Module, optimizer: Any) -> dict[int, str]:
    """The model's parameter names by the parameters' ids; a ValueError for a tensor of the
    optimizer that is not a parameter of the model (no checkpoint could name it)."""
    names = {id(p): name for name, p in unwrap(model).named_parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if id(param) not in names:
                raise ValueError(
                    f"save_checkpoint: optimizer.param_groups[{g}]['params'][{i}] (shape "
                    f"{list(param.shape)}) is not a parameter of the model, so the checkpoint "
                    "cannot name it; register it on the model (e.g. as an nn.Parameter "
                    "attribute) or keep it in a separate optimizer saved through objects=."
                )
    return names


def _optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)


def optimizer_state(model: torch.nn.Module, optimizer: Any, keep: bool = False) -> dict[str, Any]:
    """The optimizer's state dict keyed by parameter names (a MultiOptimizer's merged).

    An optimizer without state gets zero state, which is dropped again unless ``keep``
    (DCP loads a sharded checkpoint into it).
    """
    names = parameter_names(model, optimizer)  # and the clear error for a stray tensor
    optimizers = _optimizers(optimizer)
    had = {id(p) for o in optimizers for p in o.state}
    state: dict[str, Any] = dict(get_optimizer_state_dict(unwrap(model), optimizers))
    # Own code: for an optimizer without state, get_optimizer_state_dict makes zero state
    # (one step at lr=0); a save must not change the run, so that state is dropped again.
    for o in optimizers if not keep else ():
        for param in [p for p in o.state if id(p) not in had]:
            del o.state[param]
            state["state"].pop(names[id(param)], None)
    return state


def put_optimizer(model: torch.nn.Module, optimizer: Any, state: Any, full: bool) -> None:
    """Load a named optimizer state dict (whole when ``full``, else sharded like the model)."""
    options = StateDictOptions(full_state_dict=full and is_sharded(model))
    set_optimizer_state_dict(unwrap(model), _optimizers(optimizer), state, options=options)


def split_aliases(state_dict: Mapping[str, Any], who: str) -> tuple[dict, dict[str, str]]:
    """``(tensors by first name, {alias: first name})`` of a state dict with tied entries."""
    first, tensors, aliases = dict[tuple, str](), dict[str, torch.Tensor](), dict[str, str]()
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TreeError(
                f"{who}: state_dict entry {name!r} is {describe(value)}, not a tensor; a "
                "model file holds tensors only (return a tensor from get_extra_state)."
            )
        local = value.to_local() if isinstance(value, DTensor) else value  # this rank's shard
        key = (local.device, local.data_ptr(), local.dtype, tuple(value.shape), local.stride())
        if local.numel() and key in first:
            aliases[name] = first[key]
            continue
        first.setdefault(key, name)
        tensors[name] = value
    return tensors, aliases


def expand(tensors: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> dict[str, Any]:
    """The full state dict: every alias maps to its stored tensor."""
    return {**tensors, **{alias: tensors[name] for alias, name in aliases.items()}}


def few(names: Any) -> str:
    """At most 10 of ``names``, sorted and repr'ed, for an error message."""
    names = sorted(names)
    more = f" ... (+{len(names) - 10} more)" if len(names) > 10 else ""
    return ", ".join(map(repr, names[:10])) + more


def is_sharded(model: torch.nn.Module) -> bool:
    """True when any of ``model``'s parameters is a DTensor (FSDP2, tensor parallelism)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def save_shards(tensors: Mapping[str, torch.Tensor], folder: Path, group: Any) -> None:
    """Write ``tensors`` (DTensors and replicated plain tensors) into ``folder/sharded``.

    Collective over ``group`` (every rank calls it, ``folder`` already exists); each rank
    writes the pieces it owns, replicated tensors once.
    """
    (folder / SHARDS).mkdir(exist_ok=True)
    writer = HuggingFaceStorageWriter(str(folder / SHARDS), save_distributed=True)
    _dcp(dcp.save, tensors, group, storage_writer=writer)
    fsync_dir(folder / SHARDS)  # this rank's file's name, before rank 0 publishes the folder


def saved_shapes(folder: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every key of the shards with its whole (unsharded) shape and dtype, from the headers."""
    metadata: Any = HuggingFaceStorageReader(str(folder / SHARDS)).read_metadata()
    return {k: (v.size, v.properties.dtype) for k, v in metadata.state_dict_metadata.items()}


def load_shards(targets: Mapping[str, torch.Tensor], folder: Path, group: Any) -> None:
    """Fill ``targets`` (any sharding, or plain tensors) in place from ``folder/sharded``.

    Collective over ``group`` when one is given; every rank passes the same keys.
    """
    _dcp(dcp.load, targets, group, storage_reader=HuggingFaceStorageReader(str(folder / SHARDS)))


def _dcp(call: Callable[..., Any], tensors: Mapping[str, Any], group: Any, **storage: Any) -> None:
    with warnings.catch_warnings():
        if group is None:  # DCP works in this process alone, as meant: silence its warning
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        call(dict(tensors), process_group=group, no_dist=group is None, **storage)
