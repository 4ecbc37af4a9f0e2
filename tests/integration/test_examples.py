"""The examples run end to end, as a user runs them, in their short ``--quick`` mode."""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # each spawns a Python process that trains for a few seconds


def _run_example(script: str, tmp_path: pathlib.Path, *args: str) -> str:
    """Run examples/<script> --quick in tmp_path, writing its run folder there; its stdout."""
    out = tmp_path / "run"
    # -W error: an example must run without warnings, like the test suite (filterwarnings).
    command = [sys.executable, "-W", "error", str(ROOT / "examples" / script), "--quick"]
    result = subprocess.run(
        [*command, "--out", str(out), *args],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{script} failed:\n{result.stdout}\n{result.stderr}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written elsewhere
    return result.stdout


def _metrics(path: pathlib.Path) -> list[dict[str, float]]:
    """The JSON lines of a metrics file, checked to have non-decreasing steps."""
    assert path.is_file(), f"no metrics file at {path}"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records, "the metrics file is empty"
    steps = [r["step"] for r in records]
    assert steps == sorted(steps), steps
    # Training intervals are published once each, at strictly increasing steps.
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert train_steps and train_steps == sorted(set(train_steps)), train_steps
    return records


def _last(records: list[dict[str, float]], key: str) -> float:
    return [r[key] for r in records if key in r][-1]


def test_digits_quick_trains_well_above_chance(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("sklearn", reason="the digits example needs the `examples` extra")
    stdout = _run_example("digits.py", tmp_path)

    found = re.search(r"final validation accuracy: ([0-9.]+) \(EMA: ([0-9.]+)\)", stdout)
    assert found, stdout
    accuracy, ema_accuracy = float(found[1]), float(found[2])
    assert accuracy > 0.5 and ema_accuracy > 0.5, stdout  # chance is 0.1

    records = _metrics(tmp_path / "run" / "metrics.jsonl")
    # The printed numbers are the last logged evaluations of the model and of its EMA.
    assert _last(records, "val/accuracy") == pytest.approx(accuracy, abs=5e-5)
    assert _last(records, "val_ema/accuracy") == pytest.approx(ema_accuracy, abs=5e-5)
    memory = "memory/peak_gib" if torch.cuda.is_available() else "memory/rss_peak_gib"
    for key in ("train/loss", "train/accuracy", "train/lr", "train/grad_norm", memory):
        assert any(key in r for r in records), key
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert losses[-1] < losses[0], losses


def test_char_transformer_quick_lowers_validation_loss(tmp_path: pathlib.Path) -> None:
    stdout = _run_example("char_transformer.py", tmp_path)

    found = re.search(
        r"final validation loss: ([0-9.]+) nats/char \(perplexity ([0-9.]+)\)", stdout
    )
    assert found, stdout
    loss, perplexity = float(found[1]), float(found[2])
    assert perplexity == pytest.approx(math.exp(loss), rel=1e-3)
    assert "greedy sample: 'The " in stdout

    records = _metrics(tmp_path / "run" / "metrics.jsonl")
    val_losses = [r["val/loss"] for r in records if "val/loss" in r]
    assert len(val_losses) >= 2 and val_losses[-1] < val_losses[0], val_losses
    assert val_losses[-1] == pytest.approx(loss, abs=5e-5)
    # Token counts reach the logs: the loss reports them through LossSum.
    assert all(
        r["train/tokens_per_s"] > r["train/samples_per_s"] for r in records if "train/loss" in r
    )


def test_gan_quick_alternates_two_states_and_moves_points_towards_the_modes(
    tmp_path: pathlib.Path,
) -> None:
    stdout = _run_example("gan.py", tmp_path)
    assert "updates: discriminator 300, generator 300" in stdout, stdout
    share = [float(s) for s in re.findall(r"modes covered, ([0-9.]+)% of points near", stdout)]
    assert len(share) == 2 and share[1] > share[0], stdout
    for name in ("generator", "discriminator"):
        assert (tmp_path / "run" / name / "model.safetensors").is_file(), name


def test_accel_hydra_takes_quick_device_and_out_like_the_other_examples(
    tmp_path: pathlib.Path,
) -> None:
    pytest.importorskip("hydra", reason="the accel_hydra example needs the hydra extra")
    omegaconf = pytest.importorskip("omegaconf")
    # --quick is epochs=2 log_every_n_steps=4; an override given after it wins.
    stdout = _run_example("from_accel_hydra.py", tmp_path, "--device", "cpu", "log_every_n_steps=8")
    assert "trained 2 epochs" in stdout and "16 updates;" in stdout, stdout

    out = tmp_path / "run"  # --out is Hydra's run folder
    config = omegaconf.OmegaConf.load(out / ".hydra" / "config.yaml")
    assert (config.device, config.epochs, config.log_every_n_steps) == ("cpu", 2, 8)
    records = _metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records if "train/loss" in r] == [8, 16]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_hf_causal_lm_quick_exports_a_folder_from_pretrained_loads(
    tmp_path: pathlib.Path, lora: bool
) -> None:
    pytest.importorskip("transformers", reason="the hf example needs the hf extra")
    pytest.importorskip("peft", reason="the hf example needs the hf extra")
    stdout = _run_example("hf_causal_lm.py", tmp_path, *(["--lora"] if lora else []))
    assert "reloaded with from_pretrained: logits equal" in stdout, stdout
    found = re.search(r"training loss ([0-9.]+) -> ([0-9.]+) after 6 updates", stdout)
    assert found and float(found[2]) < float(found[1]), stdout
    out = tmp_path / "run"
    _metrics(out / "metrics.jsonl")
    assert (out / "checkpoints" / "step_000006").is_dir()
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    assert (out / "hf" / weights).is_file()
    if lora:  # the merged model is a plain transformers folder; the EMA adapter too
        assert (out / "merged" / "config.json").is_file()
        assert (out / "hf_ema" / "adapter_model.safetensors").is_file()
        assert re.search(r"largest logit difference [0-9.]+e-0[5-9]", stdout), stdout
