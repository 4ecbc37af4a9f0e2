"""A GAN: two models, two optimizers, two steps alternated over the same batches.

    python examples/gan.py --out runs/gan  # 3000 updates of each model (13 s on a CPU)
    python examples/gan.py --quick         # 300 updates, a smoke test

The data: points on a ring of 8 Gaussians. The generator maps noise to points; the
discriminator tells real from generated. Each has its own TrainState and its own train step,
built from the same pieces as any other (clip, guard_nonfinite); a hand-written loop
alternates them: one discriminator update, then one generator update, per batch. That is
all run() is not for: it drives one state, so alternation is five lines of your own.

Two details keep the alternation exact:

* the discriminator's loss detaches the generated points, so its backward leaves no
  gradients on the generator;
* the generator's loss runs with the discriminator frozen (``requires_grad_(False)``), so its
  backward leaves no gradients on the discriminator that its next update would add
  (each step clears only its own optimizer's gradients).

``tests/step/test_multi_optimizer.py`` checks this alternation bitwise against the textbook hand
loop. The script prints how many of the 8 modes the generator covers and which share of its
points lie near a mode, at the start and at the end (the full run: 8 of 8, 86.5%), and
saves each state as its own checkpoint (``OUT/generator``, ``OUT/discriminator``; resume
with ``load_checkpoint(path, like=state)`` for each).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import pathlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from toolkit import (
    TrainState,
    clip,
    compose,
    guard_nonfinite,
    make_step,
    save_checkpoint,
    to_device,
)

MODES, RADIUS, SPREAD = 8, 2.0, 0.05
NOISE = 16


def ring(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` points from 8 Gaussians of std ``SPREAD`` on a circle of radius ``RADIUS``."""
    angles = torch.randint(0, MODES, (n,), generator=generator) * (2 * math.pi / MODES)
    centres = RADIUS * torch.stack([angles.cos(), angles.sin()], dim=1)
    return centres + SPREAD * torch.randn(n, 2, generator=generator)


def mlp(inputs: int, outputs: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(inputs, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, outputs)
    )


@contextlib.contextmanager
def frozen(module: nn.Module) -> Iterator[None]:
    """``module`` takes no gradients inside: another model's backward passes through it."""
    module.requires_grad_(False)
    try:
        yield
    finally:
        module.requires_grad_(True)


def quality(generator: nn.Module, n: int = 2000) -> tuple[int, float]:
    """(modes covered, share of points within 3 std of a mode) of ``n`` generated points."""
    angles = torch.arange(MODES) * (2 * math.pi / MODES)
    centres = RADIUS * torch.stack([angles.cos(), angles.sin()], dim=1)
    noise = torch.randn(n, NOISE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        points = generator(noise.to(next(generator.parameters()).device)).cpu()
    distance, nearest = torch.cdist(points, centres).min(dim=1)
    near = distance < 3 * SPREAD
    covered = int(nearest[near].unique().numel())
    return covered, float(near.float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 updates, a smoke test")
    parser.add_argument("--out", default="runs/gan", help="folder for the two checkpoints")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to train (default: cuda when available)",
    )
    args = parser.parse_args()
    updates, batch = (300, 128) if args.quick else (3000, 256)

    torch.manual_seed(0)
    device = torch.device(args.device)
    gen, disc = mlp(NOISE, 2).to(device), mlp(2, 1).to(device)
    betas = (0.5, 0.9)
    g_state = TrainState(model=gen, optimizer=torch.optim.Adam(gen.parameters(), 1e-3, betas=betas))
    d_state = TrainState(
        model=disc, optimizer=torch.optim.Adam(disc.parameters(), 1e-3, betas=betas)
    )

    def d_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        real, z = batch
        fake = gen(z).detach()  # no gradients on the generator
        real_logits, fake_logits = model(real), model(fake)
        return F.binary_cross_entropy_with_logits(
            real_logits, torch.ones_like(real_logits)
        ) + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))

    def g_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with frozen(disc):  # no gradients on the discriminator
            logits = disc(model(batch[1]))
        return F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))

    decorate = compose(clip(max_norm=5.0), guard_nonfinite())
    d_step, g_step = decorate(make_step(d_loss)), decorate(make_step(g_loss))

    covered, near = quality(gen)
    print(f"start: {covered} of {MODES} modes covered, {near:.1%} of points near a mode")
    data = torch.Generator().manual_seed(0)
    for update in range(1, updates + 1):
        # Drawn on the CPU (the same numbers on any device), then moved.
        batch_ = to_device((ring(batch, data), torch.randn(batch, NOISE, generator=data)), device)
        d_state, d_out = d_step(d_state, batch_)
        g_state, g_out = g_step(g_state, batch_)
        if update % (updates // 5) == 0:
            print(
                f"update {update}: discriminator loss {float(d_out.loss):.3f}, "
                f"generator loss {float(g_out.loss):.3f}"
            )
    covered, near = quality(gen)
    print(f"end: {covered} of {MODES} modes covered, {near:.1%} of points near a mode")
    print(f"updates: discriminator {d_state.step}, generator {g_state.step}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(g_state, out / "generator")
    save_checkpoint(d_state, out / "discriminator")
    print(f"saved {out / 'generator'} and {out / 'discriminator'}")


if __name__ == "__main__":
    main()
