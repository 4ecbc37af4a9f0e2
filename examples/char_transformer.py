"""Train a small character-level transformer language model with toolkit.

The text is Python's own help pages: ``pydoc_data.topics``, the documentation topics behind
``help("assert")``, ``help("class")`` and so on, which ship with every CPython (about 465 000
characters in 79 topics for Python 3.11). Nothing is downloaded; the corpus is fixed for a
given Python version. Each topic is one document; every tenth topic (in sorted order) is
held out for validation.

Run::

    make example-transformer     # = OMP_NUM_THREADS=1 python examples/char_transformer.py
    python examples/char_transformer.py --out runs/char_transformer
    python examples/char_transformer.py --quick      # 20 updates, for smoke tests

What it shows: a loss function returning ``LossSum(summed loss, token count)``, so
accumulating micro-batches with different numbers of real (non-padding) tokens gives exactly
the gradient of the mean over all tokens of the update; bf16 autocast; accumulation;
gradient clipping; a non-finite guard; progress with tokens/s; token-weighted validation.
It prints the final validation loss and perplexity and a greedy sample.

On a CPU without native bf16 (no AVX512-BF16 / AMX), bf16 autocast is about twice as slow
as float32: it is here to show the decorator; drop ``amp_wrap`` from the step to train in
float32.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time
from pydoc_data.topics import topics

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from toolkit import (
    LossSum,
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
from toolkit.plugins import jsonl, log_metrics, progress, validate

SEED = 0
CONTEXT = 64  # characters the model sees
BATCH_SIZE = 32  # windows per micro-batch
MICRO_BATCHES = 2
PAD = 0  # token id of padding; never a real character


def load_corpus() -> tuple[list[str], list[str], list[str]]:
    """(vocabulary, training documents, validation documents) from Python's help topics."""
    docs = [topics[name] for name in sorted(topics)]
    chars = sorted(set("".join(docs)))
    train = [doc for i, doc in enumerate(docs) if i % 10 != 0]
    val = [doc for i, doc in enumerate(docs) if i % 10 == 0]
    return ["<pad>", *chars], train, val


def windows(docs: list[str], stoi: dict[str, int]) -> torch.Tensor:
    """Each document cut into rows of CONTEXT + 1 ids (inputs plus the shifted targets).

    A document's last row is padded with PAD: those targets are ignored by the loss and not
    counted, so micro-batches hold different numbers of real tokens.
    """
    rows = []
    for doc in docs:
        ids = [stoi[c] for c in doc]
        for start in range(0, len(ids) - 1, CONTEXT):
            row = ids[start : start + CONTEXT + 1]
            rows.append(row + [PAD] * (CONTEXT + 1 - len(row)))
    return torch.tensor(rows)


class CharTransformer(nn.Module):
    """A pre-norm GPT-style decoder: token + position embeddings, causal self-attention."""

    def __init__(self, vocab: int, d_model: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(CONTEXT, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model,
            heads,
            dim_feedforward=4 * d_model,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        # enable_nested_tensor only helps with padding masks, which a causal LM does not use.
        self.blocks = nn.TransformerEncoder(
            layer, layers, norm=nn.LayerNorm(d_model), enable_nested_tensor=False
        )
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        x = self.embed(ids) + self.position(torch.arange(length, device=ids.device))
        # Each position attends to itself and earlier ones only. Padding sits at the end of
        # a row, so no real token ever attends to it.
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=ids.device)
        return self.head(self.blocks(x, mask=mask, is_causal=True))


def summed_loss(model: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the real target tokens, and their number (a tensor)."""
    rows = to_device(rows, next(model.parameters()).device, non_blocking=True)
    inputs, targets = rows[:, :-1], rows[:, 1:]
    logits = model(inputs)
    # In float32: a bf16 sum over thousands of tokens would lose most of its precision.
    total = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=PAD, reduction="sum"
    )
    return total, (targets != PAD).sum()


def loss_fn(model: nn.Module, batch) -> LossSum:
    # The count stays a tensor: no host sync. The step divides the window's summed gradient
    # by the window's total count, and progress/log_metrics report tokens/s from it.
    total, count = summed_loss(model, batch[0])
    return LossSum(total, count)


def eval_fn(model: nn.Module, batch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    # (metrics, count): validate() weights each batch by its token count.
    total, count = summed_loss(model, batch[0])
    return {"loss": total / count}, count


@torch.no_grad()
def sample(model: nn.Module, prompt: str, stoi: dict[str, int], itos: list[str], n: int) -> str:
    """Greedy decoding: always the most likely next character."""
    model.eval()
    ids = torch.tensor([[stoi[c] for c in prompt]], device=next(model.parameters()).device)
    for _ in range(n):
        logits = model(ids[:, -CONTEXT:])[:, -1]
        logits[:, PAD] = -math.inf
        ids = torch.cat([ids, logits.argmax(dim=-1, keepdim=True)], dim=1)
    return "".join(itos[i] for i in ids[0].tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 updates, not 600: a smoke test")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/char_transformer"))
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to train (default: cuda when available)",
    )
    args = parser.parse_args()
    max_steps = 20 if args.quick else 600
    every = 5 if args.quick else 100  # updates between validations

    device = torch.device(args.device)
    torch.manual_seed(SEED)
    itos, train_docs, val_docs = load_corpus()
    stoi = {c: i for i, c in enumerate(itos)}
    shuffle = torch.Generator().manual_seed(SEED)
    train_loader = DataLoader(
        TensorDataset(windows(train_docs, stoi)),
        batch_size=BATCH_SIZE,
        shuffle=True,
        generator=shuffle,
        pin_memory=device.type == "cuda",
    )
    val_rows = windows(val_docs, stoi)
    if args.quick:
        val_rows = val_rows[:256]  # a fixed subset keeps the smoke test fast
    val_loader = DataLoader(TensorDataset(val_rows), batch_size=128)

    model = CharTransformer(len(itos)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    # Warm-up then cosine decay, one scheduler step per optimizer update.
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=3e-3, total_steps=max_steps, pct_start=0.1
    )
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler)
    metrics_path = args.out / "metrics.jsonl"

    step = compose(
        amp_wrap(dtype="bf16"),  # bf16 needs no loss scaler
        accumulate(micro_batches=MICRO_BATCHES),
        clip(max_norm=1.0),
        guard_nonfinite(),
    )(make_step(loss_fn))

    def eval_bf16(model: nn.Module, batch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        # Validation under the train step's autocast (amp_wrap): the same bf16 kernels.
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return eval_fn(model, batch)

    plugins = [
        validate(eval_bf16, val_loader, every=every, at_end=True),
        progress(every=every // 2, counts="tokens"),
        # existing="replace": a fresh run empties the file (the default refuses one that
        # holds lines); a run resumed from a checkpoint would continue it.
        log_metrics(every=10, sinks=[jsonl(metrics_path, existing="replace")]),
    ]
    print(
        f"{sum(p.numel() for p in model.parameters())} parameters, vocabulary {len(itos)}, "
        f"{sum(map(len, train_docs))} training / {sum(map(len, val_docs))} validation "
        f"characters"
    )
    started = time.perf_counter()
    state = run(step, state, train_loader, max_steps=max_steps, plugins=plugins)
    seconds = time.perf_counter() - started

    val = state.metrics["val"]  # at_end=True: the evaluation of the final weights
    loss = val["values"]["loss"]
    print(
        f"final validation loss: {loss:.4f} nats/char (perplexity {math.exp(loss):.2f}) at "
        f"update {val['step']}; {state.step} updates in {seconds:.1f} s"
    )
    print("greedy sample:", repr(sample(model, "The ", stoi, itos, 120)))
    print(f"metrics: {metrics_path}")


if __name__ == "__main__":
    main()
