"""The same small job trained with Hugging Face Accelerate and with toolkit, compared.

    python examples/compare_accelerate.py            # needs accelerate (the `compare` extra)

A 2-layer MLP on 64 random batches of 8 samples, AdamW with a linear warm-up then decay,
accumulation over 4 micro-batches, the gradient norm clipped to 0.5 (about half the updates
clip): 16 updates, on the CPU.
Accelerate's way is its documented loop (`accelerator.accumulate`, `accelerator.backward`,
`accelerator.clip_grad_norm_` under `sync_gradients`); toolkit's is one composed step and
`run()`. The arithmetic is the same (each micro-batch's loss divided by 4 before its
backward, one clip and one optimizer and scheduler step per window), so the final weights
are bitwise equal; `tests/integration/test_coming_from.py` checks it.
docs/coming-from-accelerate.md is the guide.

Accelerate                                    toolkit
--------------------------------------------  ---------------------------------------------
Accelerator(gradient_accumulation_steps=4)    accumulate(micro_batches=4)
accelerator.prepare(model, opt, sched, dl)    TrainState(model=, optimizer=, scheduler=),
                                                to_device(batch, device) in the loss
with accelerator.accumulate(model):           train_step = compose(...)(make_step(loss_fn))
  loss = ...; accelerator.backward(loss)      loss_fn(model, batch) returns the loss
if accelerator.sync_gradients:                clip(max_norm=0.5), once per update
  accelerator.clip_grad_norm_(params, 0.5)
optimizer.step(); scheduler.step();           done by the step, in that order, once per
  optimizer.zero_grad()                         window
Accelerator(mixed_precision="bf16")           amp_wrap("bf16")
accelerator.save_state / load_state           checkpoints(folder, resume="latest")
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from toolkit import TrainState, accumulate, clip, compose, make_step, run

MICRO_BATCHES = 4
UPDATES = 16


def make_job(seed: int = 0):
    """The model, optimizer, scheduler and batches, the same for both ways of training."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    warmup = 4
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, (UPDATES - s) / (UPDATES - warmup))
    )
    generator = torch.Generator().manual_seed(seed + 1)
    batches = [
        (torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator))
        for _ in range(UPDATES * MICRO_BATCHES)
    ]
    return model, optimizer, scheduler, batches


def train_with_accelerate(seed: int = 0) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Accelerate's documented accumulation loop; (final weights, loss per micro-batch)."""
    from accelerate import Accelerator

    model, optimizer, scheduler, batches = make_job(seed)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MICRO_BATCHES)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    losses = []
    for inputs, targets in batches:
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(inputs), targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()  # a no-op but at the window's end, as the scheduler's step
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    weights = accelerator.unwrap_model(model).state_dict()
    return {name: t.detach().clone() for name, t in weights.items()}, losses


def train_with_toolkit(seed: int = 0) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same job as one composed step driven by run(); (final weights, loss per batch)."""
    model, optimizer, scheduler, batches = make_job(seed)

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(model(inputs), targets)

    train_step = compose(accumulate(micro_batches=MICRO_BATCHES), clip(max_norm=0.5))(
        make_step(loss_fn)
    )
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
    accelerate_weights, accelerate_losses = train_with_accelerate()
    toolkit_weights, toolkit_losses = train_with_toolkit()
    print(f"{UPDATES} updates of {MICRO_BATCHES} micro-batches each")
    print(f"last loss: accelerate {accelerate_losses[-1]:.6f}, toolkit {toolkit_losses[-1]:.6f}")
    print(f"largest weight difference: {max_difference(accelerate_weights, toolkit_weights)}")


if __name__ == "__main__":
    main()
