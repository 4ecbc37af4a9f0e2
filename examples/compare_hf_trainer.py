"""The same small job trained with Hugging Face's Trainer and with toolkit, compared.

    python examples/compare_hf_trainer.py   # needs transformers 5 and accelerate: `hf`, `compare`

A 2-layer Llama built from its config (no download) on 32 padded sequences of 5 to 16
tokens, AdamW and a linear decay, batches of 4 accumulated over 2 micro-batches, the gradient
norm clipped to 1.0: 4 updates on the CPU. HF Trainer averages the loss over the window's
tokens (`num_items_in_batch`: it counts `labels[..., 1:] != -100` over the window's
micro-batches and the model divides its summed loss by that count); toolkit does the same
with `LossSum(total, count)`. HF computes the loss through its own functions, summing in
another order, so the final weights agree to rounding (6e-8 here, in float32), not bitwise;
the mean of each micro-batch's mean loss lands 1e-2 away.
`tests/integration/test_coming_from.py` checks both. docs/coming-from-hf-trainer.md is the guide.

HF Trainer                                    toolkit
--------------------------------------------  ---------------------------------------------
Trainer(model, args, train_dataset,           loss_fn(model, batch) + TrainState(model=,
  data_collator, optimizers=(opt, sched))       optimizer=, scheduler=) + a DataLoader
the model's loss with num_items_in_batch      LossSum(summed loss, count of targets)
per_device_train_batch_size                   DataLoader(batch_size=)
gradient_accumulation_steps                   accumulate(micro_batches=)
max_grad_norm                                 clip(max_norm=)
max_steps, num_train_epochs                   run(max_steps=, epochs=)
bf16=True                                     amp_wrap(dtype="bf16")
eval_strategy="steps", eval_steps              validate(eval_fn, loader, every=)
save_steps, save_total_limit,                 checkpoints(folder, every=, resume="latest",
  trainer.train(resume_from_checkpoint=True)    keep=Retention(keep_last=))
logging_steps, report_to                      log_metrics(every=, sinks=[...])
"""

from __future__ import annotations

import tempfile

import torch
from torch.utils.data import DataLoader

from toolkit import LossSum, TrainState, accumulate, clip, compose, make_step, run

BATCH, MICRO_BATCHES, UPDATES = 4, 2, 4
VOCAB, LENGTH = 64, 16


def make_job(seed: int = 0):
    """The model, optimizer, scheduler and padded sequences, the same for both ways."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=LENGTH,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / UPDATES)
    generator = torch.Generator().manual_seed(seed + 1)
    sequences = []
    for _ in range(UPDATES * MICRO_BATCHES * BATCH):
        length = int(torch.randint(5, LENGTH + 1, (), generator=generator))
        ids = torch.zeros(LENGTH, dtype=torch.long)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=generator)
        mask = (torch.arange(LENGTH) < length).long()
        sequences.append(
            {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        )
    return model, optimizer, scheduler, sequences


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def train_with_hf_trainer(seed: int = 0) -> dict[str, torch.Tensor]:
    """HF Trainer over the sequences in order (no shuffle), saving nothing; final weights."""
    from transformers import Trainer, TrainingArguments

    model, optimizer, scheduler, sequences = make_job(seed)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=BATCH,
            gradient_accumulation_steps=MICRO_BATCHES, max_steps=UPDATES, max_grad_norm=1.0,
            train_sampling_strategy="sequential", use_cpu=True, report_to="none",
            save_strategy="no", disable_tqdm=True, seed=seed,
        )  # fmt: skip
        trainer = Trainer(
            model=model, args=args, train_dataset=sequences, optimizers=(optimizer, scheduler)
        )
        trainer.train()
    return weights_of(model)


def causal_lm_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
    """The summed next-token loss and its count of targets (labels -100 are padding)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    total = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
    )
    return LossSum(total, (targets != -100).sum())


def train_with_toolkit(seed: int = 0, loss_fn=causal_lm_loss_sum) -> dict[str, torch.Tensor]:
    """The same job as one composed step driven by run(); final weights."""
    model, optimizer, scheduler, sequences = make_job(seed)
    train_step = compose(accumulate(micro_batches=MICRO_BATCHES), clip(max_norm=1.0))(
        make_step(loss_fn)
    )
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler)
    state = run(train_step, state, DataLoader(sequences, batch_size=BATCH), max_steps=UPDATES)
    assert state.step == UPDATES
    return weights_of(model)


def mean_of_means(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each micro-batch's mean loss, averaged over the window: not what HF Trainer does."""
    loss = causal_lm_loss_sum(model, batch)
    return loss.total / loss.count


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts of the same names."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[name] - b[name]).abs().max().item() for name in a)


def main() -> None:
    hf = train_with_hf_trainer()
    print(f"{UPDATES} updates of {MICRO_BATCHES} micro-batches of {BATCH} sequences")
    same = max_difference(hf, train_with_toolkit())
    print(f"toolkit with LossSum: largest weight difference {same:.2e}")
    off = max_difference(hf, train_with_toolkit(loss_fn=mean_of_means))
    print(f"toolkit with a mean loss per micro-batch: {off:.2e}")


if __name__ == "__main__":
    main()
