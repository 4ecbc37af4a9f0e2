"""Checkpoint coordination across the ranks of a data-parallel group, without pickle.

A checkpoint of a data-parallel model (DDP or FSDP2) is written and read by every rank of
its group together: the ranks agree on a temporary folder, on the outcome of each phase
(success, or the same error everywhere) and on which checkpoint ``resume="latest"`` loads.
Everything exchanged is a tensor (flags, numbers, UTF-8 bytes), never a pickled object.
"""

from __future__ import annotations

import errno as errno_codes
from typing import Any

import torch
import torch.distributed as dist

from toolkit.distributed._group import data_parallel_group, sync_kind

__all__ = ["Group", "agree", "broadcast_int", "broadcast_text", "group_of", "rank_of"]

Group = Any  # a torch.distributed ProcessGroup; None stands for "this process alone"

_TYPES: dict[int, type[BaseException]] = {0: RuntimeError, 1: OSError, 2: ValueError, 3: TypeError}
_LIMIT = 8192  # bytes of an error message sent to the other ranks


def group_of(model: torch.nn.Module) -> Group | None:
    """The process group that checkpoints ``model`` together, or None (this process alone).

    A DDP- or FSDP2-wrapped model is shared by the ranks of its data-parallel group
    (``toolkit.distributed._group.data_parallel_group(model)``: the wrapper's group, or the one
    named with ``set_data_parallel_group``; the default group where that helper is absent);
    any other module is this process's own, even in a distributed job.
    """
    if not (dist.is_available() and dist.is_initialized()) or sync_kind(model) == "none":
        return None
    return data_parallel_group(model)


def rank_of(group: Group | None) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group`` (``(0, 1)`` for None)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def broadcast_int(value: int, group: Group | None, src: int = 0) -> int:
    """``value`` of rank ``src`` (a group rank), on every rank."""
    if group is None:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(tensor, group=group, group_src=src)
    return int(tensor.item())


def broadcast_text(text: str, group: Group | None, src: int = 0) -> str:
    """``text`` of rank ``src``, on every rank (UTF-8 bytes in a tensor: nothing pickled)."""
    if group is None:
        return text
    data = text.encode()[:_LIMIT] if rank_of(group)[0] == src else b""
    size = broadcast_int(len(data), group, src)
    buffer = torch.zeros(size, dtype=torch.uint8)
    if data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if size:
        dist.broadcast(buffer, group=group, group_src=src)
    return bytes(buffer.tolist()).decode(errors="replace")


def _kind(error: BaseException) -> int:
    for code, kind in _TYPES.items():
        if code and isinstance(error, kind):
            return code
    return 0


def agree(error: BaseException | None, group: Group | None, who: str) -> None:
    """Make every rank see the same outcome of a phase: nothing, or an error.

    One all-reduce of one flag per rank; when a rank failed, the lowest failing rank also
    broadcasts its error's kind and message. The failing ranks re-raise their own error,
    the others raise the same kind (``OSError`` keeps its errno) naming the rank.

    Raises:
        BaseException: the error of this rank, or of the lowest failing one.
    """
    if group is None:
        if error is not None:
            raise error
        return
    rank, size = rank_of(group)
    flags = torch.zeros(size, dtype=torch.int64)
    flags[rank] = error is not None
    dist.all_reduce(flags, group=group)
    failed = [r for r in range(size) if flags[r]]
    if not failed:
        return
    src = failed[0]
    kind = broadcast_int(_kind(error) if rank == src and error is not None else 0, group, src)
    code = broadcast_int(
        getattr(error, "errno", None) or 0 if rank == src and error is not None else 0, group, src
    )
    message = broadcast_text(str(error) if rank == src else "", group, src)
    if error is not None:
        raise error
    text = f"{who}: rank {src} of the group failed: {message}"
    kind_type = _TYPES[kind]
    if kind_type is OSError:
        raise OSError(code or errno_codes.EIO, text)
    raise kind_type(text)
