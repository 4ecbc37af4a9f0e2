"""Model and optimizer state through ``torch.distributed.checkpoint.state_dict``.

``get_model_state_dict`` and ``get_optimizer_state_dict`` give plain names (no
``_orig_mod.``/``module.``), optimizer state keyed by parameter name, and DTensors for a
sharded (FSDP2) model; their ``set_`` twins load them back, whatever the sharding. A tied
tensor is listed under each of its names; safetensors refuses to write shared memory
twice, so a file stores it under its first name and records the others as *aliases*.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from toolkit._checks import check
from toolkit._unwrap import unwrap
from toolkit.checkpoints._codec import TreeError, describe
from toolkit.checkpoints._files import CHECKSUM
from toolkit.checkpoints._sharded import is_sharded


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The unwrapped model's state dict (DTensors kept sharded), no copies."""
    return get_model_state_dict(unwrap(model))  # unwrap: nn.DataParallel's prefix too


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
        set_model_state_dict(
            unwrap(model), dict(state), options=StateDictOptions(full_state_dict=full)
        )


def parameter_names(model: torch.nn.Module, optimizer: Any) -> list[list[str]]:
    """Per parameter group, its parameters' names; a ValueError for a stray tensor."""
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
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def _optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)


def optimizer_state(model: torch.nn.Module, optimizer: Any, keep: bool = False) -> dict[str, Any]:
    """The optimizer's state dict keyed by parameter names (a MultiOptimizer's merged).

    An optimizer without state gets zero state, which is dropped again unless ``keep``
    (DCP loads a sharded checkpoint into it).
    """
    parameter_names(model, optimizer)  # the clear error for a stray tensor
    optimizers = _optimizers(optimizer)
    had = {id(p) for o in optimizers for p in o.state}
    state: dict[str, Any] = dict(get_optimizer_state_dict(unwrap(model), optimizers))
    # Own code: for an optimizer without state, get_optimizer_state_dict makes zero state
    # (one step at lr=0); a save must not change the run, so that state is dropped again.
    names = {id(p): name for name, p in unwrap(model).named_parameters()}
    for o in optimizers if not keep else ():
        for param in [p for p in o.state if id(p) not in had]:
            del o.state[param]
            state["state"].pop(names[id(param)], None)
    return state


def put_optimizer(model: torch.nn.Module, optimizer: Any, state: Any, full: bool) -> None:
    """Load a named optimizer state dict (whole when ``full``, else sharded like the model)."""
    options = StateDictOptions(full_state_dict=full and is_sharded(model))
    set_optimizer_state_dict(unwrap(model), _optimizers(optimizer), state, options=options)


def split_aliases(
    state_dict: Mapping[str, Any], who: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors by first name, {alias: first name})`` of a state dict with tied entries."""
    first: dict[tuple[Any, ...], str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TreeError(
                f"{who}: state_dict entry {name!r} is {describe(value)}, not a tensor; a "
                "model file holds tensors only (return a tensor from get_extra_state)."
            )
        local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor's shard
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


def model_differences(
    model: torch.nn.Module,
    shapes: Mapping[str, tuple[int, ...]],
    aliases: Mapping[str, str],
    frozen: str | None = None,
) -> list[str]:
    """How a saved model (names -> shapes, aliases) differs from ``model``; empty if none.

    With ``frozen`` (the fingerprint of a trainable-only save) the saved names are compared
    with ``model``'s trainable part and ``frozen`` with the fingerprint of the rest.
    """
    live, fingerprint = model_part(model, frozen is not None, "load_checkpoint")
    out = [] if fingerprint == frozen else [
        f"model: its frozen parameters ({fingerprint}) are not those the trainable-only "
        f"checkpoint was saved with ({frozen}); build the template on the same base model "
        "(the same pretrained weights, the same parameters frozen)."
    ]  # fmt: skip
    live, live_aliases = split_aliases(live, "load_checkpoint")
    saved_names, live_names = set(shapes) | set(aliases), set(live) | set(live_aliases)
    if live_names - saved_names:
        out.append(f"model: keys missing from the checkpoint: {few(live_names - saved_names)}")
    if saved_names - live_names:
        out.append(f"model: unexpected keys in the checkpoint: {few(saved_names - live_names)}")
    full_live = expand(live, live_aliases)
    common = saved_names & live_names
    for name in sorted(common):
        saved_shape, live_shape = shapes[aliases.get(name, name)], tuple(full_live[name].shape)
        if tuple(saved_shape) != live_shape:
            out.append(
                f"model: {name!r} has shape {list(saved_shape)} in the checkpoint, "
                f"{list(live_shape)} in the model"
            )
    saved_ties, live_ties = _ties(aliases, common), _ties(live_aliases, common)
    differ = {(saved_ties[n], live_ties[n]) for n in common if saved_ties[n] != live_ties[n]}
    for saved, tied in sorted(differ, key=str):
        out.append(
            f"model: tied weights differ: the checkpoint shares one tensor among "
            f"{sorted(saved)}, the model among {sorted(tied)} (tie the weights as in the "
            "saved model)"
        )
    return out


def _ties(aliases: Mapping[str, str], names: set[str]) -> dict[str, frozenset[str]]:
    """For each name, the names (among ``names``) that share its tensor."""
    groups: dict[str, set[str]] = {}
    for name in names:
        groups.setdefault(aliases.get(name, name), set()).add(name)
    return {name: frozenset(groups[aliases.get(name, name)]) for name in names}


def few(names: Any) -> str:
    """At most 10 of ``names``, sorted and repr'ed, for an error message."""
    names = sorted(names)
    more = f" ... (+{len(names) - 10} more)" if len(names) > 10 else ""
    return ", ".join(map(repr, names[:10])) + more
