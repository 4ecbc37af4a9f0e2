"""pytorch_accelerated's quick start in toolkit: Trainer(model, loss_func, optimizer).train(...).

    python examples/from_pytorch_accelerated.py --out runs/pa          # 12 epochs
    python examples/from_pytorch_accelerated.py --quick --out /tmp/pa  # 2 epochs: 46 updates
    python examples/from_pytorch_accelerated.py --device cpu  # default: cuda when available

A classifier on 360 training samples (3 Gaussian blobs, 2 features), per_device_batch_size 8
(45 batches per epoch), gradient_accumulation_steps 2, value clipping, a OneCycleLR sized
by the updates per epoch, evaluation every epoch; then an evaluation-only run.

pytorch_accelerated                           toolkit
--------------------------------------------  ---------------------------------------------
Trainer(model, loss_func, optimizer)          loss_fn(model, batch) + TrainState(model=,
                                                optimizer=, scheduler=)
trainer.train(train_dataset, num_epochs,      run(step, state, loader, epochs=); you build
  per_device_batch_size, ...)                   the DataLoader (shuffle, batch size)
gradient_accumulation_steps (the last short   accumulate(micro_batches=) with
  window of an epoch steps too)                 run(partial_window="epoch")
gradient_clip_value                           clip(max_value=)
create_scheduler_fn=partial(OneCycleLR, ...,  the scheduler, built with
  steps_per_epoch=NUM_UPDATE_STEPS_PER_EPOCH)   math.ceil(len(loader) / micro_batches)
max_num_train_steps                           run(..., max_steps=)
eval_dataset (eval_loss_epoch)                validate(eval_fn, loader, per_epoch=True)
                                                -> val/loss
train_loss_epoch                              log_metrics(per_epoch=True) -> train/epoch_loss
LogMetricsCallback / RunHistory               a Sink (print_epoch below), jsonl(path)
callback on_train_step_end(batch, outputs)    a plugin reading event.batches, event.outs
                                                (model outputs kept in the records)
TerminateOnNaNCallback                        guard_nonfinite(max_retries=0): NonFiniteError
EarlyStoppingCallback(patience, threshold)    early_stop("val/loss", patience=, min_delta=)
SaveBestModelCallback                         checkpoints(..., keep=Retention(keep_best=1,
                                                metric="val/loss"), restore_best=True)
ModelEmaCallback                              ema(decay=), ema_model(state)
trainer.evaluate(dataset)                     evaluate(eval_fn, model, loader)
save_checkpoint(path)                         export_model(state, path) (or save_checkpoint)

What differs: pytorch_accelerated clips after every micro-batch (with fp16 and accumulation
that unscales twice); toolkit clips once per update, after unscaling. It divides the last
short window's loss by the full accumulation count, and reports train_loss_epoch after that
division; toolkit applies the short window with its exact mean and logs the loss
undivided. Its TerminateOnNaN stops one rank only (the others hang in the next collective);
toolkit's guard agrees across ranks. It seeds 42 on every train(); toolkit leaves seeding
to you. On resume it runs num_epochs more epochs; run(epochs=) counts epochs in total.
"""

from __future__ import annotations

import argparse
import math
import pathlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from toolkit import (
    TrainState,
    accumulate,
    clip,
    compose,
    evaluate,
    guard_nonfinite,
    make_step,
    run,
    to_device,
)
from toolkit.plugins import Sink, jsonl, log_metrics, validate

SEED = 0
BATCH_SIZE = 8
ACCUMULATION = 2


def blobs(n: int, generator: torch.Generator) -> TensorDataset:
    """Three Gaussian blobs in 2-D, one per class, overlapping a little."""
    y = torch.arange(n) % 3
    centres = torch.tensor([[0.0, 2.0], [-1.8, -1.0], [1.8, -1.0]])
    return TensorDataset(centres[y] + torch.randn(n, 2, generator=generator), y)


def loss_fn(model: nn.Module, batch):
    """calculate_train_batch_loss: the loss, and the model outputs for step-end plugins."""
    # Inputs and targets go where the model is; non_blocking: from pinned memory on CUDA.
    x, y = to_device(batch, next(model.parameters()).device, non_blocking=True)
    logits = model(x)
    return F.cross_entropy(logits, y), {"model_outputs": logits.detach()}


def eval_fn(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    x, y = to_device(batch, next(model.parameters()).device, non_blocking=True)
    logits = model(x)
    return {"loss": F.cross_entropy(logits, y), "accuracy": (logits.argmax(1) == y).float().mean()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 epochs, not 12: a smoke test")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/pa"))
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to train (default: cuda when available)",
    )
    args = parser.parse_args()
    num_epochs = 2 if args.quick else 12

    torch.manual_seed(SEED)
    device = torch.device(args.device)
    pin_memory = device.type == "cuda"  # lets the loss function's copies run asynchronously
    generator = torch.Generator().manual_seed(SEED)
    train_dataset, eval_dataset = blobs(360, generator), blobs(120, generator)
    train_loader = DataLoader(
        train_dataset,
        batch_size=BATCH_SIZE,
        shuffle=True,
        generator=generator,
        pin_memory=pin_memory,
    )
    eval_loader = DataLoader(eval_dataset, batch_size=BATCH_SIZE, pin_memory=pin_memory)

    model = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 3)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    updates_per_epoch = math.ceil(len(train_loader) / ACCUMULATION)  # NUM_UPDATE_STEPS_PER_EPOCH
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=0.1, epochs=num_epochs, steps_per_epoch=updates_per_epoch
    )
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler)
    step = compose(
        accumulate(micro_batches=ACCUMULATION),
        clip(max_value=1.0),  # gradient_clip_value=1.0
        guard_nonfinite(max_retries=0),  # TerminateOnNaNCallback
    )(make_step(loss_fn))

    # A step-end callback: train accuracy from each micro-batch's outputs. The count of
    # correct predictions stays a tensor on the model's device: no host sync per step.
    correct, seen = torch.zeros((), dtype=torch.long, device=device), [0]

    def on_train_step_end(event) -> None:
        if event.kind == "step":
            for (_, y), out in zip(event.batches, event.outs):
                predicted = out.records["model_outputs"].argmax(1)
                correct.add_((predicted == y.to(device, non_blocking=True)).sum())
                seen[0] += len(y)

    def print_epoch(step: int, metrics: dict[str, float]) -> None:
        if "train/epoch_loss" in metrics:  # LogMetricsCallback's lines, at each epoch's end
            print(
                f"epoch {metrics['train/epoch']:.0f} (update {step}): train_loss_epoch "
                f"{metrics['train/epoch_loss']:.4f} eval_loss_epoch {metrics['val/loss']:.4f} "
                f"eval accuracy {metrics['val/accuracy']:.4f}"
            )

    plugins = [
        on_train_step_end,
        validate(eval_fn, eval_loader, per_epoch=True),
        log_metrics(
            every=10,
            per_epoch=True,
            records=[],  # model_outputs is kept for on_train_step_end, not logged
            sinks=[
                jsonl(args.out / "metrics.jsonl", existing="replace"),
                Sink(print_epoch, lambda: None),
            ],
        ),
    ]
    state = run(
        step, state, train_loader, epochs=num_epochs, plugins=plugins, partial_window="epoch"
    )
    accuracy = int(correct) / seen[0]
    print(f"{state.step} updates in {state.epoch} epochs; train accuracy {accuracy:.4f}")

    results = evaluate(eval_fn, state, eval_loader)  # trainer.evaluate(eval_dataset)
    print(f"evaluation run: loss {results['loss']:.4f} accuracy {results['accuracy']:.4f}")


if __name__ == "__main__":
    main()
