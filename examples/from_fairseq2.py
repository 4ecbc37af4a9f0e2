"""fairseq2's Trainer in toolkit: a TrainUnit returning (summed loss, num_targets).

    python examples/from_fairseq2.py --out runs/f2          # 30 data epochs, 240 updates
    python examples/from_fairseq2.py --quick --out /tmp/f2  # 4 data epochs, a smoke test
    python examples/from_fairseq2.py --device cpu           # default: cuda when available

A small GRU language model learns sequences of variable length (padded batches, so the
number of targets differs from batch to batch): each sequence counts up by a stride of its
own, modulo 16. The loss is a sum over the real targets with their count, as a fairseq2
TrainUnit returns it, so gradients are normalised by the number of targets of the whole
accumulation window, and the published ``num_target_elements`` is a sum, not a mean.

fairseq2                                      toolkit
--------------------------------------------  ---------------------------------------------
TrainUnit.__call__(batch) -> (loss,           loss_fn(model, batch) -> LossSum(total, count,
  num_targets): a summed loss                   records): gradients / all targets of the
                                                window (summed over ranks)
TrainUnit.set_step_nr(step_nr)                a loss_fn parameter named step: state.step
MetricBag (Mean, Sum) + total_ metrics        log_metrics(reduce={"num_target_elements":
                                                "sum"}, totals=["num_target_elements"])
data_reader (num_accumulate batches/step)     a DataLoader + accumulate(micro_batches=)
max_num_steps / max_num_data_epochs           run(max_steps=) / run(epochs=)
valid_units + valid_data_readers,             validate(eval_fn, loader, every=,
  validate_every_n_steps, score metric          monitor="nll_loss")
checkpoint_every_n_steps,                     checkpoints(dir, every=, keep=Retention(
  keep_last_n_checkpoints,                      keep_last=, keep_best=3,
  keep_best_n_checkpoints,                      metric="val/nll_loss", keep_every=))
  keep_checkpoint_every_n_steps
publish_metrics_every_n_steps, metrics_dir,   log_metrics(every=, sinks=[jsonl(...),
  tb_dir, wandb_options                         tensorboard(...), wandb(...)])
max_gradient_norm                             clip(max_norm=)
amp, fp16_loss_scale=(init, min)              amp_wrap(dtype="fp16", min_scale=): an update
                                                the scaler skips is not counted
early_stopper(step_nr, score)                 early_stop("val/nll_loss", patience=)
profiler (skip, record)                       profile(out_dir)
SIGUSR1 -> stop after the step, checkpoint    checkpoints(signals=(SIGUSR1,), exit_code=0)
root_gang / dp_gang                           torch.distributed (toolkit.distributed.setup)
seed=2                                        torch.manual_seed(2)

What differs: the checkpoint, best-score and publish cadences of fairseq2 must divide each
other (validate_every_n_steps % publish_metrics_every_n_steps == 0...); toolkit's plugins
each keep their own cadence and keep_best reads the metrics other plugins made at the
saved step. fairseq2's HEAD ignores SIGUSR1 when max_num_steps is set (the stop request is
checked under the wrong branch); toolkit's signal handling does not depend on the budget.
A fairseq2 unit without num_targets summed gradients over the micro-batches in older
versions; toolkit's accumulate divides by the window's size. Checkpoints are safetensors +
JSON (nothing unpickled), with checksums.
"""

from __future__ import annotations

import argparse
import pathlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from toolkit import LossSum, TrainState, accumulate, clip, compose, make_step, run, to_device
from toolkit.plugins import Retention, checkpoints, jsonl, log_metrics, progress, validate

SEED = 2  # fairseq2's default seed
VOCAB, PAD = 16, 16  # tokens 0..15; PAD is an extra index the loss ignores


def sequences(n: int, generator: torch.Generator) -> list[torch.Tensor]:
    """``n`` sequences of 4 to 24 tokens, each counting up by its own stride modulo 16."""
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 25, (), generator=generator))
        start, stride = torch.randint(0, VOCAB, (2,), generator=generator).tolist()
        out.append((start + stride * torch.arange(length)) % VOCAB)
    return out


def collate(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence; targets are the inputs shifted by one, PAD ignored."""
    padded = nn.utils.rnn.pad_sequence(batch, batch_first=True, padding_value=PAD)
    return {"inputs": padded[:, :-1], "targets": padded[:, 1:]}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB + 1, 32)
        self.gru = nn.GRU(32, 64, batch_first=True)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.embed(inputs))[0])


def train_unit(model: nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
    """TrainUnit.__call__: the summed loss over real targets, and how many there are."""
    # Inputs and targets go where the model is; non_blocking: from pinned memory on CUDA.
    batch = to_device(batch, next(model.parameters()).device, non_blocking=True)
    logits = model(batch["inputs"])
    targets = batch["targets"]
    total = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=PAD, reduction="sum"
    )
    count = (targets != PAD).sum()
    records = {"num_examples": len(targets), "num_target_elements": count}
    return LossSum(total, count, records)


def valid_unit(model: nn.Module, batch: dict[str, torch.Tensor]):
    """EvalUnit: the mean nll over real targets, weighted by their number."""
    loss = train_unit(model, batch)
    return {"nll_loss": loss.total / loss.count}, loss.count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 data epochs, not 30")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/f2"))
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to train (default: cuda when available)",
    )
    args = parser.parse_args()
    max_num_data_epochs = 4 if args.quick else 30

    torch.manual_seed(SEED)
    device = torch.device(args.device)
    pin_memory = device.type == "cuda"  # lets train_unit's copies run asynchronously
    generator = torch.Generator().manual_seed(SEED)
    train_data, valid_data = sequences(256, generator), sequences(64, generator)
    data_reader = DataLoader(
        train_data,
        batch_size=16,
        shuffle=True,
        generator=generator,
        collate_fn=collate,
        pin_memory=pin_memory,
    )
    valid_reader = DataLoader(valid_data, batch_size=64, collate_fn=collate, pin_memory=pin_memory)
    targets_per_epoch = sum(len(s) - 1 for s in train_data)

    model = Model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState(model=model, optimizer=optimizer)
    step = compose(accumulate(micro_batches=2), clip(max_norm=1.0))(make_step(train_unit))

    every = 4 if args.quick else 40  # validate/checkpoint cadence, in updates
    plugins = [
        validate(valid_unit, valid_reader, every=every, at_end=True, monitor="nll_loss"),
        # Before checkpoints: its run totals are saved with the state at each save.
        log_metrics(
            every=every,
            sinks=[jsonl(args.out / "metrics.jsonl", existing="replace")],
            reduce={"num_examples": "sum", "num_target_elements": "sum"},
            totals=["num_target_elements"],
        ),
        checkpoints(
            args.out / "checkpoints",
            every=every,
            keep=Retention(keep_last=2, keep_best=3, metric="val/nll_loss"),
        ),
        progress(every=every),
    ]
    state = run(step, state, data_reader, epochs=max_num_data_epochs, plugins=plugins)

    total = state.extras["log_metrics"]["totals"]["num_target_elements"]
    nll = state.metrics["val"]["values"]["nll_loss"]
    print(f"targets per data epoch: {targets_per_epoch}")
    # :.0f: the total is an int from CPU records, a float from CUDA tensor records.
    print(f"{state.step} updates, {state.epoch} data epochs, {total:.0f} target elements in total")
    print(f"final validation nll_loss: {nll:.4f}")


if __name__ == "__main__":
    main()
