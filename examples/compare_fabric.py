"""The same small job trained with Lightning Fabric and with toolkit, compared.

    python examples/compare_fabric.py            # needs lightning (the `compare` extra)

A small convolutional classifier on 48 random batches of 8 single-channel 8x8 images, SGD
with momentum and a cosine schedule, bf16 autocast, accumulation over 3 micro-batches, the
gradient norm clipped to 0.5: 16 updates, on the CPU. Fabric's way is its documented loop
(`fabric.no_backward_sync` on all but the window's last micro-batch, the loss divided by 3,
`fabric.backward`, `fabric.clip_gradients`); toolkit's is one composed step and `run()`. The
arithmetic is the same, so the final weights are bitwise equal;
`tests/integration/test_coming_from.py` checks it. docs/coming-from-fabric.md is the guide.

Lightning Fabric                              toolkit
--------------------------------------------  ---------------------------------------------
Fabric(precision="bf16-mixed")                amp_wrap(dtype="bf16")
model, opt = fabric.setup(model, opt)         TrainState(model=, optimizer=, scheduler=)
with fabric.no_backward_sync(model,           accumulate(micro_batches=3): gradient sync
    enabled=not last): ...                      only on the window's last micro-batch
fabric.backward(loss / 3)                     loss_fn returns the loss; the step divides
fabric.clip_gradients(model, opt,             clip(max_norm=0.5), once per update
  max_norm=0.5)
opt.step(); scheduler.step(); opt.zero_grad() done by the step, once per window
fabric.save(path, state) / fabric.load        checkpoints(folder, resume="latest")
fabric.log_dict(...)                          log_metrics(every=, sinks=[...])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from toolkit import TrainState, accumulate, amp_wrap, clip, compose, make_step, run

MICRO_BATCHES = 3
UPDATES = 16


def make_job(seed: int = 0):
    """The model, optimizer, scheduler and batches, the same for both ways of training."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=UPDATES)
    generator = torch.Generator().manual_seed(seed + 1)
    batches = [
        (
            torch.randn(8, 1, 8, 8, generator=generator),
            torch.randint(0, 10, (8,), generator=generator),
        )
        for _ in range(UPDATES * MICRO_BATCHES)
    ]
    return model, optimizer, scheduler, batches


def train_with_fabric(seed: int = 0) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Fabric's documented accumulation loop; (final weights, loss per micro-batch)."""
    from lightning.fabric import Fabric

    model, optimizer, scheduler, batches = make_job(seed)
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for index, (inputs, targets) in enumerate(batches):
        last = (index + 1) % MICRO_BATCHES == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = F.cross_entropy(model(inputs), targets)
            fabric.backward(loss / MICRO_BATCHES)
        if last:
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    weights = model.module.state_dict()
    return {name: t.detach().clone() for name, t in weights.items()}, losses


def train_with_toolkit(seed: int = 0) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same job as one composed step driven by run(); (final weights, loss per batch)."""
    model, optimizer, scheduler, batches = make_job(seed)

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(model(inputs), targets)

    train_step = compose(
        amp_wrap(dtype="bf16"), accumulate(micro_batches=MICRO_BATCHES), clip(max_norm=0.5)
    )(make_step(loss_fn))
    losses: list[float] = []

    def record_losses(event) -> None:
        if event.kind == "step":
            losses.extend(out.loss.item() for out in event.outs)

    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler)
    state = run(train_step, state, batches, max_steps=UPDATES, plugins=[record_losses])
    assert state.step == UPDATES
    return {name: t.detach().clone() for name, t in model.state_dict().items()}, losses


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts of the same names."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[name] - b[name]).abs().max().item() for name in a)


def main() -> None:
    fabric_weights, fabric_losses = train_with_fabric()
    toolkit_weights, toolkit_losses = train_with_toolkit()
    print(f"{UPDATES} updates of {MICRO_BATCHES} micro-batches each")
    print(f"last loss: fabric {fabric_losses[-1]:.6f}, toolkit {toolkit_losses[-1]:.6f}")
    print(f"largest weight difference: {max_difference(fabric_weights, toolkit_weights)}")


if __name__ == "__main__":
    main()
