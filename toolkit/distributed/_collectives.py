"""Everything that crosses ranks, in one place, on one device rule.

**The device rule** (:func:`_device`): every tensor this module reduces or broadcasts lives on
the device the group's backend reduces: the current CUDA device when the group has NCCL
(``"nccl"``, or ``"cuda:nccl,cpu:gloo"``), else the CPU (gloo). No extra backend is needed:
an NCCL-only group works as it is. A group with both reduces on CUDA too, because the
step's per-update flags are on the model's device already; only the rare agreement
tensors (checkpoints, signals) then pay a tiny copy and a host sync each. DDP's carrier is
the one exception by nature: its flags ride on DDP's own gradient bucket, on DDP's device.

**What crosses ranks, and what it costs** (beyond DDP's or FSDP2's own collectives). Each is
a few numbers, so its cost is one collective's latency and the host sync that reads it:

==================  ==============================================================  ==========
When                What                                                            Count
==================  ==============================================================  ==========
per micro-batch     nothing                                                         0
per update, DDP     loss sum, skips and skips² on DDP's first gradient bucket       0
                    (:class:`BucketFlags`)
per update, else    the verdict's flags and skip range, MAX (:func:`all_reduce_`)   1
                    under FSDP2, a DDP hook of the user's, bf16/fp16 grads,
                    transform_grads
per update, counts  the window's target count total, float64 SUM, over the token    1
                    ranks (:func:`groups_of`); on a mesh with replicas of them (tensor
                    parallelism) the total rides on the verdict's MAX as [total, -total]
per update, DTensor the gradient norm, one all-reduce per device mesh (``full_tensor``)  1 per mesh
per run             the ranks' data lengths, 2 int64 (:func:`check_even`)           1
per checkpoint      one int64 per phase, MIN (:func:`agree`), a token                a few
                    (:func:`broadcast_int`), the latest folder's name
                    (:func:`broadcast_text`)
on a failure        the lowest failing rank's error, as text                        2
per publish         metric or evaluation sums and counts, float64 SUM               1
                    (:func:`sum_over_ranks`)
signals             the highest signal number, int64 MAX (:func:`max_over_ranks`)   1 per 10
                                                                                    updates,
                                                                                    start, end
==================  ==============================================================  ==========

Nothing is pickled: every exchange is a tensor.
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
import functools
import weakref
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from toolkit.distributed._layout import Groups, current_layout, rank_of

_AVAILABLE = dist.is_available()  # fixed for the build of torch, so asked once

ProcessGroup = Any  # torch.distributed.ProcessGroup (absent from builds without distributed)
Group = ProcessGroup  # in every function here, a group None stands for "this process alone"


def _initialized() -> bool:
    return _AVAILABLE and dist.is_initialized()


def is_distributed() -> bool:
    """True when a default process group with more than one rank is initialised."""
    return _initialized() and dist.get_world_size() > 1


# Per model: its data-parallel group (or None), given by set_data_parallel_group or derived,
# so that a train step asks once per model, not once per update.
_FOUND = weakref.WeakKeyDictionary[torch.nn.Module, ProcessGroup | None]()


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
    if not _initialized():
        return None
    if model not in _FOUND:
        group: ProcessGroup | None = None
        if (kind := sync_kind(model)) != "none":
            group = model.process_group if kind == "ddp" else _fsdp2_group(model)
        _FOUND[model] = group if group is not None and dist.get_world_size(group) > 1 else None
    return _FOUND[model]


def set_data_parallel_group(model: torch.nn.Module, group: ProcessGroup) -> None:
    """Name the data-parallel group of ``model`` where it cannot be derived, or differs.

    The simple case: one group for samples, targets and verdicts alike (HSDP on a
    sub-mesh: pass ``mesh["replicate", "shard"]._flatten().get_group()``, created on every
    rank at setup). Every part of toolkit then uses it: the step's count and verdict
    all-reduces, metrics, checkpoints. A job on a mesh with tensor, context or expert
    dimensions describes it with :func:`toolkit.distributed.init_layout` instead, which
    takes precedence.

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
    who = "set_data_parallel_group: expected"
    if sync_kind(model) == "none":
        raise TypeError(f"{who} a DDP- or FSDP2-wrapped model; got a {type(model).__name__}.")
    if not (_AVAILABLE and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"{who} a ProcessGroup (dist.new_group); got {type(group).__name__}.")
    if dist.get_rank(group) < 0:
        raise ValueError(f"{who} a group holding this rank ({dist.get_rank()}); it is not in it.")
    _FOUND[model] = group if dist.get_world_size(group) > 1 else None


def _fsdp2_group(model: torch.nn.Module) -> ProcessGroup | None:
    for module in model.modules():
        get_state = getattr(type(module), "_get_fsdp_state", None)
        param_group = get_state(module)._fsdp_param_group if get_state is not None else None
        if param_group is None:
            continue
        mesh = param_group.mesh_info.mesh
        plain = getattr(param_group.mesh_info, "dp_mesh_dims", None) is None
        if plain and (mesh.ndim == 1 or mesh.size() == dist.get_world_size()):
            return mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD  # HSDP: the world
        raise ValueError(
            f"data_parallel_group: the FSDP2 model's device mesh {mesh} does not tell its "
            "data-parallel ranks (a multi-dimensional sub-mesh, or dp_mesh_dims). Flatten "
            "its data-parallel dimensions at setup and name the group: "
            "set_data_parallel_group(model, mesh['replicate', 'shard']._flatten().get_group())."
        )
    return None


def _device(group: ProcessGroup | None) -> torch.device:
    """The device whose tensors ``group``'s backend reduces (see the module docstring)."""
    nccl = "nccl" in dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if nccl else _CPU


_CPU = torch.device("cpu")


def all_reduce_(
    tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: ProcessGroup | None = None
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` (None: this process alone, a no-op).

    Reduced on the group's device: the step's flags, on the model's device, are there
    already; elsewhere they go over and back.
    """
    if group is None:
        return tensor
    moved = tensor.to(_device(group))
    dist.all_reduce(moved, op=op, group=group)
    return tensor if moved is tensor else tensor.copy_(moved.to(tensor.device))


def is_rank_zero() -> bool:
    """True on global rank 0, and always when torch.distributed is not initialised."""
    return not _initialized() or dist.get_rank() == 0


@contextlib.contextmanager
def _fsdp2_no_sync(model: torch.nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def suppress_grad_sync(
    model: torch.nn.Module, kind: str
) -> contextlib.AbstractContextManager[None]:
    """Context in which backward accumulates locally: DDP ``no_sync``, FSDP2 sync off.

    ``kind`` is :func:`sync_kind` of ``model``; any other model gets a context that does
    nothing (the step does not enter one in a single process).
    """
    if kind == "ddp":
        return model.no_sync()  # type: ignore[operator, no-any-return]
    return _fsdp2_no_sync(model) if kind == "fsdp2" else contextlib.nullcontext()


def sync_kind(model: torch.nn.Module) -> str:
    """How ``model`` syncs gradients over ranks: "ddp", "fsdp2" or "none", once per class.

    Worked out once per class and cached in ``SYNC_KIND``: the step asks per micro-batch.
    """
    kind = SYNC_KIND.get(type(model))
    if kind is None:
        # fully_shard swaps the module's class for an FSDPModule subclass with this method.
        fsdp2 = hasattr(type(model), "set_requires_gradient_sync")
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        kind = SYNC_KIND[type(model)] = "ddp" if ddp else "fsdp2" if fsdp2 else "none"
    return kind


# Per model class, since fully_shard gives every sharded module a class of its own.
SYNC_KIND: dict[type, str] = {}


# --- checkpoint coordination ---


# The kinds of error another rank re-raises, by index (0: any other); OSError keeps its errno.
_TYPES: tuple[type[BaseException], ...] = (RuntimeError, OSError, ValueError, TypeError)
_LIMIT = 8192  # bytes of an error message sent to the other ranks


_ALONE = Groups(None, None, None)


def groups_of(model: torch.nn.Module) -> Groups:
    """The groups of ``model``'s job: the job's :class:`Layout` when one is set, else
    ``model``'s data-parallel group for all three (:func:`data_parallel_group`)."""
    layout = current_layout()
    if layout is not None:
        return layout.groups
    group = data_parallel_group(model)
    return _ALONE if group is None else Groups(group, group, group)


def broadcast_int(value: int, group: Group | None, src: int = 0) -> int:
    """``value`` of rank ``src`` (a group rank), on every rank."""
    return _exchange([value], torch.int64, group, src=src)[0]


def broadcast_text(text: str, group: Group | None, src: int = 0) -> str:
    """``text`` of rank ``src``, on every rank (UTF-8 bytes in a tensor: nothing pickled)."""
    if group is None:
        return text
    data = text.encode()[:_LIMIT] if rank_of(group)[0] == src else b""
    size = broadcast_int(len(data), group, src)
    got = _exchange(list(data) or [0] * size, torch.uint8, group, src=src) if size else []
    return bytes(got).decode(errors="replace")


def agree(error: BaseException | None, group: Group | None, who: str) -> None:
    """Make every rank see the same outcome of a phase: nothing, or an error.

    One all-reduce of one integer (MIN: the lowest failing rank); when a rank failed, it also
    broadcasts its error's kind, errno and message as one text. The failing ranks re-raise
    their own error, the others raise the same kind (``OSError`` keeps its errno) naming
    the rank. With ``group`` None (this process alone) nothing crosses: its own error, if
    any, is raised.

    Raises:
        BaseException: the error of this rank, or of the lowest failing one.
    """
    rank, size = rank_of(group)
    src = _exchange([size if error is None else rank], torch.int64, group, dist.ReduceOp.MIN)[0]
    if src == size:  # no rank failed
        return
    said = ""
    if rank == src:  # the lowest failing rank tells its error
        index = next((i for i, t in enumerate(_TYPES) if i and isinstance(error, t)), 0)
        said = f"{index} {getattr(error, 'errno', None) or 0} {error}"
    kind, code, message = broadcast_text(said, group, src).split(" ", 2)
    if error is not None:
        raise error
    error_type, text = _TYPES[int(kind)], f"{who}: rank {src} of the group failed: {message}"
    raise OSError(int(code) or errno_codes.EIO, text) if error_type is OSError else error_type(text)


# --- the DDP carrier ---


# Only dtypes that hold the small integer sums exactly ride along; a model whose gradients
# are bf16 or fp16 falls back to the step's own small all-reduce.
_EXACT = (torch.float32, torch.float64)


class BucketFlags:
    """A DDP model's hook state: the flags to send with the next sync, and what came back.

    The flags join DDP's first gradient bucket on its device (the model's, which DDP's
    backend reduces), so they follow DDP rather than :func:`_device`.

    ``outgoing`` is ``[loss, skipped, skipped**2]`` of this rank, set just before the
    closing backward (``loss``: the window's summed loss under the guard, else 0); the hook
    sums it over the ranks with the first bucket and leaves the sums in ``incoming`` by the
    time backward returns. The summed loss is finite when every rank's is (a sum of
    finite losses would overflow only past 3e38 in float32); the ranks skipped different
    numbers of micro-batches when ``skips**2 != world * squares`` (equal for equal counts
    only: Cauchy-Schwarz), exact in float32 for any realistic count.
    """

    __slots__ = ("__weakref__", "group", "incoming", "outgoing")

    def __init__(self, group: Any) -> None:
        self.group = group
        self.outgoing: torch.Tensor | None = None
        self.incoming: torch.Tensor | None = None

    def send(self, loss: torch.Tensor | None, skipped: int, like: torch.Tensor) -> None:
        """Flags for the next closing backward (``like``: a parameter, for the device)."""
        # The common case, nothing skipped: no tensor built per update.
        skips = torch.tensor([skipped, skipped**2.0], device=like.device) if skipped else None
        skips = _zeros(like.device, 2) if skips is None else skips
        loss = _zeros(like.device, 1) if loss is None else loss
        self.outgoing = torch.cat([loss.reshape(1), skips])
        self.incoming = None

    def receive(self) -> torch.Tensor | None:
        """The reduced flags of the backward that just ran, or None if none were carried."""
        got, self.incoming, self.outgoing = self.incoming, None, None
        return got


@functools.cache
def _zeros(device: torch.device, size: int) -> torch.Tensor:
    """A float32 zero vector of ``size``, made once per device (read, never written)."""
    return torch.zeros(size, device=device)


# Per DDP model: its bucket flags, or None where the hook cannot be installed.
_BUCKET_FLAGS = weakref.WeakKeyDictionary[torch.nn.Module, BucketFlags | None]()


def bucket_flags(model: torch.nn.Module) -> BucketFlags | None:
    """The carrier of DDP ``model`` (its hook registered on first use), or None.

    None when the step's verdict group is not the group DDP averages over
    (``set_data_parallel_group`` or a layout named another), or when the model already has a
    communication hook of its own (DDP takes one): the step then all-reduces its flags
    itself, as it does under FSDP2.
    """
    if model not in _BUCKET_FLAGS:
        group = groups_of(model).everyone
        _BUCKET_FLAGS[model] = None  # until the hook is registered
        if group is not None and group is getattr(model, "process_group", None):
            flags = BucketFlags(group)
            # "can only be called once": when the user's own hook is there, none of ours
            with contextlib.suppress(RuntimeError):
                model.register_comm_hook(flags, _hook)  # type: ignore[operator]
                _BUCKET_FLAGS[model] = flags
    return _BUCKET_FLAGS[model]


def _hook(carrier, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
    """DDP's allreduce_hook (divide, sum), with the flags appended to the first bucket."""
    group, buffer = carrier.group, bucket.buffer()
    buffer.div_(group.size())  # as torch's default allreduce_hook: the same result as no hook
    flags = carrier.outgoing if bucket.index() == 0 and buffer.dtype in _EXACT else None
    if flags is None:
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    carrier.outgoing, size = None, buffer.numel()
    packed = torch.cat([buffer, flags.to(buffer.dtype)])

    def unpack(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        summed = fut.value()[0]
        carrier.incoming = summed[size:]
        return summed[:size]

    return dist.all_reduce(packed, group=group, async_op=True).get_future().then(unpack)


Pair = tuple[float, float]  # a weighted sum and its weight


def sum_over_ranks(
    who: str, sums: Mapping[str, Pair], extra: Sequence[float] = (), group: Any = None
) -> tuple[dict[str, Pair], list[float]]:
    """``sums`` and ``extra`` added over the ranks of ``group``: one collective, if any.

    ``group`` is the ranks that hold different targets (:func:`groups_of`'s ``tokens``;
    None: this process alone, nothing is exchanged).

    Raises:
        ValueError: the ranks hold different keys (the sums travel as one vector).
    """
    if group is None:
        return dict(sums), list(extra)
    keys = sorted(sums)
    layout = float(zlib.crc32("\0".join(keys).encode()))
    flat = [v for key in keys for v in sums[key]] + [*extra, layout]
    values = _exchange(flat, torch.float64, group)
    if values[-1] != layout * dist.get_world_size(group):
        raise ValueError(
            f"{who}: the data-parallel ranks reported different keys (this rank: {keys}); "
            "every rank must report the same ones."
        )
    pairs = {key: (values[2 * i], values[2 * i + 1]) for i, key in enumerate(keys)}
    return pairs, values[2 * len(keys) : -1]


def check_even(batches: int | None, group: Any) -> None:
    """Refuse passes of different lengths on the ranks of a data-parallel ``group``.

    Every update of a data-parallel step makes collective calls, so a rank whose pass holds
    more batches would wait forever at the end of the others' pass (and ranks whose epochs
    end at different updates disagree on everything done per epoch). One all-reduce of two
    integers, once per run, on every rank of ``group`` (None: no data parallelism, no
    check). Sources without a length cannot be checked: an IterableDataset must yield the
    same number of batches on every rank by itself.

    Args:
        batches: :func:`batches_per_epoch` of this rank's data.
        group: the data-parallel process group, or None.

    Raises:
        ValueError: the ranks' lengths differ (or some have none), naming this rank's
            length, the others' range and the fix.
    """
    value = -1 if batches is None else batches  # no length
    fewest, most = value_range(value, group)
    if most == fewest:
        return
    said = {n: "no length" if n < 0 else f"{n} batches" for n in (value, fewest, most)}
    raise ValueError(
        f"run: the data-parallel ranks' data have different lengths (this rank "
        f"{dist.get_rank()}: {said[value]}; the ranks range from {said[fewest]} to "
        f"{said[most]} per pass), so at the end of the shortest pass the other ranks would "
        "wait forever in the step's all-reduce. Give every rank the same number of "
        "batches: a DataLoader with sampler=DistributedSampler(dataset) and drop_last=True."
    )


def value_range(value: float, group: Group | None) -> tuple[int, int]:
    """The smallest and the largest ``value`` of the ranks of ``group`` (batches, skips,
    counts; a fraction is cut to an integer): one MAX all-reduce of ``[value, -value]``.
    For an error message, on every rank of the group once they know the values differ."""
    most, minus_fewest = _exchange([value, -value], torch.int64, group, dist.ReduceOp.MAX)
    return -minus_fewest, most


def max_over_ranks(value: int, group: Group | None) -> int:
    """The largest ``value`` of the ranks of ``group`` (one all-reduce); ``value`` alone."""
    return _exchange([value], torch.int64, group, dist.ReduceOp.MAX)[0]


def _exchange(
    values: list[Any], dtype: torch.dtype, group: Group | None, op: Any = None, src: int = -1
) -> list[Any]:
    """``values`` summed (or reduced by ``op``) over ``group``, or rank ``src``'s broadcast,
    in one tensor on the group's device (:func:`_device`), read back with one host sync.

    ``group`` None is this process alone: ``values`` come back as they are.
    """
    if group is None:
        return values
    tensor = torch.tensor(values, dtype=dtype, device=_device(group))
    if src < 0:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group)
    else:
        dist.broadcast(tensor, group=group, group_src=src)
    return tensor.tolist()
