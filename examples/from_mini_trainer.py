"""mini.trainer's quick start in toolkit: an MLP on 784-pixel inputs, hooks as plugins.

    python examples/from_mini_trainer.py --out runs/mini          # 600 updates
    python examples/from_mini_trainer.py --quick --out /tmp/mini  # 40 updates, a smoke test
    python examples/from_mini_trainer.py --device cpu             # default: cuda when available

Stop it (Ctrl-C after a save, SIGTERM, or ``--max-steps 200``) and run the same command again:
it resumes from ``runs/mini/checkpoints`` (mini.trainer's ``CheckpointingHook(load="latest")``).

mini.trainer                                  toolkit
--------------------------------------------  ---------------------------------------------
class MyTrainer(BaseTrainer): build_model,    plain objects: model, optimizer, scheduler in
  build_optimizer, build_lr_scheduler,          TrainState(model=, optimizer=, scheduler=);
  build_data_loader                             the loader is passed to run()
forward(input) -> (loss, records)             loss_fn(model, batch) -> (loss, records); records
                                                may stay tensors (no .item() per step: read
                                                once per publish)
forward returning None (skip the batch)       loss_fn returning None (the window does not
                                                advance)
max_steps                                     run(..., max_steps=)
gradient_accumulation_steps                   accumulate(micro_batches=)
mixed_precision="bf16" | "fp16"               amp_wrap(dtype="bf16" | "fp16")
grad_clip                                     clip(max_norm=); out.grad_norm before clipping
max_non_finite_grad_retries                   guard_nonfinite(max_retries=)
no_sync_accumulate                            automatic under DDP / FSDP2 (accumulate)
ProgressHook(interval=10, with_records=True)  progress(every=10, records=["accuracy"])
LoggingHook(interval=100) + WandbHook         log_metrics(every=100, sinks=[jsonl(...),
                                                wandb(project=...)])
CheckpointingHook(interval, keep_previous,    checkpoints(dir, every=, resume="latest",
  keep_interval, load="latest",                 keep=Retention(keep_last=keep_previous+1,
  exit_signals, exit_code="128+signal")         keep_every=), signals=, exit_code=)
EmaHook(decay) / hook.ema_model               ema(decay=) / ema_model(state)
CudaMaxMemoryHook                             peak_memory()
custom BaseHook.on_after_step(trainer)        a function plugin(event) (see `started` below)
trainer.step / trainer.unwrap(model)          state.step / toolkit.unwrap(model)
map_nested_tensor, key_average                toolkit.map_nested_tensor, toolkit.key_average

What differs: mini.trainer needs an endless iterator (a finite loader ends train() with
StopIteration); run() iterates a finite loader again for each pass and resumes mid-pass
exactly, so the data here is an ordinary shuffled DataLoader. Its non-finite check runs
only without a scaler, retries forever by default and checks per rank; guard_nonfinite
checks loss and gradients under every precision, gives up after 3 rejected windows by
default and agrees across ranks. Its scheduler steps even when the fp16 scaler skipped the
update; toolkit's does not. On a signal, mini.trainer exits from inside the hook, so later
hooks never finish (wandb); toolkit finishes the update, saves, then runs every plugin's end.
"""

from __future__ import annotations

import argparse
import pathlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from toolkit import (
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    compose,
    guard_nonfinite,
    make_step,
    run,
    to_device,
)
from toolkit.plugins import Retention, checkpoints, ema, jsonl, log_metrics, peak_memory, progress

SEED = 0


def build_data_loader(seed: int, pin_memory: bool = False) -> DataLoader:
    """MNIST-shaped synthetic data: 784 inputs, 10 classes given by a fixed random teacher.

    ``pin_memory`` (on CUDA) lets forward's copies to the GPU run asynchronously.
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, 784, generator=generator)
    teacher = torch.randn(784, 10, generator=generator)
    y = (x @ teacher).argmax(dim=1)
    shuffle = torch.Generator().manual_seed(seed)
    return DataLoader(
        TensorDataset(x, y), batch_size=32, shuffle=True, generator=shuffle, pin_memory=pin_memory
    )


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))


def forward(model: nn.Module, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """mini.trainer's forward(input): the loss and a dict of records to log."""
    # Inputs and targets go where the model is; non_blocking: from pinned memory on CUDA.
    x, y = to_device(batch, next(model.parameters()).device, non_blocking=True)
    logits = model(x)
    return F.cross_entropy(logits, y), {"accuracy": (logits.argmax(1) == y).float().mean()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 updates: a smoke test")
    parser.add_argument("--max-steps", type=int, help="stop after this many updates in total")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/mini"))
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to train (default: cuda when available)",
    )
    args = parser.parse_args()
    planned = 40 if args.quick else 600  # the schedule's length; --max-steps may stop sooner
    max_steps = args.max_steps or planned
    every = 10 if args.quick else 100

    torch.manual_seed(SEED)
    device = torch.device(args.device)
    model = build_model().to(device)  # amp_wrap autocasts on the parameters' device type
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=planned)
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler)

    # BaseTrainer(grad_clip=1.0, mixed_precision="bf16", gradient_accumulation_steps=4,
    #             max_non_finite_grad_retries=3)
    step = compose(
        amp_wrap(dtype="bf16"),
        accumulate(micro_batches=4),
        clip(max_norm=1.0),
        guard_nonfinite(max_retries=3),
    )(make_step(forward))

    started: list[int] = []  # a custom hook: here, the step the run starts (or resumes) from

    def note_start(event) -> None:
        if event.kind == "start":
            started.append(event.state.step)

    plugins = [
        ema(decay=0.99),
        # after ema, whose average it saves; before note_start, which sees the resumed state
        checkpoints(
            args.out / "checkpoints", every=every, keep=Retention(keep_last=2, keep_every=5 * every)
        ),
        note_start,
        peak_memory(every=every),
        progress(every=every, records=["accuracy"]),
        log_metrics(every=every, sinks=[jsonl(args.out / "metrics.jsonl")]),
    ]
    loader = build_data_loader(SEED, pin_memory=device.type == "cuda")
    state = run(step, state, loader, max_steps=max_steps, plugins=plugins)
    print(f"trained from step {started[0]} to step {state.step}")


if __name__ == "__main__":
    main()
