"""Train the digits MLP with DistributedDataParallel: one process per rank, under torchrun.

The job of ``digits.py`` spread over ranks. Run::

    make example-ddp      # = torchrun --standalone --nproc_per_node=2 examples/ddp_digits.py
    torchrun --standalone --nproc_per_node=2 examples/ddp_digits.py --out runs/ddp_digits
    torchrun --standalone --nproc_per_node=2 examples/ddp_digits.py --quick   # a few epochs
    python examples/ddp_digits.py                  # the same script, as a world of one

On CPU the ranks talk over gloo; on a machine with GPUs each rank takes ``cuda:LOCAL_RANK``
and NCCL (``toolkit.distributed.setup`` decides; nothing else in this file changes).

What changes from a single process, and why:

* ``toolkit.distributed.process_group`` joins the job, seeds each rank with ``SEED + rank``
  (its own dropout masks) and ends with a barrier.
* The model is wrapped in ``DistributedDataParallel``, which copies rank 0's initial weights
  to every rank. The train step needs nothing more: it syncs gradients only on the
  micro-batch that closes a window, and its guard's verdict is the same on every rank.
* A ``DistributedSampler`` gives each rank its share of every epoch; ``run()`` calls its
  ``set_epoch`` at the start of every pass, so the shuffle differs per epoch and agrees
  across ranks. It pads the ranks' shares to the same length by repeating a few samples,
  and ``drop_last=True`` on the loader drops the partial batch, so every rank makes the same
  number of micro-batches: none waits in an all-reduce that another never makes.
* Each rank validates its own slice of the validation set; ``validate`` sums the slices'
  counts over the ranks, so the metrics are those of the whole set, on every rank.
* ``log_metrics`` reduces its means over the ranks and only rank 0 writes the file and the
  progress lines. ``checkpoints`` saves from rank 0 (every rank keeps its own RNG states)
  and resumes with ``resume="latest"``: run the same command again after a crash, or under
  ``torchrun --max-restarts=3``, and it continues from the newest checkpoint. A finished run
  run again resumes at its end: delete ``--out`` to start afresh.

The per-rank batch is ``64 // (world size * MICRO_BATCHES)``, so an update averages over 64
samples whatever the number of ranks, as in ``digits.py``.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from toolkit import (
    TrainState,
    accumulate,
    clip,
    compose,
    guard_nonfinite,
    make_step,
    run,
    to_device,
)
from toolkit.checkpoints import Retention
from toolkit.distributed import Launch, process_group
from toolkit.plugins import checkpoints, ema, ema_model, jsonl, log_metrics, progress, validate

SEED = 0
UPDATE_BATCH = 64  # samples per update, over all ranks and micro-batches
MICRO_BATCHES = 2


def make_loaders(launch: Launch) -> tuple[DataLoader, DataLoader]:
    """This rank's share of the stratified 80/20 split of the digits, as DataLoaders."""
    images, labels = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(
        images, labels, test_size=0.2, stratify=labels, random_state=SEED
    )

    def dataset(x, y) -> TensorDataset:
        return TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))

    train_set = dataset(x_train, y_train)
    # The same seed on every rank: the ranks agree on one permutation per epoch and each
    # takes every world_size-th sample of it.
    sampler = DistributedSampler(
        train_set, num_replicas=launch.world_size, rank=launch.rank, shuffle=True, seed=SEED
    )
    batch_size = UPDATE_BATCH // (launch.world_size * MICRO_BATCHES)
    pin = launch.device.type == "cuda"
    train = DataLoader(
        train_set, batch_size=batch_size, sampler=sampler, drop_last=True, pin_memory=pin
    )
    # Validation slices are disjoint and cover the set once (no padding: validate weights
    # each rank's batches by their size, so unequal slices average exactly).
    val_set = dataset(x_val, y_val)
    mine = Subset(val_set, range(launch.rank, len(val_set), launch.world_size))
    return train, DataLoader(mine, batch_size=256, pin_memory=pin)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(256, 128),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(128, 10),
    )


def loss_fn(model: nn.Module, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    # Inputs and targets both go to this rank's device (from pinned memory on CUDA).
    x, y = to_device(batch, next(model.parameters()).device, non_blocking=True)
    logits = model(x)
    accuracy = (logits.argmax(dim=-1) == y).float().mean()
    return F.cross_entropy(logits, y), {"accuracy": accuracy}


def eval_fn(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    x, y = to_device(batch, next(model.parameters()).device, non_blocking=True)
    logits = model(x)
    return {
        "loss": F.cross_entropy(logits, y),
        "accuracy": (logits.argmax(dim=-1) == y).float().mean(),
    }


def train(launch: Launch, epochs: int, every: int, out: pathlib.Path) -> TrainState:
    train_loader, val_loader = make_loaders(launch)
    model = DistributedDataParallel(make_model().to(launch.device), device_ids=launch.device_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-2)
    total_updates = epochs * len(train_loader) // MICRO_BATCHES
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=3e-3, total_steps=total_updates, pct_start=0.1
    )
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler)
    step = compose(
        accumulate(micro_batches=MICRO_BATCHES),
        clip(max_norm=1.0),
        guard_nonfinite(),
    )(make_step(loss_fn))
    # The same plugins, with the same arguments, on every rank: the ones that reduce over
    # ranks (validate, log_metrics) and the checkpoints make collective calls.
    plugins = [
        ema(decay=0.995),
        validate(eval_fn, val_loader, every=every, per_epoch=True, at_end=True),
        validate(
            eval_fn,
            val_loader,
            every=every,
            per_epoch=True,
            at_end=True,
            key="val_ema",
            model=ema_model,
        ),
        checkpoints(out / "ckpt", every=every, keep=Retention(keep_last=2), resume="latest"),
        progress(every=every, show=("val", "val_ema")),
        log_metrics(every=10, sinks=[jsonl(out / "metrics.jsonl")]),
    ]
    return run(step, state, train_loader, epochs=epochs, plugins=plugins)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 epochs, not 40: a smoke test")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/ddp_digits"))
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda: each rank takes cuda:LOCAL_RANK (the default when available); or cpu",
    )
    args = parser.parse_args()
    epochs, every = (3, 10) if args.quick else (40, 50)

    # setup() picks cuda:LOCAL_RANK, one device per rank; cpu keeps every rank on the CPU.
    device = None if args.device == "cuda" else args.device
    with process_group(seed=SEED, device=device) as launch:
        started = time.perf_counter()
        state = train(launch, epochs, every, args.out)
        seconds = time.perf_counter() - started
        if launch.rank == 0:
            val, val_ema = state.metrics["val"], state.metrics["val_ema"]
            print(
                f"final validation accuracy: {val['values']['accuracy']:.4f} "
                f"(EMA: {val_ema['values']['accuracy']:.4f}) after {state.step} updates, "
                f"{state.epoch} epochs on {launch.world_size} rank(s) in {seconds:.1f} s"
            )
            print(f"metrics: {args.out / 'metrics.jsonl'}; checkpoints: {args.out / 'ckpt'}")


if __name__ == "__main__":
    main()
