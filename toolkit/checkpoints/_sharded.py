"""Sharded tensors (FSDP2's DTensors) in a checkpoint, through torch.distributed.checkpoint.

A checkpoint of a sharded model keeps its model, its optimizer's tensors and any DTensor
in ``extras`` in the ``sharded/`` sub-folder of the checkpoint: one safetensors file per
rank (``shard-0000N-model-00001-of-00001.safetensors``), written by
``torch.distributed.checkpoint`` (DCP) with its Hugging Face storage writer, each file's
header naming the offsets of the pieces it holds. Keys are ``model/<name>`` and
``<tree>/<path>`` (the JSON document of the tree refers to them with
``{"$tensor": key, "dcp": true}``).

DCP's own file format pickles its metadata (``.metadata``) and reads tensors with
``torch.load``; this layout has neither: the reader (``HuggingFaceStorageReader``) builds
DCP's metadata from the safetensors headers and reads slices with ``safetensors`` alone.
It lists the folder, so a load first checks that ``sharded/`` holds exactly the files the
manifest lists, each of the right size and checksum (see :func:`._manifest.file_problems`).

Loading goes through DCP too, into the template's own tensors, so a checkpoint written by
any number of ranks loads into any other sharding, a DDP model or a plain one.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["SHARDS", "is_dtensor", "is_sharded", "load_shards", "save_shards", "saved_shapes"]

SHARDS = "sharded"  # the sub-folder of a checkpoint that holds DCP's files


def is_dtensor(value: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (an FSDP2 shard)."""
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def is_sharded(model: torch.nn.Module) -> bool:
    """True when any of ``model``'s parameters is a DTensor (FSDP2, tensor parallelism)."""
    return any(is_dtensor(p) for p in model.parameters())


def save_shards(tensors: Mapping[str, torch.Tensor], folder: Path, group: Any) -> None:
    """Write ``tensors`` (DTensors and replicated plain tensors) into ``folder/sharded``.

    Collective over ``group`` (every rank calls it, ``folder`` already exists); each rank
    writes the pieces it owns, replicated tensors once.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    target = folder / SHARDS
    target.mkdir(exist_ok=True)
    writer = HuggingFaceStorageWriter(str(target), save_distributed=True)
    with _alone(group):
        dcp.save(dict(tensors), storage_writer=writer, process_group=group, no_dist=group is None)


def _reader(folder: Path) -> Any:
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    return HuggingFaceStorageReader(str(folder / SHARDS))


def saved_shapes(folder: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every key of the shards with its whole (unsharded) shape and dtype, from the headers."""
    metadata = _reader(folder).read_metadata()
    return {
        key: (entry.size, entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
    }


def load_shards(targets: Mapping[str, torch.Tensor], folder: Path, group: Any) -> None:
    """Fill ``targets`` (any sharding, or plain tensors) in place from ``folder/sharded``.

    Collective over ``group`` when one is given; every rank passes the same keys.
    """
    import torch.distributed.checkpoint as dcp

    reader = _reader(folder)
    with _alone(group):
        dcp.load(dict(targets), storage_reader=reader, process_group=group, no_dist=group is None)


@contextlib.contextmanager
def _alone(group: Any) -> Iterator[None]:
    """Without a group DCP works in this process alone, as meant: silence its warning."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
