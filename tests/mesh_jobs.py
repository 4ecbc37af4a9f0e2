"""A tiny token model trained on a 2-D device mesh, as a user would with PyTorch's own APIs.

Shared by the mesh tests: the model, the tensor-parallel plans (PyTorch's
``parallelize_module`` styles), the data, the loss (a ``LossSum`` with ignored targets) and
a one-process reference run of the same job. Everything in float64, so that a distributed
run equal to the reference agrees to rounding (below 1e-10).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from toolkit import LossSum, TrainState, accumulate, clip, compose, guard_nonfinite, make_step

VOCAB, DIM, HIDDEN, SEQ = 16, 8, 16, 8
GLOBAL_BATCH = 4  # samples per micro-batch over all data ranks
K = 2  # micro-batches per update
SKIPPED = 2  # the batch every rank skips (loss_fn -> None): 7 batches make 3 updates
BATCHES = 7


class Block(nn.Module):
    def __init__(self, norms: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM) if norms else nn.Identity()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TokenModel(nn.Module):
    """Embedding, two per-token blocks, a head: per-token, so a slice of the sequence is
    a slice of the loss (the sequence-sharded loss needs no attention to be exact)."""

    def __init__(self, norms: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(norms), Block(norms)])
        self.norm = nn.LayerNorm(DIM) if norms else nn.Identity()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def fresh_model(norms: bool = False) -> TokenModel:
    torch.manual_seed(0)
    return TokenModel(norms).double()


def batch(index: int, size: int = GLOBAL_BATCH) -> tuple[torch.Tensor, ...]:
    """The global micro-batch: tokens, targets (some ignored, -100), and a skip flag."""
    g = torch.Generator().manual_seed(1000 + index)
    tokens = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    targets[torch.rand(size, SEQ, generator=g) < 0.3] = -100
    skip = torch.tensor(index == SKIPPED)
    return tokens, targets, skip


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> LossSum | None:
    tokens, targets, skip = batch
    if bool(skip):
        return None
    logits = model(tokens)
    total = nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
    )
    return LossSum(total, (targets != -100).sum())


def train_step() -> Any:
    return compose(accumulate(micro_batches=K), clip(max_norm=0.5), guard_nonfinite())(
        make_step(loss_fn)
    )


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05)


def reference(batches: int = BATCHES, norms: bool = False) -> dict[str, torch.Tensor]:
    """The job in one process on the global batches: the weights after ``batches``."""
    model = fresh_model(norms)
    state = TrainState(model=model, optimizer=optimizer(model))
    step = train_step()
    for index in range(batches):
        state, _ = step(state, batch(index))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as whole tensors (DTensors gathered), on every rank."""
    out = {}
    for key, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[key] = full.detach().clone()
    return out


def tensor_parallel(model: TokenModel, tp_mesh: Any, plan: str) -> None:
    """Apply one of the plans with PyTorch's styles.

    ``"full"``: every parameter on the tensor-parallel mesh (embedding rowwise, blocks
    colwise/rowwise, head colwise back to replicated logits). ``"sequence"``: the same with
    sequence parallelism (activations sharded on the sequence between the blocks, norms
    ``SequenceParallel``). ``"blocks"``: only the blocks, the rest left to FSDP's 1-D mesh.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = plan == "sequence"
    between = Shard(1) if seq else Replicate()  # the layout of activations between blocks
    styles: dict[str, Any] = {}
    if plan != "blocks":
        styles["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
        styles["head"] = ColwiseParallel(input_layouts=between, output_layouts=Replicate())
    if seq:
        styles["norm"] = SequenceParallel()
    for i in range(len(model.blocks)):
        styles[f"blocks.{i}.up"] = ColwiseParallel(input_layouts=between)
        styles[f"blocks.{i}.down"] = RowwiseParallel(output_layouts=between)
        if seq:
            styles[f"blocks.{i}.norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, styles)


def shard_data(model: nn.Module, dp_mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=dp_mesh)
    return fully_shard(model, mesh=dp_mesh)


def my_part(global_batch: tuple[torch.Tensor, ...], data: Any, context: Any = None) -> Any:
    """This rank's samples (by its data rank) and, with a context group, its slice of the
    sequence (each rank of a context dimension computes the loss of its own tokens)."""
    tokens, targets, skip = global_batch
    if data is not None:
        size, rank = dist.get_world_size(data), dist.get_rank(data)
        n = tokens.shape[0] // size
        tokens, targets = tokens[rank * n : (rank + 1) * n], targets[rank * n : (rank + 1) * n]
    if context is not None:
        size, rank = dist.get_world_size(context), dist.get_rank(context)
        n = tokens.shape[1] // size
        tokens, targets = (
            tokens[:, rank * n : (rank + 1) * n],
            targets[:, rank * n : (rank + 1) * n],
        )
    return tokens, targets, skip
