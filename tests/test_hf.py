"""Hugging Face models and peft adapters: token-exact loss, batches, LoRA EMA, export folders."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the `hf` extra")

from toolkit import TrainState, accumulate, causal_lm_loss, make_step, to_device  # noqa: E402

VOCAB, PAD = 48, 0


def _gpt2(seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """A 2-layer GPT-2 built from its config (no download), tied embeddings, no dropout."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=1,
        eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).to(dtype)


def _padded(lengths: list[int], width: int, seed: int) -> torch.Tensor:
    """Token ids of the given lengths, right-padded with PAD to ``width``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), width), PAD)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(2, VOCAB, (length,), generator=g)
    return ids


def _lm_loss(model: torch.nn.Module, ids: torch.Tensor):
    labels = ids.masked_fill(ids == PAD, -100)
    return causal_lm_loss(model(input_ids=ids).logits, labels)


def test_accumulated_causal_lm_loss_equals_the_full_batch_to_1e_10() -> None:
    # Eight micro-batches of different sizes, lengths and padding widths: token-exact
    # accumulation gives the full batch's mean over all real tokens.
    shapes = [([5, 3], 6), ([9], 9), ([2, 7, 4], 8), ([11], 12), ([3, 3], 5), ([6], 10),
              ([8, 1, 12], 12), ([4], 4)]  # fmt: skip
    micro = [_padded(lengths, width, seed) for seed, (lengths, width) in enumerate(shapes)]
    model = _gpt2()
    reference = copy.deepcopy(model)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    step = accumulate(make_step(_lm_loss), micro_batches=8)
    for batch in micro:
        state, out = step(state, batch)
    assert out.updated and state.step == 1

    # By hand: one forward over every sequence padded to the longest, the summed loss over
    # the real next tokens divided by their number, one SGD update.
    full = torch.cat([torch.nn.functional.pad(b, (0, 12 - b.shape[1]), value=PAD) for b in micro])
    logits = reference(input_ids=full).logits[:, :-1]
    targets = full[:, 1:]
    real = targets != PAD
    losses = torch.nn.functional.cross_entropy(logits[real], targets[real], reduction="sum")
    (losses / real.sum()).backward()
    mean_of_means = copy.deepcopy(reference)
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.5 * p.grad
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10, msg=name)

    # The test can tell: the mean of the micro-batches' means lands elsewhere.
    for batch in micro:
        lm = _lm_loss(mean_of_means, batch)
        (lm.total / lm.count / 8).backward()
    with torch.no_grad():
        for p in mean_of_means.parameters():
            p -= 0.5 * p.grad
    gap = max(
        (p - q).abs().max().item() for p, q in zip(model.parameters(), mean_of_means.parameters())
    )
    assert gap > 1e-5


def test_causal_lm_loss_refuses_labels_of_another_shape() -> None:
    with pytest.raises(ValueError, match=r"labels' shape must be logits' \(2, 5\); got \(2, 4\)"):
        causal_lm_loss(torch.zeros(2, 5, 3), torch.zeros(2, 4, dtype=torch.long))


def test_causal_lm_loss_upcasts_16_bit_logits() -> None:
    logits = torch.randn(2, 6, 10).bfloat16()
    labels = torch.randint(0, 10, (2, 6))
    out = causal_lm_loss(logits, labels)
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), reduction="sum"
    )
    assert out.total.dtype == torch.float32 and out.count.item() == 10
    torch.testing.assert_close(out.total, expected, rtol=0, atol=0)


def test_to_device_moves_a_batch_encoding_and_keeps_its_type() -> None:
    encoding = transformers.BatchEncoding({"input_ids": torch.ones(2, 3, dtype=torch.long)})
    moved = to_device({"enc": encoding}, "meta")["enc"]
    assert type(moved) is transformers.BatchEncoding
    assert moved["input_ids"].device.type == "meta" and moved.input_ids.shape == (2, 3)
