"""The few torch.distributed facts a train step needs: data-parallel group, sync suppression."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "SYNC_KIND",
    "all_reduce_",
    "data_parallel_group",
    "data_parallel_size",
    "is_distributed",
    "is_rank_zero",
    "set_data_parallel_group",
    "suppress_grad_sync",
    "sync_kind",
]


_AVAILABLE = dist.is_available()  # fixed for the build of torch, so asked once


def is_distributed() -> bool:
    """True when a default process group with more than one rank is initialised."""
    return _AVAILABLE and dist.is_initialized() and dist.get_world_size() > 1


def _is_ddp(model: torch.nn.Module) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def _is_fsdp2(model: torch.nn.Module) -> bool:
    # fully_shard swaps the module's class for an FSDPModule subclass that has this method.
    # Looking on the class, not the instance, avoids nn.Module.__getattr__'s slow miss path
    # (it builds an AttributeError), which would cost microseconds per micro-batch.
    return hasattr(type(model), "set_requires_gradient_sync")


ProcessGroup = Any  # torch.distributed.ProcessGroup (absent from builds without distributed)

# Per model: the group given by set_data_parallel_group, and the group derived (or None),
# so that a train step asks once per model, not once per update.
_GIVEN: weakref.WeakKeyDictionary[torch.nn.Module, ProcessGroup] = weakref.WeakKeyDictionary()
_FOUND: weakref.WeakKeyDictionary[torch.nn.Module, ProcessGroup | None] = (
    weakref.WeakKeyDictionary()
)


def data_parallel_group(model: torch.nn.Module) -> ProcessGroup | None:
    """The process group over which ``model``'s gradients are averaged, or ``None``.

    The group a train step sums target counts over and all-reduces the guard's verdict
    over, and over which metrics are reduced and checkpoints coordinated. It is a fact of
    the model's data-parallel wrapper, so it is read from the model:

    * the group given with :func:`set_data_parallel_group`, when one was;
    * DDP: its ``process_group`` (the default group unless built with another);
    * FSDP2 (``fully_shard``): the group of its 1-D device mesh; for HSDP (a 2-D
      replicate x shard mesh) the whole mesh, which must then span the world (on a
      sub-mesh, flatten the replicate and shard dimensions yourself and pass the group to
      :func:`set_data_parallel_group`).

    ``None`` when ``torch.distributed`` is not initialised, when ``model`` is no DDP or
    FSDP2 model (each process trains its own), or when the group has one rank.

    Args:
        model: the model of the train state (DDP- or FSDP2-wrapped for data parallelism).

    Returns:
        A ``torch.distributed.ProcessGroup`` of more than one rank, or ``None``.

    Raises:
        ValueError: an FSDP2 model whose mesh does not tell its data-parallel ranks (a 2-D
            sub-mesh of a larger mesh, or ``dp_mesh_dims``); the message says to call
            :func:`set_data_parallel_group`.

    Example:
        >>> import torch
        >>> from toolkit import data_parallel_group
        >>> data_parallel_group(torch.nn.Linear(2, 1)) is None  # not data parallel
        True
    """
    if not (_AVAILABLE and dist.is_initialized()):
        return None
    try:
        return _FOUND[model]
    except KeyError:
        pass
    group = _GIVEN.get(model)
    if group is None:
        kind = sync_kind(model)
        if kind == "ddp":
            group = getattr(model, "process_group", None)
        elif kind == "fsdp2":
            group = _fsdp2_group(model)
    found = group if group is not None and dist.get_world_size(group) > 1 else None
    _FOUND[model] = found
    return found


def set_data_parallel_group(model: torch.nn.Module, group: ProcessGroup) -> None:
    """Name the data-parallel group of ``model`` where it cannot be derived, or differs.

    For tensor- or sequence-parallel training, where the data-parallel ranks are a
    sub-group of the world and the wrapper's own group does not say which (HSDP on a
    sub-mesh: pass ``mesh["replicate", "shard"]._flatten().get_group()``, created on every
    rank at setup). Every part of toolkit that asks :func:`data_parallel_group` then uses
    it: the step's count and verdict all-reduces, metrics, checkpoints.

    Args:
        model: a DDP- or FSDP2-wrapped model (the gradients of any other module are not
            synced by a wrapper, so it has no data-parallel group).
        group: a ``torch.distributed.ProcessGroup`` that holds this rank.

    Returns:
        None; :func:`data_parallel_group` returns ``group`` for ``model`` from now on.

    Raises:
        TypeError: ``model`` is not DDP- or FSDP2-wrapped, or ``group`` is not a process
            group.
        ValueError: this rank is not in ``group``.

    Example:
        >>> import torch
        >>> from toolkit import set_data_parallel_group
        >>> try:
        ...     set_data_parallel_group(torch.nn.Linear(2, 1), None)
        ... except TypeError as error:
        ...     print(str(error)[:58])
        set_data_parallel_group: expected a DDP- or FSDP2-wrapped
    """
    if sync_kind(model) == "none":
        raise TypeError(
            "set_data_parallel_group: expected a DDP- or FSDP2-wrapped model; got a "
            f"{type(model).__name__}, whose gradients no wrapper syncs. Wrap it first "
            "(DistributedDataParallel(model, process_group=group), or fully_shard), then "
            "name its group."
        )
    if not (_AVAILABLE and isinstance(group, dist.ProcessGroup)):
        raise TypeError(
            "set_data_parallel_group: expected a torch.distributed.ProcessGroup; got "
            f"{type(group).__name__}. Create it on every rank: dist.new_group(ranks) or "
            "device_mesh.get_group(dim)."
        )
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"set_data_parallel_group: this rank ({dist.get_rank()}) is not in the group "
            "given; pass the group that holds this rank."
        )
    _GIVEN[model] = group
    _FOUND.pop(model, None)


def _fsdp2_group(model: torch.nn.Module) -> ProcessGroup | None:
    for module in model.modules():
        get_state = getattr(type(module), "_get_fsdp_state", None)
        param_group = get_state(module)._fsdp_param_group if get_state is not None else None
        if param_group is None:
            continue
        info = param_group.mesh_info
        mesh = info.mesh
        if getattr(info, "dp_mesh_dims", None) is None:
            if mesh.ndim == 1:
                return mesh.get_group()
            if mesh.size() == dist.get_world_size():
                return dist.group.WORLD
        raise ValueError(
            f"data_parallel_group: the FSDP2 model's device mesh {mesh} does not tell its "
            "data-parallel ranks (a multi-dimensional sub-mesh, or dp_mesh_dims). Flatten "
            "its data-parallel dimensions at setup and name the group: "
            "set_data_parallel_group(model, mesh['replicate', 'shard']._flatten().get_group())."
        )
    return None


def data_parallel_size(model: torch.nn.Module) -> int:
    """Ranks over which ``model``'s gradients are averaged, 1 when not data parallel."""
    group = data_parallel_group(model)
    return 1 if group is None else dist.get_world_size(group)


def all_reduce_(
    tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: ProcessGroup | None = None
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` (the default group when None).

    A no-op when ``group`` is None and there is no default group of more than one rank.
    """
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    elif is_distributed():
        dist.all_reduce(tensor, op=op)
    return tensor


def is_rank_zero() -> bool:
    """True on global rank 0, and always when torch.distributed is not initialised."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


@contextlib.contextmanager
def _fsdp2_no_sync(model: torch.nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def suppress_grad_sync(
    model: torch.nn.Module, kind: str
) -> contextlib.AbstractContextManager[None] | None:
    """Context in which backward accumulates locally: DDP ``no_sync``, FSDP2 sync off.

    ``kind`` is :func:`sync_kind` of ``model``. ``None`` for any other model, so that
    single-process code does not even enter a context.
    """
    if kind == "ddp":
        return model.no_sync()  # type: ignore[operator]
    if kind == "fsdp2":
        return _fsdp2_no_sync(model)
    return None


def sync_kind(model: torch.nn.Module) -> str:
    """How ``model`` syncs gradients over ranks: "ddp", "fsdp2" or "none", once per class.

    A train step reads ``SYNC_KIND.get(type(model)) or sync_kind(model)``: the cache first.
    """
    kind = SYNC_KIND.get(type(model))
    if kind is None:
        kind = SYNC_KIND[type(model)] = (
            "ddp" if _is_ddp(model) else "fsdp2" if _is_fsdp2(model) else "none"
        )
    return kind


# Per model class, since fully_shard gives every sharded module a class of its own.
SYNC_KIND: dict[type, str] = {}
