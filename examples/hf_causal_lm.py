"""Train a small Hugging Face causal language model (or a LoRA adapter on it) with toolkit.

The model is a GPT-2 built from its config with ``AutoModelForCausalLM.from_config``: nothing
is downloaded. The text is Python's own help pages (``pydoc_data.topics``), one paragraph per
sequence, as UTF-8 bytes (token id = byte + 1; 0 is padding), so the batches hold sequences
of different lengths padded to the longest.

Run::

    python examples/hf_causal_lm.py --out runs/hf_causal_lm
    python examples/hf_causal_lm.py --lora     # a LoRA adapter on a frozen base (peft)
    python examples/hf_causal_lm.py --quick    # a few updates, for smoke tests

What it shows: ``causal_lm_loss`` (the shifted cross-entropy summed over the real tokens,
with their count, so accumulating micro-batches of different lengths gives the mean over
every token of the update), bf16 autocast, accumulation, clipping, checkpoints (a second run
with the same ``--out`` resumes), and ``export_pretrained`` from the last checkpoint to a
folder that ``from_pretrained`` loads: the whole model, or with ``--lora`` the adapter (for
``PeftModel.from_pretrained``) and the adapter merged into the base weights. With ``--lora``
an EMA of the adapter is kept too (the frozen base is not copied) and exported.

Needs the ``hf`` extra: ``pip install -e ".[hf]"``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import warnings
from pydoc_data.topics import topics

import torch
from transformers import AutoModelForCausalLM, GPT2Config

from toolkit import (
    TrainState,
    accumulate,
    amp_wrap,
    causal_lm_loss,
    clip,
    compose,
    export_pretrained,
    make_step,
    run,
    to_device,
)
from toolkit.checkpoints import latest_checkpoint
from toolkit.plugins import checkpoints, ema, jsonl, log_metrics, progress

SEED = 0
LENGTH = 128  # the longest sequence, in bytes
BATCH_SIZE = 8  # sequences per micro-batch
MICRO_BATCHES = 4


def paragraphs() -> list[torch.Tensor]:
    """Every paragraph of the help topics as token ids (byte + 1), cut to LENGTH."""
    texts = [p for name in sorted(topics) for p in topics[name].split("\n\n") if len(p) > 20]
    return [torch.tensor(list(p.encode()[:LENGTH])) + 1 for p in texts]


def collate(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-padded ids, the attention mask, and labels with -100 on the padding."""
    ids = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=0)
    return {"input_ids": ids, "attention_mask": ids != 0, "labels": ids.masked_fill(ids == 0, -100)}


def build_model(lora: bool) -> torch.nn.Module:
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=LENGTH, vocab_size=257, bos_token_id=1,
        eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config)
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():  # peft reads an attribute that transformers 5 deprecates
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        # GPT-2's layers are Conv1D (weights stored transposed): fan_in_fan_out=True.
        adapter = LoraConfig(r=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
        return get_peft_model(model, adapter)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 updates, not 300: a smoke test")
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/hf_causal_lm"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    max_steps = 6 if args.quick else 300
    device = torch.device(args.device)

    generator = torch.Generator().manual_seed(SEED)
    loader = torch.utils.data.DataLoader(
        paragraphs(), batch_size=BATCH_SIZE, shuffle=True, generator=generator, collate_fn=collate
    )
    model = build_model(args.lora).to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-3 if args.lora else 1e-3)
    state = TrainState(model=model, optimizer=optimizer)

    def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
        batch = to_device(batch, device, non_blocking=True)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return causal_lm_loss(logits, batch["labels"])  # LossSum(summed loss, token count)

    step = compose(
        amp_wrap(dtype="bf16"), accumulate(micro_batches=MICRO_BATCHES), clip(max_norm=1.0)
    )(make_step(loss_fn))
    plugins = [
        progress(every=2 if args.quick else 20, counts="tokens"),
        log_metrics(every=2 if args.quick else 20, sinks=[jsonl(args.out / "metrics.jsonl")]),
        checkpoints(args.out / "checkpoints", every=3 if args.quick else 100),
        *([ema(0.99)] if args.lora else []),  # averages the adapter only
    ]
    print(f"{sum(p.numel() for p in trainable)} trainable of {model.num_parameters()} parameters")
    state = run(step, state, loader, max_steps=max_steps, plugins=plugins)

    # Export from the last checkpoint, as one would after the run: the model given is the
    # architecture and config to write (its own weights are not used, nor changed).
    checkpoint = latest_checkpoint(args.out / "checkpoints")
    folder = export_pretrained(checkpoint, args.out / "hf", model=model)
    probe = collate(paragraphs()[:2])["input_ids"].to(device)
    model.eval()  # no dropout: from_pretrained returns a model in eval mode
    with torch.no_grad():
        expected = model(input_ids=probe).logits
        if args.lora:
            from peft import PeftModel

            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
                loaded = PeftModel.from_pretrained(build_model(False), folder)
            merged = export_pretrained(checkpoint, args.out / "merged", model=model, merge=True)
            export_pretrained(checkpoint, args.out / "hf_ema", model=model, weights="ema")
            plain = AutoModelForCausalLM.from_pretrained(merged)
            gap = (plain.to(device)(input_ids=probe).logits - expected).abs().max().item()
            print(f"merged model: {merged} (largest logit difference {gap:.1e})")
        else:
            loaded = AutoModelForCausalLM.from_pretrained(folder)
        same = torch.equal(loaded.to(device)(input_ids=probe).logits, expected)
    print(f"exported {folder}: {sorted(p.name for p in folder.iterdir())}")
    print(f"reloaded with from_pretrained: logits {'equal' if same else 'DIFFER'}")
    lines = (args.out / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["train/loss"] for line in lines if "train/loss" in line]
    print(f"training loss {losses[0]:.3f} -> {losses[-1]:.3f} after {state.step} updates")


if __name__ == "__main__":
    main()
