"""toolkit's step against the same update written by hand, on a GPU, with a GPT-2-small.

A GPT-2-small-sized causal transformer (12 layers, width 768, 12 heads, context 1024, a
50304-token vocabulary: about 124M parameters), written here in plain torch, trained on
random tokens: bf16 autocast, fused AdamW, a ``torch.compile``'d model (the loss inside it,
as nanoGPT does), 4 micro-batches per update, clipping by norm and a non-finite guard.
Both sides train the same model and optimizer and take turns in alternating rounds in one
process, so that the compiled kernels, the memory placement and the card's clock are the
same for both. Printed: tokens per second of each side, their ratio (median of the rounds),
host syncs per micro-batch and per update (counted by CUDA's sync debug mode), and MFU
against the card's dense bf16 peak. Goal: a ratio of at least 0.99, zero syncs per
micro-batch that does not close a window.

    python benchmarks/gpu.py                         # about 2 minutes on an H100/H200
    python benchmarks/gpu.py --rounds 11 --updates 10 --batch 8
    python benchmarks/gpu.py --cpu-smoke             # a tiny model on the CPU: checks the code

Without CUDA (and without --cpu-smoke) it prints that it skipped and exits with status 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from toolkit import (
    Step,
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    compose,
    guard_nonfinite,
    make_step,
)

K = 4  # micro-batches per update
MAX_NORM = 1.0
# Dense bf16 peaks (FLOP/s) by a piece of the device name; --peak-tflops overrides.
PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 12
    width: int = 768
    heads: int = 12
    context: int = 1024
    vocab: int = 50304  # GPT-2's 50257, padded to a multiple of 64


class Block(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln1, self.ln2 = nn.LayerNorm(c.width), nn.LayerNorm(c.width)
        self.qkv, self.proj = nn.Linear(c.width, 3 * c.width), nn.Linear(c.width, c.width)
        self.mlp = nn.Sequential(
            nn.Linear(c.width, 4 * c.width),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * c.width, c.width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2: token and position embeddings, pre-norm blocks, a tied output layer."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.tokens, self.positions = (
            nn.Embedding(c.vocab, c.width),
            nn.Embedding(c.context, c.width),
        )
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)
        self.head.weight = self.tokens.weight
        for name, p in self.named_parameters():
            if p.dim() > 1:
                std = 0.02 / math.sqrt(2 * c.layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(*batch)


def toolkit_step() -> Step:
    """The step both the timing and the sync count use: bf16, accumulate K, clip, guard."""
    return compose(
        amp_wrap(dtype="bf16"),
        accumulate(micro_batches=K),
        clip(max_norm=MAX_NORM),
        guard_nonfinite(),
    )(make_step(loss_fn))


def toolkit_updates(state: list[TrainState], data: list) -> Callable[[int], None]:
    step = toolkit_step()

    def updates(n: int) -> None:
        for _ in range(n):
            for batch in data:
                state[0], _ = step(state[0], batch)

    return updates


def hand_written_updates(
    model: nn.Module, opt: torch.optim.Optimizer, data: list
) -> Callable[[int], None]:
    """The nanoGPT-order update a careful user writes: the same arithmetic as the step."""
    device_type = data[0][0].device.type

    def updates(n: int) -> None:
        for _ in range(n):
            window_loss = torch.zeros((), device=data[0][0].device)
            for batch in data:
                with torch.autocast(device_type, dtype=torch.bfloat16):
                    loss = loss_fn(model, batch)
                window_loss += loss.detach().float()
                (loss / K).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            if bool(torch.isfinite(norm) & torch.isfinite(window_loss)):  # the one host sync
                opt.step()
            opt.zero_grad(set_to_none=True)

    return updates


@contextlib.contextmanager
def counted_syncs() -> Iterator[list[str]]:
    """One entry per synchronising CUDA call in the block (sync debug mode "warn")."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only the reports of a synchronising call (the mode also warns that it is a prototype).
    found.extend(str(w.message) for w in caught if "called a synchronizing" in str(w.message))


def sync_counts(state: list[TrainState], hand: Callable[[int], None], data: list) -> dict[str, int]:
    """Host syncs: toolkit's per open micro-batch (worst), per closing one; by hand per update."""
    step = toolkit_step()
    open_counts = []
    for batch in data[:-1]:
        with counted_syncs() as syncs:
            state[0], out = step(state[0], batch)
        assert not out.closed
        open_counts.append(len(syncs))
    with counted_syncs() as closing:
        state[0], out = step(state[0], data[-1])
    assert out.closed
    with counted_syncs() as by_hand:
        hand(1)
    return {"micro": max(open_counts), "update": len(closing), "hand": len(by_hand)}


def timed_rounds(
    sides: dict[str, Callable[[int], None]], rounds: int, updates: int, sync: Callable[[], None]
) -> dict[str, list[float]]:
    """Seconds per round of each side, the order alternating from round to round."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            sync()
            start = time.perf_counter()
            sides[name](updates)
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11, help="timed rounds per side")
    parser.add_argument("--updates", type=int, default=10, help="updates per round")
    parser.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--warmup", type=int, default=3, help="untimed updates per side (compiles)")
    parser.add_argument("--peak-tflops", type=float, help="the card's dense bf16 peak")
    parser.add_argument("--no-compile", action="store_true", help="eager model")
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny model on the CPU")
    args = parser.parse_args()
    if args.cpu_smoke:
        device, config = (
            torch.device("cpu"),
            Config(layers=2, width=64, heads=4, context=32, vocab=256),
        )
        args.batch, args.rounds, args.updates, args.warmup = 2, 2, 2, 1
    elif torch.cuda.is_available():
        device, config = torch.device("cuda"), Config()
        torch.backends.cuda.matmul.allow_tf32 = True  # what a GPU job sets; both sides alike
        torch.backends.cudnn.allow_tf32 = True
    else:
        print("benchmarks/gpu.py: skipped, no CUDA device (--cpu-smoke checks the code on the CPU)")
        return

    torch.manual_seed(0)
    model = GPT(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    compiled = model if args.no_compile else torch.compile(model)
    opt = torch.optim.AdamW(
        model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    data = []
    for _ in range(K):
        ids = torch.randint(config.vocab, (args.batch, config.context + 1), device=device)
        data.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    state = [TrainState(model=compiled, optimizer=opt)]
    sides = {
        "hand-written": hand_written_updates(compiled, opt, data),
        "toolkit": toolkit_updates(state, data),
    }
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, {params / 1e6:.1f}M parameters, context "
          f"{config.context}, {args.batch} x {K} sequences per update, bf16, fused AdamW, "
          f"{'eager' if args.no_compile else 'torch.compile'}")  # fmt: skip
    started = time.perf_counter()
    for fn in sides.values():  # compiles (the model once: both sides call the same one)
        fn(args.warmup)
    sync()
    print(f"warm-up (compile) {time.perf_counter() - started:.1f} s")
    syncs = sync_counts(state, sides["hand-written"], data) if device.type == "cuda" else None
    times = timed_rounds(sides, args.rounds, args.updates, sync)

    tokens = args.updates * K * args.batch * config.context
    ratios = [h / t for h, t in zip(times["hand-written"], times["toolkit"])]
    flops_per_token = 6 * params + 12 * config.layers * config.width * config.context
    peak = args.peak_tflops * 1e12 if args.peak_tflops else next(
        (v for k, v in PEAKS.items() if k in name), None
    )  # fmt: skip
    for side, seconds in times.items():
        rate = tokens / statistics.median(seconds)
        mfu = f", MFU {rate * flops_per_token / peak:.1%}" if peak and device.type == "cuda" else ""
        print(f"{side:>12}: {rate:,.0f} tokens/s (median of {args.rounds} rounds){mfu}")
    print(f"toolkit / hand-written tokens per second: {statistics.median(ratios):.3f}x "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)}; goal >= 0.99x)")  # fmt: skip
    if syncs is not None:
        print(
            f"host syncs: toolkit {syncs['micro']} per micro-batch inside a window (goal 0), "
            f"{syncs['update']} on the closing one; hand-written {syncs['hand']} per update"
        )


if __name__ == "__main__":
    main()
