"""export_pretrained and export_model take the models people train: compiled, DDP, FSDP2,
with a peft adapter inside; the folder loads with from_pretrained and gives equal logits.
A wrong model is refused in one line; a tokenizer is written beside."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from spawning import gloo_group, spawn

from toolkit import TrainState, export_model, export_pretrained, make_step

transformers = pytest.importorskip("transformers", reason="needs the `hf` extra")
peft = pytest.importorskip("peft", reason="needs the `hf` extra")

VOCAB = 32
WORLD = 2
KINDS = ["ddp", "ddp_lora", "fsdp2", "fsdp2_lora"]


def _gpt2(lora: bool = False) -> torch.nn.Module:
    """A 2-layer float64 GPT-2 from its config (no download), tied embeddings, no dropout;
    with ``lora``, a peft LoRA on its attention whose B starts non-zero."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=1,
        eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).double()
    if not lora:
        return model
    adapter = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    model = peft.get_peft_model(model, adapter)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def _probe() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(9))


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _trained(model: torch.nn.Module, wrapped: torch.nn.Module) -> TrainState:
    """One AdamW update through ``wrapped`` (the weights leave their initial values)."""
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    state = TrainState(model=wrapped, optimizer=torch.optim.AdamW(trainable, lr=1e-2))
    return make_step(_loss)(state, _probe())[0]


def _loaded_logits(folder: Path, lora: bool) -> torch.Tensor:
    if lora:
        model = peft.PeftModel.from_pretrained(_gpt2(), folder)  # the same base (seed 0)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        return model.eval()(input_ids=_probe()).logits


@pytest.mark.parametrize("lora", [False, True], ids=["gpt2", "lora"])
@pytest.mark.parametrize("wrap", ["compile", "dataparallel"])
def test_a_compiled_or_wrapped_model_exports_a_folder_from_pretrained_loads(
    tmp_path: Path, wrap: str, lora: bool
) -> None:
    # Before: "the weights do not fit the model: missing ['_orig_mod.lm_head.weight', ...]".
    model = _gpt2(lora)
    if wrap == "compile":  # never called: the test needs the wrapper, not a compilation
        wrapped = torch.compile(model, backend="eager")
    else:
        wrapped = torch.nn.DataParallel(model)
    state = _trained(model, model).replace(model=wrapped)
    with torch.no_grad():
        expected = model.eval()(input_ids=_probe()).logits
    folder = export_pretrained(state, tmp_path / "hf")
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    assert (folder / weights).is_file()
    torch.testing.assert_close(_loaded_logits(folder, lora), expected, rtol=0, atol=0)
    merged = export_pretrained(state.model, tmp_path / "merged", merge=lora)
    plain = transformers.AutoModelForCausalLM.from_pretrained(merged)
    with torch.no_grad():
        logits = plain(input_ids=_probe()).logits
    torch.testing.assert_close(logits, expected, rtol=1e-10, atol=1e-10)


def test_a_wrong_model_is_refused_in_one_line_naming_its_type(tmp_path: Path) -> None:
    # Before: "... got DistributedDataParallel(" and the whole model printed.
    big = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(50)])
    with pytest.raises(TypeError) as error:
        export_pretrained(torch.nn.DataParallel(big), tmp_path / "a")
    assert str(error.value) == (
        "export_pretrained: model must be a transformers or peft model; got a Sequential. "
        "pass model=AutoModelForCausalLM.from_config(config) (or your PeftModel); for any "
        "other module, export_model writes a file."
    )
    with pytest.raises(TypeError, match=r"source must be .*; got a dict\.$"):
        export_model({"w": torch.zeros(3)}, tmp_path / "m.safetensors")


def test_merging_a_live_fsdp2_model_is_refused_before_any_gather(monkeypatch, tmp_path) -> None:
    # A live FSDP2 model holds shards: its merged copy cannot be made here (the gather of the
    # full weights would come first). The export of its checkpoint folder can.
    import toolkit.checkpoints._export as export

    monkeypatch.setattr(export, "is_sharded", lambda model: True)
    monkeypatch.setattr(export, "_read", lambda *a: pytest.fail("gathered before refusing"))
    message = "merge must be False for a live FSDP2 model; got True. Export the folder"
    with pytest.raises(ValueError, match=re.escape(message)):
        export_pretrained(_gpt2(lora=True), tmp_path / "merged", merge=True)


def test_the_tokenizer_is_written_beside_the_weights(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    words = {"<pad>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(["a", "cat", "sat"])}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>"
    )
    folder = export_pretrained(_gpt2(), tmp_path / "hf", tokenizer=tokenizer)
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {
        p.name for p in folder.iterdir()
    }
    loaded = transformers.AutoTokenizer.from_pretrained(folder)
    assert loaded("a cat sat dog").input_ids == [2, 3, 4, 1] and loaded.pad_token_id == 0


def _worker(rank: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    with gloo_group(rank, WORLD, store):
        for kind in KINDS:
            model = _gpt2(lora=kind.endswith("lora"))
            if kind.startswith("ddp"):
                wrapped = DistributedDataParallel(model)
            else:
                mesh = init_device_mesh("cpu", (WORLD,))
                base = model.get_base_model() if kind.endswith("lora") else model
                for block in base.transformer.h:
                    fully_shard(block, mesh=mesh)
                wrapped = fully_shard(model, mesh=mesh)
            state = _trained(model, wrapped)
            with torch.no_grad():  # FSDP2: every rank runs the forward (it gathers)
                logits = model.eval()(input_ids=_probe()).logits
            # Every rank calls them, each with its own path: only rank 0's is written.
            export_pretrained(state, Path(out) / f"{kind}{rank}")
            export_model(state, Path(out) / f"{kind}{rank}.safetensors")
            if rank == 0:
                torch.save(logits, Path(out) / f"{kind}.pt")


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
@pytest.mark.skipif(sys.platform != "linux", reason="gloo over FileStore tested on Linux")
def test_ddp_and_fsdp2_models_export_on_every_rank_and_rank_0_writes(tmp_path: Path) -> None:
    import safetensors.torch

    def attempt_args(attempt: int) -> tuple[str, str]:
        (tmp_path / f"out{attempt}").mkdir()
        return str(tmp_path / f"store{attempt}"), str(tmp_path / f"out{attempt}")

    spawn(_worker, attempt_args, nprocs=WORLD, timeout=180)
    out = max(tmp_path.glob("out*"))
    assert not list(out.glob("*1*")), "only rank 0 writes"
    for kind in KINDS:
        expected = torch.load(out / f"{kind}.pt")
        lora = kind.endswith("lora")
        torch.testing.assert_close(_loaded_logits(out / f"{kind}0", lora), expected, rtol=0, atol=0)
        model = _gpt2(lora)
        model.load_state_dict(safetensors.torch.load_file(out / f"{kind}0.safetensors"))
        with torch.no_grad():
            logits = model.eval()(input_ids=_probe()).logits
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
