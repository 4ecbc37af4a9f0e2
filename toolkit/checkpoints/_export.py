"""export_model: one plain safetensors file of a model's weights; export_pretrained: a folder
in the layout of Hugging Face's ``save_pretrained`` (config, tied weights once, shards)."""

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from toolkit._checks import check, check_one_of, check_type
from toolkit._unwrap import unwrap
from toolkit.checkpoints._codec import host_tensor, separate_shared
from toolkit.checkpoints._files import replace_file, write_tensors
from toolkit.checkpoints._load import content_problems, full_model, full_tree, verified_manifest
from toolkit.checkpoints._manifest import DamagedCheckpointError
from toolkit.checkpoints._model_state import is_sharded, model_state, split_aliases
from toolkit.step._state import TrainState


def export_model(
    source: torch.nn.Module | TrainState | str | os.PathLike[str], path: str | os.PathLike[str],
    *, weights: str = "model", key: str = "ema", dtype: torch.dtype | None = None,
) -> Path:  # fmt: skip
    """Write a model's weights as one plain safetensors file, for inference and hub tools.

    The names are the unwrapped model's (no ``_orig_mod.``/``module.`` prefixes), so
    ``model.load_state_dict(safetensors.torch.load_file(path), strict=True)`` loads it
    into the plain model. Tied weights are written under *each* of their names (the file
    then holds the tied tensor more than once) because a strict load needs every name;
    training checkpoints store them once instead. The file is written to a temporary
    sibling, fsync'ed and renamed, with the metadata ``{"format": "pt"}`` that hub tools
    expect.

    Args:
        source: a module, a TrainState (its model), or a checkpoint folder written by
            :func:`save_checkpoint` (verified before reading; a sharded FSDP2 checkpoint
            is put together in this process, whatever the number of ranks that wrote it).
            A module may be wrapped (``torch.compile``, DDP: :func:`unwrap` peels them). In
            a process group rank 0 writes; an FSDP2 model is gathered (a collective): call
            it on every rank.
        path: the file to write, e.g. ``"runs/a/model.safetensors"``.
        weights: ``"model"`` for the trained weights, ``"ema"`` for the exponential moving
            average kept by :func:`toolkit.plugins.ema` in ``extras[key]`` (buffers it does
            not average are the model's).
        key: the ``extras`` key of the EMA.
        dtype: cast floating-point tensors to this dtype (e.g. ``torch.bfloat16``).

    Returns:
        The path written.

    Raises:
        ValueError: ``weights`` is not ``"model"``/``"ema"``, ``"ema"`` with a bare module
            or a live FSDP2 one, or an EMA whose names the model lacks.
        KeyError: ``weights="ema"`` and no EMA under ``extras[key]``.
        TypeError: ``source`` is none of the accepted kinds.
        DamagedCheckpointError: a checkpoint folder whose files are damaged.

    Example:
        >>> import torch
        >>> from safetensors.torch import load_file
        >>> from toolkit import export_model
        >>> net = torch.nn.Linear(2, 1)
        >>> path = export_model(torch.compile(net, backend="eager"), "model.safetensors")
        >>> torch.nn.Linear(2, 1).load_state_dict(load_file(path), strict=True)
        <All keys matched successfully>
    """
    full, path = _read(source, weights, key, "export_model")[0], Path(path)
    if full is not None:  # else another rank writes
        cast = {n: v.to(dtype) for n, v in full.items() if dtype and v.is_floating_point()}
        tensors = {name: host_tensor(value) for name, value in {**full, **cast}.items()}
        separate_shared(tensors)  # a tied tensor is written under each name: copies
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, lambda temp: write_tensors(temp, tensors))
    return path


def export_pretrained(
    source: torch.nn.Module | TrainState | str | os.PathLike[str], folder: str | os.PathLike[str],
    *, model: torch.nn.Module | None = None, weights: str = "model", key: str = "ema",
    merge: bool = False, max_shard_size: int | str = "5GB", tokenizer: Any = None,
) -> Path:  # fmt: skip
    """Write a folder that ``from_pretrained`` loads: a transformers model or a peft adapter.

    The weights (of ``source``, or its EMA) are handed to the model's own ``save_pretrained``
    as its ``state_dict``, so the folder is exactly the library's layout:

    * a ``transformers`` model: ``config.json``, ``generation_config.json`` and
      ``model.safetensors``, tied weights stored once (``lm_head.weight`` rides on the
      embedding), split into ``model-0000k-of-0000n.safetensors`` with a
      ``model.safetensors.index.json`` above ``max_shard_size``; loads with
      ``AutoModelForCausalLM.from_pretrained(folder)``;
    * a peft ``PeftModel``: the adapter alone (``adapter_config.json``,
      ``adapter_model.safetensors``, a few MB for a LoRA); loads with
      ``PeftModel.from_pretrained(base_model, folder)``;
    * a ``PeftModel`` with ``merge=True``: a copy with the adapter merged into the base
      weights (peft's ``merge_and_unload``), written as a plain ``transformers`` model.

    The model itself is not changed. The folder is written in place by ``save_pretrained``
    (not atomically as :func:`export_model` writes its file): export to a fresh folder.

    Args:
        source: a module (wrapped or FSDP2, as in :func:`export_model`), a TrainState (its
            model) or a checkpoint folder written by :func:`save_checkpoint`.
        folder: the folder to write, e.g. ``"runs/a/hf"``.
        model: the model whose ``save_pretrained`` writes the folder (its config and class);
            needed for a checkpoint folder, e.g. ``AutoModelForCausalLM.from_config(config)``
            or the ``PeftModel`` the run trained; by default the source's model.
        weights: ``"model"`` or ``"ema"`` (frozen parameters come from the model), as in
            :func:`export_model`.
        key: the ``extras`` key of the EMA.
        merge: merge a peft adapter into the base weights instead of exporting the adapter.
        max_shard_size: the largest shard, bytes or a string such as ``"5GB"``.
        tokenizer: a tokenizer whose ``save_pretrained`` writes its files into the folder too.

    Returns:
        ``folder``, as a Path.

    Raises:
        TypeError: ``model`` (or the source's) has no ``save_pretrained`` (for any module,
            :func:`export_model` writes a file), or ``source`` is none of the accepted kinds.
        ValueError: the weights' names do not match ``model``'s, or ``merge=True`` without
            a peft adapter or for a live FSDP2 model (export its checkpoint folder); as
            :func:`export_model` for ``weights``.

    Example:
        >>> from transformers import AutoModelForCausalLM, GPT2Config
        >>> from toolkit import export_pretrained
        >>> config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8,
        ...                     bos_token_id=0, eos_token_id=0)
        >>> net = AutoModelForCausalLM.from_config(config)
        >>> folder = export_pretrained(net, "hf")
        >>> loaded = AutoModelForCausalLM.from_pretrained(folder)
        >>> sorted(p.name for p in folder.iterdir())
        ['config.json', 'generation_config.json', 'model.safetensors']
    """
    who = "export_pretrained"
    live = source.model if isinstance(source, TrainState) else source
    fix = "Export the folder save_checkpoint writes: it merges into a whole copy."
    sharded = isinstance(live, torch.nn.Module) and is_sharded(live)  # refused before the gather
    check(not (merge and sharded), who, "merge", "False for a live FSDP2 model", merge, fix)
    full, own = _read(source, weights, key, who)
    target: Any = own if model is None else model
    target = unwrap(target) if isinstance(target, torch.nn.Module) else target
    fix = "pass model=AutoModelForCausalLM.from_config(config) (or your PeftModel); for any "
    fix += "other module, export_model writes a file."
    ok = callable(getattr(target, "save_pretrained", None))
    check_type(ok, who, "model", "a transformers or peft model", target, fix)
    if full is None:  # another rank writes
        return Path(folder)
    names = target.state_dict().keys()
    if full.keys() != names:
        raise ValueError(
            f"{who}: the weights do not fit the model: missing {sorted(names - full.keys())[:5]}"
            f", unexpected {sorted(full.keys() - names)[:5]}; pass the model that was trained."
        )
    if merge:
        peft = hasattr(target, "merge_and_unload")
        check(peft, who, "merge", "False for a model without a peft adapter", merge)
        target = copy.deepcopy(target)
        target.load_state_dict(full)
        target, full = target.merge_and_unload(), None  # None: the merged model's own weights
    target.save_pretrained(folder, state_dict=full, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return Path(folder)


def _read(source: Any, weights: str, key: str, who: str) -> tuple[dict[str, Any] | None, Any]:
    """The full state dict, with the EMA's parameters and buffers (``extras[key]``) for the
    live ones with ``weights="ema"`` (None on ranks other than 0), and the source's module
    (None for a checkpoint folder)."""
    check_one_of(who, "weights", weights, ("model", "ema"))
    model, ema = None, weights == "ema"
    if isinstance(source, (str, os.PathLike)):
        manifest = verified_manifest(source)  # and what a load checks without a template:
        if problems := content_problems(manifest, allow_nonfinite=True):
            raise DamagedCheckpointError(manifest.path, problems)
        full, aliases, where = full_model(manifest), manifest.aliases, f"checkpoint {source}"
        extras = full_tree(manifest, "extras") if ema and manifest.has("extras") else {}
    else:
        model = source.model if isinstance(source, TrainState) else source
        kinds = "a module, a TrainState or a checkpoint folder"
        check_type(isinstance(model, torch.nn.Module), who, "source", kinds, source)
        sharded = is_sharded(model)  # FSDP2: gathered (a collective), whole on rank 0's CPU
        fix = "export the folder save_checkpoint writes (it puts the EMA together)."
        check(not (ema and sharded), who, "weights", "'model' for an FSDP2 model", weights, fix)
        full, where = model_state(model, sharded), "the state"
        aliases = split_aliases(full, who)[1]  # and a clear error for a non-tensor entry
        extras = source.extras if isinstance(source, TrainState) else None
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None, model  # in a process group rank 0 writes
    # A sharded checkpoint's pieces hold each tied tensor once: every name, one object.
    full.update({alias: full[name] for alias, name in aliases.items()})
    if not ema:
        return full, model
    if extras is None:
        raise ValueError(
            f"{who}: weights='ema' needs a TrainState or a checkpoint folder (the EMA lives in "
            "state.extras); got a bare module."
        )
    entry = extras.get(key)
    if not isinstance(entry, Mapping) or not isinstance(entry.get("params"), Mapping):
        raise KeyError(
            f"{who}: {where} has no EMA weights under extras[{key!r}] (extras keys: "
            f"{sorted(extras)}); train with the ema(key={key!r}) plugin, or export weights='model'."
        )
    averaged = {**entry["params"], **(entry.get("buffers") or {})}
    unknown = sorted(set(averaged) - set(full))
    fix = "It was made for another model."
    check(not unknown, who, "the EMA's names", "the model's", unknown[:5], fix)
    wrong = sorted(n for n, t in averaged.items() if getattr(t, "shape", None) != full[n].shape)
    check(not wrong, who, "the shapes of the EMA's tensors", "the model's", wrong[:5], fix)
    tied = {alias: averaged[name] for alias, name in aliases.items() if name in averaged}
    return {**full, **averaged, **tied}, model  # the EMA names a tied tensor once
