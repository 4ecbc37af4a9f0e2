"""The few torch.distributed facts a train step needs: data-parallel size, sync suppression."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = [
    "SYNC_KIND",
    "all_reduce_",
    "data_parallel_size",
    "is_distributed",
    "is_rank_zero",
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


def data_parallel_size(model: torch.nn.Module) -> int:
    """World size over which ``model``'s gradients are averaged, 1 when not data parallel."""
    if not (_AVAILABLE and dist.is_initialized()):
        return 1
    return dist.get_world_size() if sync_kind(model) != "none" else 1


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    """All-reduce ``tensor`` in place over the default group; a no-op without one."""
    if is_distributed():
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
