"""Hugging Face models and peft adapters: token-exact loss, batches, LoRA EMA, export folders."""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the `hf` extra")

import safetensors.torch  # noqa: E402

from toolkit import (  # noqa: E402
    TrainState,
    accumulate,
    causal_lm_loss,
    export_pretrained,
    make_step,
    run,
    save_checkpoint,
    to_device,
    unwrap,
)
from toolkit.plugins import ema, ema_model  # noqa: E402

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


def test_causal_lm_loss_takes_int32_labels() -> None:
    # Before: cross_entropy refused them ("expected target dtype to be Long or Byte, but got Int").
    logits, labels = torch.randn(2, 6, 10), torch.randint(0, 10, (2, 6), dtype=torch.int32)
    labels[0, 3] = -100
    out = causal_lm_loss(logits, labels)
    expected = causal_lm_loss(logits, labels.long())
    assert out.count.item() == 9 and torch.equal(out.total, expected.total)


def test_to_device_moves_a_batch_encoding_and_keeps_its_type() -> None:
    encoding = transformers.BatchEncoding({"input_ids": torch.ones(2, 3, dtype=torch.long)})
    moved = to_device({"enc": encoding}, "meta")["enc"]
    assert type(moved) is transformers.BatchEncoding
    assert moved["input_ids"].device.type == "meta" and moved.input_ids.shape == (2, 3)


def test_to_device_leaves_a_dynamic_cache_where_it_is_as_documented() -> None:
    # transformers 5's DynamicCache has no .to: it stays, the same object, its tensors unmoved
    # (the docs of to_device and map_nested_tensor say so; they used to say it moved).
    cache = transformers.DynamicCache()
    cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), layer_idx=0)
    moved = to_device({"past_key_values": cache, "ids": torch.ones(2)}, "meta")
    assert moved["past_key_values"] is cache and moved["ids"].device.type == "meta"
    assert cache.layers[0].keys.device.type == "cpu" and not hasattr(cache, "to")
    assert "has no ``.to``" in (to_device.__doc__ or "")


def _peft():
    return pytest.importorskip("peft", reason="needs the `hf` extra")


def _lora(seed: int = 0) -> torch.nn.Module:
    """A peft LoRA adapter on the attention and MLP input layers of a fresh tiny GPT-2."""
    peft = _peft()
    config = peft.LoraConfig(r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
    model = peft.get_peft_model(_gpt2(seed), config)
    torch.manual_seed(seed + 100)  # LoRA B starts at 0: give it values so merging shows
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def _train(model: torch.nn.Module, steps: int, plugins=()) -> TrainState:
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = TrainState(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-2))
    data = [_padded([6, 4], 8, seed) for seed in range(steps)]
    return run(make_step(_lm_loss), state, data, max_steps=steps, plugins=list(plugins))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_padded([7, 5], 8, seed=99)).logits


def test_export_pretrained_from_a_checkpoint_loads_with_from_pretrained(tmp_path) -> None:
    trained = _gpt2()
    state = _train(trained, 3)
    assert trained.lm_head.weight is trained.transformer.wte.weight  # tied
    checkpoint = save_checkpoint(state, tmp_path / "ckpt")
    folder = export_pretrained(checkpoint, tmp_path / "hf", model=_gpt2(seed=1))
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors",
    ]  # fmt: skip
    names = safetensors.torch.load_file(folder / "model.safetensors").keys()
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names  # once
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert loaded.dtype == torch.float64 and type(loaded) is type(trained)
    torch.testing.assert_close(_logits(loaded), _logits(trained), rtol=0, atol=0)


def test_export_pretrained_shards_above_max_shard_size(tmp_path) -> None:
    trained = _gpt2()
    folder = export_pretrained(trained, tmp_path / "hf", max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (folder / "model.safetensors").exists()
    assert "lm_head.weight" not in index["weight_map"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    torch.testing.assert_close(_logits(loaded), _logits(trained), rtol=0, atol=0)


def test_ema_of_a_lora_model_holds_the_adapter_only() -> None:
    model = _lora()
    trajectory: list = []

    def record(event) -> None:
        if event.kind == "start" or (event.kind == "step" and event.out.updated):
            trainable = {n: p.detach().clone() for n, p in model.named_parameters()}
            trajectory.append({n: p for n, p in trainable.items() if "lora_" in n})

    state = _train(model, 4, [record, ema(0.7, warmup=False)])
    params = state.extras["ema"]["params"]
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert params.keys() == trainable.keys() and all("lora_" in n for n in params)
    held = sum(t.numel() for t in params.values())
    assert held == sum(p.numel() for p in trainable.values()) < model.num_parameters() / 5
    expected = dict(trajectory[0])  # by hand: ema <- 0.7 ema + 0.3 p after each update
    for weights in trajectory[1:]:
        expected = {n: 0.7 * v + 0.3 * weights[n] for n, v in expected.items()}
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-12)
    averaged = ema_model(state)  # the whole model: frozen base from the live one
    assert averaged.state_dict().keys() == model.state_dict().keys()
    base = "base_model.model.transformer.wte.weight"
    torch.testing.assert_close(averaged.state_dict()[base], model.state_dict()[base])


def test_unwrap_peels_wrappers_around_a_peft_model_and_keeps_it() -> None:
    model = _lora()
    wrapped = torch.compile(torch.nn.DataParallel(model), backend="eager")
    assert unwrap(wrapped) is model  # the PeftModel: save_pretrained writes the adapter


def test_export_the_adapter_or_the_merged_model_from_a_checkpoint(tmp_path) -> None:
    peft = _peft()
    model = _lora()
    state = _train(model, 3, [ema(0.5)])
    checkpoint = save_checkpoint(state, tmp_path / "ckpt")
    fresh = _lora(seed=1)  # another init: the checkpoint's weights must be what is written
    before = {n: t.clone() for n, t in fresh.state_dict().items()}
    adapter = export_pretrained(checkpoint, tmp_path / "adapter", model=fresh)
    assert (adapter / "adapter_model.safetensors").stat().st_size < 100_000
    loaded = peft.PeftModel.from_pretrained(_gpt2(), adapter)  # the same base (seed 0)
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=0)

    merged = export_pretrained(checkpoint, tmp_path / "merged", model=fresh, merge=True)
    plain = transformers.AutoModelForCausalLM.from_pretrained(merged)
    assert type(plain) is transformers.GPT2LMHeadModel
    torch.testing.assert_close(_logits(plain), _logits(model), rtol=1e-10, atol=1e-10)
    after = fresh.state_dict()  # merged on a copy: the model keeps its adapter and weights
    assert after.keys() == before.keys() and all(torch.equal(before[n], after[n]) for n in after)

    averaged = export_pretrained(checkpoint, tmp_path / "ema", model=fresh, weights="ema")
    adapter_weights = safetensors.torch.load_file(averaged / "adapter_model.safetensors")
    name = "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"
    expected = state.extras["ema"]["params"][name.replace("lora_A.", "lora_A.default.")]
    torch.testing.assert_close(adapter_weights[name], expected, rtol=0, atol=0)


def test_export_pretrained_refuses_what_it_cannot_write(tmp_path) -> None:
    with pytest.raises(TypeError, match="model must be a transformers or peft model.*export_model"):
        export_pretrained(torch.nn.Linear(2, 2), tmp_path / "a")
    checkpoint = save_checkpoint(_train(_gpt2(), 1), tmp_path / "ckpt")
    with pytest.raises(TypeError, match=r"got a NoneType\. pass model=AutoModelForCausalLM"):
        export_pretrained(checkpoint, tmp_path / "b")
    with pytest.raises(ValueError, match=r"do not fit the model: missing \['base_model"):
        export_pretrained(checkpoint, tmp_path / "c", model=_lora())
    with pytest.raises(ValueError, match="merge must be False for a model without a peft"):
        export_pretrained(_gpt2(), tmp_path / "d", merge=True)


def test_a_checkpoint_holding_tied_tensors_once_exports_every_name(tmp_path, monkeypatch) -> None:
    # A sharded (FSDP2) checkpoint's pieces hold lm_head.weight only as an alias of the
    # embedding: both exports must still write (or tie) it.
    import toolkit.checkpoints._export as export

    trained = _gpt2()
    checkpoint = save_checkpoint(_train(trained, 1), tmp_path / "ckpt")
    once = export.full_model

    def without_aliases(manifest):
        return {k: v for k, v in once(manifest).items() if k not in manifest.aliases}

    monkeypatch.setattr(export, "full_model", without_aliases)
    folder = export_pretrained(checkpoint, tmp_path / "hf", model=_gpt2(seed=1))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    torch.testing.assert_close(_logits(loaded), _logits(trained), rtol=0, atol=0)
    path = export.export_model(checkpoint, tmp_path / "model.safetensors")
    _gpt2(seed=1).load_state_dict(safetensors.torch.load_file(path), strict=True)
