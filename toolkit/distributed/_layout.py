"""The job's parallel layout: one ``DeviceMesh`` with named dimensions, and the group each
part of toolkit asks of it, named for what that part needs (docs/distributed.md, "Meshes").

=====================  ======================================  ===================================
``Layout.groups.``      ranks                                   asked by
=====================  ======================================  ===================================
``data``               hold different samples                  the sampler, ``run()``'s even-data
                                                               check, the data position
``tokens``             hold different targets of the loss      ``LossSum`` counts, metric and
                       (data x context)                        evaluation sums
``everyone``           the whole mesh                          the step's verdict, checkpoints,
                                                               signals
=====================  ======================================  ===================================

Ranks of one dimension that is neither data nor context (tensor, expert within a replica)
hold the same samples and the same loss: they are counted once.
"""

import dataclasses
import math
from typing import Any, NamedTuple

import torch.distributed as dist

from toolkit._checks import check, check_type


class Groups(NamedTuple):
    """The process groups a job asks for, each None for this process alone.

    Attributes:
        data: the ranks that hold different samples (the sampler, the data's even length).
        tokens: the ranks that hold different targets (``LossSum`` counts, metric sums).
        everyone: the ranks that agree on the step's verdict, save checkpoints, share
            signals.

    Example:
        >>> from toolkit.distributed import Groups
        >>> Groups(data=None, tokens=None, everyone=None).tokens is None  # one process
        True
    """

    data: Any
    tokens: Any
    everyone: Any


DIMS = ("dp_replicate", "dp_shard", "cp", "tp")  # init_layout's dimensions, outermost first


@dataclasses.dataclass(frozen=True)
class Layout:
    """A device mesh and which of its dimensions split the samples and the tokens.

    Build it on every rank at setup (flattening dimensions creates process groups); then
    :func:`set_layout` makes it the job's, and every part of toolkit asks it for its group.

    Attributes:
        mesh: a ``torch.distributed.device_mesh.DeviceMesh`` with named dimensions.
        data: the dimensions whose ranks hold different samples.
        context: the dimensions whose ranks hold different tokens of one sample (context or
            sequence parallelism: each rank's ``LossSum`` counts its own tokens).

        groups: the :class:`Groups` made from them at construction.

    Example:
        >>> import torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from toolkit.distributed import Layout
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        >>> layout = Layout(mesh, data=("dp",))
        >>> layout.sampler_options(), layout.groups.tokens is None  # one rank: no group
        ({'num_replicas': 1, 'rank': 0}, True)
        >>> dist.destroy_process_group()
    """

    mesh: Any
    data: tuple[str, ...] = ()
    context: tuple[str, ...] = ()
    groups: Groups = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = tuple(getattr(self.mesh, "mesh_dim_names", None) or ())
        for given in (*self.data, *self.context):
            fix = f"Name a dimension of the mesh {names}, or build it with mesh_dim_names."
            check(given in names, "Layout", "dimension", f"one of {names}", given, fix)
        ranks = self.mesh.mesh.flatten().tolist()
        fix = "Build the layout over a mesh of every rank (init_device_mesh) on every rank."
        check(self.mesh.get_coordinate() is not None, "Layout", "mesh", f"a mesh holding this "
              f"rank ({dist.get_rank()})", ranks, fix)  # fmt: skip
        # Made here, on every rank alike: creating a flattened group is collective.
        data, tokens = _group(self.mesh, self.data), _group(self.mesh, self.data + self.context)
        whole = 1 < self.mesh.size() == dist.get_world_size()
        everyone = dist.group.WORLD if whole else _group(self.mesh, names)  # DDP's default group
        object.__setattr__(self, "groups", Groups(data, tokens, everyone))

    def sampler_options(self) -> dict[str, int]:
        """``num_replicas`` and ``rank`` for a ``DistributedSampler`` over the data ranks."""
        rank, size = rank_of(self.groups.data)
        return {"num_replicas": size, "rank": rank}

    def sizes(self) -> dict[str, int]:
        """The mesh's dimensions and sizes, as a checkpoint's manifest records them."""
        return dict(zip(self.mesh.mesh_dim_names, self.mesh.shape))


def rank_of(group: Any) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group`` (``(0, 1)`` for None)."""
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def _group(mesh: Any, names: tuple[str, ...]) -> Any:
    """The process group over ``names`` of ``mesh`` (flattened, created once), or None."""
    names = tuple(name for name in names if mesh[name].size() > 1)
    if not names:
        return None
    if len(names) == 1:
        return mesh[names[0]].get_group()
    # DeviceMesh caches a flattened view by name, so asking twice makes no second group.
    return mesh[names]._flatten().get_group()


_JOB: list[Layout | None] = [None]  # the job's layout, as torch.distributed's default group


def set_layout(layout: Layout | None) -> None:
    """Make ``layout`` the job's (None: none; each model's data-parallel group is used).

    Call it on every rank alike. The step, ``run()``, the metrics and the checkpoints ask
    it for their groups from then on (:class:`Groups`).

    Args:
        layout: a :class:`Layout` built on every rank, or None.

    Returns:
        None.

    Raises:
        TypeError: ``layout`` is neither a Layout nor None.

    Example:
        >>> from toolkit.distributed import current_layout, set_layout
        >>> set_layout(None); current_layout() is None
        True
    """
    fix = "Build it with init_layout(...) or Layout(mesh, data=(...), context=(...))."
    ok = layout is None or isinstance(layout, Layout)
    check_type(ok, "set_layout", "layout", "a Layout (or None)", layout, fix)
    _JOB[0] = layout


def current_layout() -> Layout | None:
    """The job's layout set by :func:`init_layout` or :func:`set_layout`, or None.

    Args:
        none.

    Returns:
        The :class:`Layout`, or None when the job has none.

    Raises:
        nothing.

    Example:
        >>> from toolkit.distributed import current_layout
        >>> current_layout() is None  # no layout set in this process
        True
    """
    return _JOB[0]


def init_layout(
    *, dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1, tp: int = 1,
    device_type: str | None = None,
) -> Layout:  # fmt: skip
    """Build the job's mesh from torchrun's world and make it the job's layout.

    The mesh has the dimensions ``("dp_replicate", "dp_shard", "cp", "tp")`` (sizes of 1
    included, so ``layout.mesh["tp"]`` always exists); one size may be -1 for "the rest of
    the world". Data are ``dp_replicate x dp_shard``, context ``cp``. Call it on every rank
    after :func:`setup`.

    Args:
        dp_replicate: replicas (DDP, or HSDP's replicate dimension).
        dp_shard: ranks that shard parameters (FSDP2); -1 by default.
        cp: ranks that split each sample's sequence (context or Ulysses-style parallelism).
        tp: tensor-parallel ranks.
        device_type: ``"cuda"`` or ``"cpu"``; by default the default group's backend says.

    Returns:
        The :class:`Layout`, also set as the job's.

    Raises:
        ValueError: the sizes do not multiply to the world size, or more than one is -1.

    Example:
        >>> from toolkit.distributed import init_layout
        >>> try:
        ...     init_layout(tp=0)
        ... except ValueError as error:
        ...     print(str(error)[:47])
        init_layout: sizes must be >= 1 (one may be -1)
    """
    sizes = [dp_replicate, dp_shard, cp, tp]
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    wild = [i for i, size in enumerate(sizes) if size == -1]
    said = dict(zip(DIMS, sizes))
    fix = f"Make the sizes multiply to the world size {world}, with at most one -1."
    check(all(s >= 1 or s == -1 for s in sizes) and len(wild) <= 1, "init_layout", "sizes",
          ">= 1 (one may be -1)", said, fix)  # fmt: skip
    if wild:
        sizes[wild[0]] = world // math.prod(s for s in sizes if s > 0)
    check(math.prod(sizes) == world and min(sizes) >= 1, "init_layout", "sizes",
          f"a product of {world}", said, fix)  # fmt: skip
    device_type = device_type or ("cuda" if world > 1 and "nccl" in dist.get_backend() else "cpu")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, tuple(sizes), mesh_dim_names=DIMS)
    layout = Layout(mesh, data=DIMS[:2], context=DIMS[2:3])
    set_layout(layout)
    return layout
