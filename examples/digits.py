"""Train a small MLP on scikit-learn's bundled handwritten digits with toolkit.

The digits dataset (1797 greyscale 8x8 images, 10 classes) ships inside scikit-learn, so
nothing is downloaded. Install the extra and run::

    pip install -e ".[examples]"
    make example                              # = OMP_NUM_THREADS=1 python examples/digits.py
    python examples/digits.py --out runs/digits   # metrics go to runs/digits/metrics.jsonl
    python examples/digits.py --quick         # a few epochs, for smoke tests
    python examples/digits.py --device cpu    # default: cuda when available

It shows the whole toolkit on one page: a loss function, a composed train step
(accumulation, clipping, a non-finite guard), and ``run()`` with progress, JSON-lines
metrics, an EMA of the weights, validation every N updates and every epoch, early stopping
and peak memory. It ends by printing the final validation accuracy of the model and of its
EMA; the full run reaches 0.972 (EMA 0.975), stopping early after 27 epochs, in under 5
seconds of training on one CPU core.
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
from torch.utils.data import DataLoader, TensorDataset

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
from toolkit.plugins import (
    early_stop,
    ema,
    ema_model,
    jsonl,
    log_metrics,
    peak_memory,
    progress,
    validate,
)

SEED = 0
BATCH_SIZE = 32  # per micro-batch; two micro-batches make one update of 64 samples
MICRO_BATCHES = 2


def make_loaders(seed: int, pin_memory: bool = False) -> tuple[DataLoader, DataLoader]:
    """Stratified 80/20 split of the digits, scaled to [0, 1], as DataLoaders.

    ``pin_memory`` (on CUDA) lets the loss function's copies to the GPU run asynchronously.
    """
    images, labels = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(
        images, labels, test_size=0.2, stratify=labels, random_state=seed
    )

    def dataset(x, y) -> TensorDataset:
        # Pixels are integers 0..16.
        return TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))

    # A seeded generator makes the shuffling (and so the whole run) reproducible; drop_last
    # keeps every micro-batch the same size, so mean losses average exactly over a window.
    shuffle = torch.Generator().manual_seed(seed)
    train = DataLoader(
        dataset(x_train, y_train),
        batch_size=BATCH_SIZE,
        shuffle=True,
        generator=shuffle,
        drop_last=True,
        pin_memory=pin_memory,
    )
    val = DataLoader(dataset(x_val, y_val), batch_size=256, pin_memory=pin_memory)
    return train, val


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
    """Mean cross-entropy, plus the batch accuracy as a record (logged as train/accuracy)."""
    # Inputs and targets go where the model is; non_blocking: from pinned memory on CUDA.
    x, y = to_device(batch, next(model.parameters()).device, non_blocking=True)
    logits = model(x)
    accuracy = (logits.argmax(dim=-1) == y).float().mean()
    return F.cross_entropy(logits, y), {"accuracy": accuracy}


def eval_fn(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    """Per-batch metrics; validate() weights them by batch size, so the means are exact."""
    x, y = to_device(batch, next(model.parameters()).device, non_blocking=True)
    logits = model(x)
    return {
        "loss": F.cross_entropy(logits, y),
        "accuracy": (logits.argmax(dim=-1) == y).float().mean(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 epochs, not 40: a smoke test")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/digits"))
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to train (default: cuda when available)",
    )
    args = parser.parse_args()
    epochs = 3 if args.quick else 40

    torch.manual_seed(SEED)  # weights and dropout masks
    device = torch.device(args.device)
    train_loader, val_loader = make_loaders(SEED, pin_memory=device.type == "cuda")
    model = make_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-2)
    # One scheduler step per optimizer update (the step calls scheduler.step() after each).
    total_updates = epochs * len(train_loader) // MICRO_BATCHES
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=3e-3, total_steps=total_updates, pct_start=0.1
    )
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler)
    metrics_path = args.out / "metrics.jsonl"

    # Decorator order does not matter: the step runs its phases in one fixed order.
    step = compose(
        accumulate(micro_batches=MICRO_BATCHES),
        clip(max_norm=1.0),
        guard_nonfinite(),
    )(make_step(loss_fn))

    every = 10 if args.quick else 50
    plugins = [
        # In any order: run() calls ema, then validate, then the logs and checkpoints.
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
        # patience counts evaluations (every `every` updates and at each epoch end).
        early_stop("val/loss", patience=10),
        peak_memory(every=every),
        progress(every=every, show=("val", "val_ema", "memory")),
        # existing="replace": a fresh run empties the file (the default refuses one that
        # holds lines); a run resumed from a checkpoint would continue it.
        log_metrics(every=10, sinks=[jsonl(metrics_path, existing="replace")]),
    ]
    started = time.perf_counter()
    state = run(step, state, train_loader, epochs=epochs, plugins=plugins)
    seconds = time.perf_counter() - started

    if state.stop is not None:
        print(f"stopped early: {state.stop}")
    # at_end=True: both entries describe the final weights.
    val, val_ema, best = state.metrics["val"], state.metrics["val_ema"], state.extras["val"]
    print(
        f"final validation accuracy: {val['values']['accuracy']:.4f} "
        f"(EMA: {val_ema['values']['accuracy']:.4f}) after {state.step} updates, "
        f"{state.epoch} epochs in {seconds:.1f} s; best val/loss {best['best']:.4f} at update "
        f"{best['best_step']}"
    )
    print(f"metrics: {metrics_path}")


if __name__ == "__main__":
    main()
