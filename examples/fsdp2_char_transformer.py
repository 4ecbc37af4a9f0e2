"""Train the character transformer with FSDP2 (``fully_shard``), one process per rank.

The job of ``char_transformer.py`` (whose corpus, model and loss this script imports) with
its parameters, gradients and optimizer state sharded over the ranks. Run::

    torchrun --standalone --nproc_per_node=2 examples/fsdp2_char_transformer.py
    torchrun --standalone --nproc_per_node=2 examples/fsdp2_char_transformer.py --quick
    python examples/fsdp2_char_transformer.py      # a world of one: nothing to shard

What changes from ``char_transformer.py``, and why:

* ``fully_shard`` on every transformer block, then on the whole model: each block's
  parameters are gathered just before its forward and backward and freed after, so a rank
  holds one block's full weights at a time. The parameters become ``DTensor`` shards; the
  optimizer is built after sharding, so its state is sharded too.
* FSDP2 does not broadcast weights as DDP does: the model is built under the same seed on
  every rank before it is sharded.
* Every rank must make the same number of forward calls (each one all-gathers), so the
  validation rows are trimmed to a multiple of the world size and split evenly; the
  training sampler (``DistributedSampler``) pads the ranks' shares to the same length.
* The train step suppresses the gradient reduce-scatter on all but the closing micro-batch
  (``set_requires_gradient_sync``) and sums the token counts over the ranks, so the update
  is the gradient of the mean over every real token of the window, on every rank's shard.
* The checkpoints are sharded: each rank writes its shards through
  ``torch.distributed.checkpoint`` inside the usual checkpoint folder, and ``resume="latest"``
  loads them whatever the number of ranks that wrote them.

No ``amp_wrap`` here: on a CPU without native bf16 it only slows training down. On GPUs,
``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32))`` computes in bf16 and reduces gradients in float32.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time
import warnings

import torch
from char_transformer import (  # examples/ is the script's folder, so this is the sibling
    BATCH_SIZE,
    MICRO_BATCHES,
    SEED,
    CharTransformer,
    eval_fn,
    load_corpus,
    loss_fn,
    windows,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from toolkit import TrainState, accumulate, clip, compose, guard_nonfinite, make_step, run
from toolkit.distributed import Launch, process_group
from toolkit.plugins import Retention, checkpoints, jsonl, log_metrics, progress, validate

# FSDP2 warns that the model's output (the head's logits, a view) would lose its backward
# hook to an in-place op; the loss reads the logits without changing them.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def make_loaders(launch: Launch, stoi: dict[str, int], train_docs, val_docs, quick: bool):
    train_set = TensorDataset(windows(train_docs, stoi))
    sampler = DistributedSampler(
        train_set, num_replicas=launch.world_size, rank=launch.rank, shuffle=True, seed=SEED
    )
    # BATCH_SIZE rows per micro-batch over all ranks, as in the single-process script.
    batch_size = BATCH_SIZE // launch.world_size
    pin = launch.device.type == "cuda"
    train = DataLoader(
        train_set, batch_size=batch_size, sampler=sampler, drop_last=True, pin_memory=pin
    )
    val_rows = windows(val_docs, stoi)
    if quick:
        val_rows = val_rows[:256]
    val_rows = val_rows[: len(val_rows) // launch.world_size * launch.world_size]
    mine = Subset(TensorDataset(val_rows), range(launch.rank, len(val_rows), launch.world_size))
    return train, DataLoader(mine, batch_size=128 // launch.world_size)


def make_model(launch: Launch, vocab: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):  # the same initial weights on every rank
        torch.manual_seed(SEED)
        model = CharTransformer(vocab).to(launch.device)
    mesh = init_device_mesh(launch.device.type, (launch.world_size,))
    for block in model.blocks.layers:
        fully_shard(block, mesh=mesh)
    # The rest (embeddings, final norm, head). The root keeps its parameters gathered after
    # a forward by default, expecting the backward; after validation's forward there is
    # none, and a checkpoint would meet gathered tensors instead of the optimizer's shards.
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 updates, not 600: a smoke test")
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path("runs/fsdp2_char_transformer")
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda: each rank takes cuda:LOCAL_RANK (the default when available); or cpu",
    )
    args = parser.parse_args()
    max_steps, every = (20, 5) if args.quick else (600, 100)

    # setup() picks cuda:LOCAL_RANK, one device per rank; cpu keeps every rank on the CPU.
    device = None if args.device == "cuda" else args.device
    with process_group(seed=SEED, device=device) as launch:
        itos, train_docs, val_docs = load_corpus()
        stoi = {c: i for i, c in enumerate(itos)}
        train_loader, val_loader = make_loaders(launch, stoi, train_docs, val_docs, args.quick)
        model = make_model(launch, len(itos))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=3e-3, total_steps=max_steps, pct_start=0.1
        )
        state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler)
        step = compose(
            accumulate(micro_batches=MICRO_BATCHES), clip(max_norm=1.0), guard_nonfinite()
        )(make_step(loss_fn))
        plugins = [
            validate(eval_fn, val_loader, every=every, at_end=True),
            checkpoints(
                args.out / "ckpt", every=every, keep=Retention(keep_last=2), resume="latest"
            ),
            progress(every=every, counts="tokens"),
            log_metrics(every=5, sinks=[jsonl(args.out / "metrics.jsonl")]),
        ]
        started = time.perf_counter()
        state = run(step, state, train_loader, max_steps=max_steps, plugins=plugins)
        seconds = time.perf_counter() - started
        if launch.rank == 0:
            loss = state.metrics["val"]["values"]["loss"]
            print(
                f"final validation loss: {loss:.4f} nats/char (perplexity {math.exp(loss):.2f})"
                f"; {state.step} updates on {launch.world_size} rank(s) in {seconds:.1f} s"
            )


if __name__ == "__main__":
    main()
