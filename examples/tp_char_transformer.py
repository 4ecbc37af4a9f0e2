"""Train a character transformer on a dp x tp mesh: FSDP2 with tensor and sequence parallelism.

The job of ``char_transformer.py`` (whose corpus and loss this script imports) on a 2-D
mesh, 2 data-parallel x 2 tensor-parallel ranks by default. Run::

    torchrun --standalone --nproc_per_node=4 examples/tp_char_transformer.py
    torchrun --standalone --nproc_per_node=4 examples/tp_char_transformer.py --quick
    torchrun --standalone --nproc_per_node=2 examples/tp_char_transformer.py --dp 1 --tp 2
    python examples/tp_char_transformer.py --dp 1 --tp 1     # one process: the same job

What changes from ``fsdp2_char_transformer.py``, and why:

* ``init_layout(dp_shard=..., tp=...)`` builds the mesh and makes it the job's layout: the
  step, ``run()``, ``validate`` and ``log_metrics`` then sum token counts and metrics over
  the data ranks only, and count the tensor-parallel ranks of a replica once.
* The model is written out (q/k/v/o projections, an MLP, norms): ``nn.MultiheadAttention``
  keeps q, k and v in one parameter, which a tensor-parallel plan cannot split by heads.
* The plan is torchtitan's, with PyTorch's own styles: the embeddings rowwise into
  sequence-sharded activations, the norms ``SequenceParallel`` (each rank normalizes its
  slice of the sequence), q/k/v colwise (each rank computes ``heads // tp`` heads) and o
  rowwise back to the sequence shards, the MLP colwise then rowwise, the head colwise to
  whole logits on every rank. Then ``fully_shard`` shards each block over ``dp_shard``.
* The tensor-parallel ranks of a replica must see the same samples: the sampler and the
  validation rows are split by the data rank (``layout.sampler_options()``), not the rank.
* Each micro-batch is ``BATCH_SIZE`` rows over the data ranks, and every rank builds the
  same weights: the meshes above train on the same batches and reach the same losses, to
  float rounding (``--quick``: validation loss 3.7676 on 4, 2 and 1 process).
* The checkpoints hold 2-D ``DTensor`` shards, written by every rank through
  ``torch.distributed.checkpoint``; ``resume="latest"`` reloads them on another ``--tp``
  too (with a warning naming the change). Another ``--dp`` is refused mid-epoch: the
  sampler's position does not map onto another number of data ranks.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time
import warnings

import torch
import torch.nn.functional as F
from char_transformer import (
    BATCH_SIZE,
    CONTEXT,
    MICRO_BATCHES,
    SEED,
    eval_fn,
    load_corpus,
    summed_loss,
    windows,
)
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from toolkit import LossSum, TrainState, accumulate, clip, compose, guard_nonfinite, make_step, run
from toolkit.distributed import Layout, init_layout, process_group
from toolkit.plugins import Retention, checkpoints, jsonl, log_metrics, progress, validate

# As in fsdp2_char_transformer.py: the logits are a view; the loss does not change them.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
D_MODEL, HEADS, LAYERS = 64, 4, 2


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D_MODEL, D_MODEL) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (batch, heads, length, head size), -1 heads: the LOCAL number, HEADS // tp, when
        # wq, wk and wv hold a slice of the heads (their output columns).
        q, k, v = (
            w(x).unflatten(-1, (-1, D_MODEL // HEADS)).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.attention = Attention()
        self.mlp = nn.Sequential(
            nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """``char_transformer.py``'s pre-norm causal decoder, its attention written out."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, D_MODEL), nn.Embedding(CONTEXT, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Positions as a (1, length) batch: sharded on the sequence like the tokens.
        x = self.embed(ids) + self.position(torch.arange(ids.shape[1], device=ids.device)[None])
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(model: nn.Module, batch) -> LossSum:
    """``char_transformer.py``'s loss, its token count also a record: ``log_metrics`` sums
    it over the data ranks (``train/total/tokens``), a tensor-parallel replica counted once."""
    total, count = summed_loss(model, batch[0])
    return LossSum(total, count, {"tokens": count})


def parallelize(model: Transformer, layout: Layout) -> Transformer:
    """Tensor and sequence parallelism over ``tp``, then FSDP2 over ``dp_shard``."""
    sequence = Shard(1)  # activations between the blocks: each tp rank holds a slice
    gather = PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(Replicate(),))
    block_plan = {
        "attention_norm": SequenceParallel(),
        "attention": gather,
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=sequence),
        "mlp_norm": SequenceParallel(),
        "mlp": gather,
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(output_layouts=sequence),
    }
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence),
        "position": RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=sequence, output_layouts=Replicate()),
    }
    for i in range(LAYERS):
        plan.update({f"blocks.{i}.{name}": style for name, style in block_plan.items()})
    # src_data_rank=None: every rank built the same weights, so each keeps its own slice
    # (the default scatters rank 0's, a collective per parameter).
    parallelize_module(model, layout.mesh["tp"], plan, src_data_rank=None)
    for block in model.blocks:
        fully_shard(block, mesh=layout.mesh["dp_shard"])
    # reshard_after_forward: validation's forward has no backward (fsdp2_char_transformer.py).
    return fully_shard(model, mesh=layout.mesh["dp_shard"], reshard_after_forward=True)


def make_loaders(layout: Layout, stoi: dict[str, int], train_docs, val_docs, quick: bool):
    data = layout.sampler_options()  # the data ranks: num_replicas=dp and this replica's rank
    replicas, rank = data["num_replicas"], data["rank"]
    train_set = TensorDataset(windows(train_docs, stoi))
    sampler = DistributedSampler(train_set, **data, shuffle=True, seed=SEED)
    train = DataLoader(
        train_set, batch_size=BATCH_SIZE // replicas, sampler=sampler, drop_last=True
    )
    val_rows = windows(val_docs, stoi)[:256] if quick else windows(val_docs, stoi)
    val_rows = val_rows[: len(val_rows) // replicas * replicas]
    mine = Subset(TensorDataset(val_rows), range(rank, len(val_rows), replicas))
    return train, DataLoader(mine, batch_size=128 // replicas)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 updates, not 600: a smoke test")
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path("runs/tp_char_transformer")
    )
    parser.add_argument("--dp", type=int, default=2, help="data-parallel (FSDP2) ranks")
    parser.add_argument("--tp", type=int, default=2, help=f"tensor-parallel ranks (divide {HEADS})")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda: each rank takes cuda:LOCAL_RANK (the default when available); or cpu",
    )
    args = parser.parse_args()
    # OneCycleLR's warm-up needs 2 updates at least: 20% of 10, 10% of 600.
    max_steps, every, warmup = (10, 5, 0.2) if args.quick else (600, 100, 0.1)

    device = None if args.device == "cuda" else args.device
    with process_group(seed=SEED, device=device) as launch:
        layout = init_layout(dp_shard=args.dp, tp=args.tp)
        itos, train_docs, val_docs = load_corpus()
        stoi = {c: i for i, c in enumerate(itos)}
        train_loader, val_loader = make_loaders(layout, stoi, train_docs, val_docs, args.quick)
        with torch.random.fork_rng(devices=[]):  # the same initial weights on every rank
            torch.manual_seed(SEED)
            model = parallelize(Transformer(len(itos)).to(launch.device), layout)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=3e-3, total_steps=max_steps, pct_start=warmup
        )
        state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler)
        step = compose(
            accumulate(micro_batches=MICRO_BATCHES), clip(max_norm=1.0), guard_nonfinite()
        )(make_step(loss_fn))
        plugins = [
            validate(eval_fn, val_loader, every=every, at_end=True),
            # Before checkpoints, so that a checkpoint holds the totals up to its step.
            log_metrics(
                every=5,
                sinks=[jsonl(args.out / "metrics.jsonl")],
                reduce={"tokens": "sum"},
                totals=["tokens"],
            ),
            checkpoints(
                args.out / "ckpt", every=every, keep=Retention(keep_last=2), resume="latest"
            ),
            progress(every=every, counts="tokens"),
        ]
        started = time.perf_counter()
        state = run(step, state, train_loader, max_steps=max_steps, plugins=plugins)
        seconds = time.perf_counter() - started
        if launch.rank == 0:
            loss, mesh = state.metrics["val"]["values"]["loss"], layout.sizes()
            print(
                f"final validation loss: {loss:.4f} nats/char (perplexity {math.exp(loss):.2f})"
                f"; {state.step} updates on {launch.world_size} rank(s) (dp {mesh['dp_shard']}"
                f" x tp {mesh['tp']}) in {seconds:.1f} s"
            )


if __name__ == "__main__":
    main()
