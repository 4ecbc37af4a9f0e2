"""accel_hydra's workflow in toolkit: a Hydra config builds everything, toolkit trains it.

    pip install -e ".[hydra]"                              # hydra-core: the example's extra
    python examples/from_accel_hydra.py                    # config: accel_hydra_conf/config.yaml
    python examples/from_accel_hydra.py epochs=3 lr_scheduler_interval=step optimizer.lr=3e-3
    python examples/from_accel_hydra.py hydra.run.dir=runs/ah   # where the run folder goes
    python examples/from_accel_hydra.py device=cpu         # default (null): cuda when available
    python examples/from_accel_hydra.py --quick --device cpu --out /tmp/ah   # a smoke test

Everything the run writes (metrics.jsonl, checkpoints/, Hydra's .hydra/ and log) goes to
Hydra's run folder. The other examples' flags work too, as Hydra overrides: ``--quick`` is
``epochs=2 log_every_n_steps=4`` (overrides given after it still win), ``--device D`` is
``device=D`` and ``--out DIR`` is ``hydra.run.dir=DIR``. The task: two concentric noisy
circles, an MLP classifier, validation and early stopping on the validation loss every
epoch, the best checkpoint kept.

accel_hydra                                   toolkit
--------------------------------------------  ---------------------------------------------
Trainer subclass: training_step(batch,        loss_fn(model, batch) -> loss
  batch_idx) -> loss
validation_step + get_val_metrics()           eval_fn(model, batch) -> {"loss", "accuracy"}
                                                + validate(eval_fn, loader, every=updates
                                                per epoch)
hydra.utils.instantiate(cfg.model, ...)       the same: Hydra builds, toolkit trains
epochs / epoch_length (micro-batches)         run(epochs=) / run(max_steps=) (updates)
gradient_accumulation_steps (accelerate:      accumulate(micro_batches=) and
  the epoch's last window still steps)          run(partial_window="epoch")
max_grad_norm (default 2.0)                   clip(max_norm=2.0)
lr_scheduler_interval: step                   TrainState(scheduler=): stepped per update
lr_scheduler_interval: epoch                  TrainState(scheduler=per_epoch(sched)):
                                                run() steps it at each epoch's end
metric_monitor(metric_name, mode)             validate(monitor=, mode=) -> val/<metric>
checkpoints/best                              checkpoints(keep=Retention(keep_best=1,
                                                metric="val/loss"))
early_stop (patience, in epochs)              early_stop("val/loss", patience=)
save_every_n_epochs, save_last_k              checkpoints(every=updates per epoch,
                                                keep=Retention(keep_last=))
resume_from_checkpoint                        checkpoints(resume=path or "latest")
log_every_n_steps + report_to                 log_metrics(every=, sinks=[jsonl, tensorboard,
                                                wandb])
train(seed)                                   torch.manual_seed(seed)

What differs: accel_hydra's "step" counts micro-batches and its scheduler is stepped
num_processes times per update (Accelerate), so its schedules are sized in those units;
toolkit's state.step counts updates and the scheduler steps once per applied update. Its
retention deletes old checkpoints (by modification time) before the new one is written, and
a best save prunes the epoch checkpoint just written; toolkit prunes after an atomic write,
from the steps on disk, and the newest is never deleted. It logs the raw loss of one
micro-batch every log_every_n_steps and misses grad_norm when both counts are even;
toolkit logs interval means. A mid-epoch resume restarts its epoch's data; toolkit's
continues the pass exactly. Its checkpoint load is strict=False; toolkit's names every
difference.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from toolkit import TrainState, accumulate, clip, compose, make_step, per_epoch, run, to_device
from toolkit.plugins import (
    Retention,
    checkpoints,
    early_stop,
    jsonl,
    log_metrics,
    progress,
    tensorboard,
    validate,
    wandb,
)

try:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig
except ImportError:
    sys.exit('examples/from_accel_hydra.py needs Hydra: pip install -e ".[hydra]" (hydra-core)')


def circles(n: int, noise: float, generator: torch.Generator) -> TensorDataset:
    """Points on two circles (radius 1: class 0, radius 0.5: class 1), with Gaussian noise."""
    y = torch.arange(n) % 2
    angle = 2 * math.pi * torch.rand(n, generator=generator)
    radius = 1.0 - 0.5 * y
    x = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
    return TensorDataset(x + noise * torch.randn(n, 2, generator=generator), y)


def training_step(model: nn.Module, batch) -> torch.Tensor:
    # Inputs and targets go where the model is; non_blocking: from pinned memory on CUDA.
    features, labels = to_device(batch, next(model.parameters()).device, non_blocking=True)
    return F.cross_entropy(model(features), labels)


def validation_step(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    features, labels = to_device(batch, next(model.parameters()).device, non_blocking=True)
    logits = model(features)
    return {
        "loss": F.cross_entropy(logits, labels),
        "accuracy": (logits.argmax(-1) == labels).float().mean(),
    }


def sinks(cfg: DictConfig, out: pathlib.Path) -> list:
    known = {
        "jsonl": lambda: jsonl(out / "metrics.jsonl"),
        "tensorboard": lambda: tensorboard(out / "tensorboard"),
        "wandb": lambda: wandb(project="accel_hydra_example", dir=str(out)),
    }
    unknown = set(cfg.logging_config.report_to) - set(known)
    if unknown:
        raise ValueError(f"logging_config.report_to: unknown {sorted(unknown)}; use {list(known)}")
    return [known[name]() for name in cfg.logging_config.report_to]


def as_hydra_overrides(argv: list[str]) -> list[str]:
    """Command-line arguments with the other examples' flags turned into Hydra overrides.

    Example:
        >>> as_hydra_overrides(["--quick", "--device", "cpu", "epochs=3"])
        ['epochs=2', 'log_every_n_steps=4', 'device=cpu', 'epochs=3']
    """
    # No -h and no abbreviations: Hydra's own flags (--help, --cfg, --multirun) pass through.
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device")
    parser.add_argument("--out")
    flags, rest = parser.parse_known_args(argv)
    overrides = ["epochs=2", "log_every_n_steps=4"] if flags.quick else []
    if flags.device:
        overrides.append(f"device={flags.device}")
    if flags.out:
        overrides.append(f"hydra.run.dir={flags.out}")
    return overrides + rest  # Hydra applies them in order: the last value of a key wins


@hydra.main(version_base=None, config_path="accel_hydra_conf", config_name="config")
def main(cfg: DictConfig) -> None:
    out = pathlib.Path(HydraConfig.get().runtime.output_dir)
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    pin_memory = device.type == "cuda"  # lets the steps' copies to the GPU run asynchronously
    generator = torch.Generator().manual_seed(cfg.seed)
    train_loader = DataLoader(
        circles(cfg.data.n_train, cfg.data.noise, generator),
        batch_size=cfg.data.batch_size,
        shuffle=True,
        generator=generator,
        pin_memory=pin_memory,
    )
    val_data = circles(cfg.data.n_val, cfg.data.noise, generator)
    val_loader = DataLoader(val_data, batch_size=256, pin_memory=pin_memory)

    model = hydra.utils.instantiate(cfg.model).to(device)
    optimizer = hydra.utils.instantiate(cfg.optimizer)(model.parameters())
    lr_scheduler = hydra.utils.instantiate(cfg.lr_scheduler)(optimizer)
    if cfg.lr_scheduler_interval not in ("step", "epoch"):
        raise ValueError(
            f"lr_scheduler_interval must be step or epoch; got {cfg.lr_scheduler_interval}"
        )
    # STEP: stepped by the train step after every applied update. EPOCH: marked per_epoch,
    # stepped by run() at each epoch's end. Either way it is in the state, so checkpointed.
    if cfg.lr_scheduler_interval == "epoch":
        lr_scheduler = per_epoch(lr_scheduler)
    state = TrainState(model=model, optimizer=optimizer, scheduler=lr_scheduler)

    k = cfg.gradient_accumulation_steps
    decorators = [accumulate(micro_batches=k)]
    if cfg.max_grad_norm:  # null: no clipping
        decorators.append(clip(max_norm=cfg.max_grad_norm))
    step = compose(*decorators)(make_step(training_step))
    updates_per_epoch = math.ceil(len(train_loader) / k)  # the epoch's short window steps too

    monitor, mode = cfg.metric_monitor.metric_name, cfg.metric_monitor.mode
    # Every epoch's last update (the epoch's short window is applied): evaluated at the same
    # step as the checkpoint saved there, so keep_best sees the score. (per_epoch=True would
    # evaluate at "epoch_end", after that save.)
    plugins = [
        validate(validation_step, val_loader, every=updates_per_epoch, monitor=monitor, mode=mode),
    ]
    if cfg.early_stop:
        plugins.append(early_stop(f"val/{monitor}", patience=cfg.early_stop, mode=mode))
    plugins += [
        checkpoints(
            out / "checkpoints",
            every=cfg.save_every_n_epochs * updates_per_epoch if cfg.save_every_n_epochs else None,
            keep=Retention(
                keep_last=cfg.save_last_k, keep_best=1, metric=f"val/{monitor}", mode=mode
            ),
            resume=cfg.resume_from_checkpoint,
        ),
        progress(every=cfg.log_every_n_steps),
        log_metrics(every=cfg.log_every_n_steps, sinks=sinks(cfg, out)),
    ]
    state = run(
        step, state, train_loader, epochs=cfg.epochs, plugins=plugins, partial_window="epoch"
    )

    best, val = state.extras["val"], state.metrics["val"]["values"]
    print(f"stopped: {state.stop}" if state.stop else f"trained {state.epoch} epochs")
    lr = optimizer.param_groups[0]["lr"]
    print(
        f"{state.step} updates; best val/{monitor} {best['best']:.4f} at update "
        f"{best['best_step']}; last val/accuracy {val['accuracy']:.4f}; lr {lr:.2e}"
    )
    print(f"run folder: {out}")


if __name__ == "__main__":
    sys.argv[1:] = as_hydra_overrides(sys.argv[1:])
    main()
