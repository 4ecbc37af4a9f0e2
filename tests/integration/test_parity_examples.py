"""The examples/from_<trainer>.py scripts run as their users run them, with the outcome
those users expect: each in a short mode of a few seconds."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from toolkit.checkpoints import latest_checkpoint, list_checkpoints

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # each spawns a Python process that trains for a few seconds


def _run(script: str, *args: str, cwd: pathlib.Path) -> str:
    """Run examples/<script> with ``args`` in ``cwd``, warnings as errors; its stdout."""
    result = subprocess.run(
        [sys.executable, "-W", "error", str(ROOT / "examples" / script), *args],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{script} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _records(path: pathlib.Path) -> list[dict]:
    assert path.is_file(), f"no metrics file at {path}"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _series(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if key in r]


def _steps_on_disk(folder: pathlib.Path) -> list[int]:
    return sorted(info.step for info in list_checkpoints(folder))


def test_mini_trainer_runs_max_steps_and_resumes_from_latest(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "run"
    stdout = _run(
        "from_mini_trainer.py", "--quick", "--max-steps", "20", "--out", str(out), cwd=tmp_path
    )
    assert "trained from step 0 to step 20" in stdout, stdout
    # The same command again (CheckpointingHook(load="latest")): it goes on from step 20.
    stdout = _run("from_mini_trainer.py", "--quick", "--out", str(out), cwd=tmp_path)
    assert "trained from step 20 to step 40" in stdout, stdout

    records = _records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [10, 20, 30, 40]
    losses = _series(records, "train/loss")
    assert losses[-1] < losses[0], losses
    assert len(_series(records, "train/accuracy")) == 4  # forward's records are logged
    # ProgressHook(with_records=True): the accuracy record is shown on the progress line.
    assert re.search(r"step 40/40 .*accuracy 0\.\d+", stdout), stdout
    ckpt = out / "checkpoints"
    assert latest_checkpoint(ckpt).name == "step_000040"
    assert _steps_on_disk(ckpt) == [30, 40]  # keep_last=2


def test_pytorch_accelerated_makes_46_updates_with_epoch_losses(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "run"
    stdout = _run("from_pytorch_accelerated.py", "--quick", "--out", str(out), cwd=tmp_path)
    # 2 epochs of 45 batches with gradient_accumulation_steps=2: 23 updates per epoch, the
    # last one from a window of one batch, as pytorch_accelerated does.
    assert re.search(r"^46 updates in 2 epochs; train accuracy 0\.\d+$", stdout, re.M), stdout
    epochs = re.findall(
        r"epoch (\d) \(update (\d+)\): train_loss_epoch ([0-9.]+) eval_loss_epoch ([0-9.]+)",
        stdout,
    )
    assert [(e, u) for e, u, _, _ in epochs] == [("1", "23"), ("2", "46")], stdout
    train_losses = [float(t) for _, _, t, _ in epochs]
    assert train_losses[1] < train_losses[0]

    records = _records(out / "metrics.jsonl")
    assert _series(records, "train/epoch_loss") == pytest.approx(train_losses, abs=5e-5)
    # The evaluation-only run of the trained model gives the last epoch's eval loss.
    found = re.search(r"evaluation run: loss ([0-9.]+) accuracy ([0-9.]+)", stdout)
    assert found and float(found[1]) == pytest.approx(float(epochs[1][3]), abs=1e-4), stdout
    assert float(found[2]) > 0.8  # 3 classes: chance is 1/3


def test_fairseq2_sums_targets_and_keeps_last_and_best(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "run"
    stdout = _run("from_fairseq2.py", "--quick", "--out", str(out), cwd=tmp_path)
    per_epoch = int(re.search(r"targets per data epoch: (\d+)", stdout)[1])
    found = re.search(r"(\d+) updates, 4 data epochs, (\d+) target elements in total", stdout)
    assert found, stdout
    assert int(found[1]) == 32  # 16 batches per epoch, 2 per update, 4 epochs
    assert int(found[2]) == 4 * per_epoch  # every real target counted once: a sum, not a mean

    records = _records(out / "metrics.jsonl")
    sums = _series(records, "train/num_target_elements")
    assert sum(sums) == 4 * per_epoch, sums
    # Each publish covers 4 updates of 2 micro-batches of 16 sequences: 128 examples.
    assert _series(records, "train/num_examples") == [128] * 8
    assert _series(records, "train/total/num_target_elements")[-1] == 4 * per_epoch
    nll = dict(
        zip([r["step"] for r in records if "val/nll_loss" in r], _series(records, "val/nll_loss"))
    )
    assert nll[32] < nll[4], nll
    # keep_last_n_checkpoints=2 and keep_best_n_checkpoints=3 (by val/nll_loss): the union.
    best = sorted(sorted(nll, key=nll.__getitem__)[:3])
    assert _steps_on_disk(out / "checkpoints") == sorted({28, 32, *best})


def test_veomni_token_mean_loss_mfu_lr_groups_and_export(tmp_path: pathlib.Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    out = tmp_path / "run"
    stdout = _run("from_veomni.py", "--quick", "--out", str(out), cwd=tmp_path)
    assert "16 updates of 16 rows (4 micro-batches each)" in stdout, stdout

    records = _records(out / "metrics.jsonl")
    val = _series(records, "val/loss")
    assert val[-1] < val[0], val
    # build_param_groups: each group's learning rate is logged, the embeddings' a third; the
    # Muon group of the MultiOptimizer (TrainState(optimizer=[muon, adamw])) too, at 4x.
    lrs = [r for r in records if "train/lr/body" in r]
    assert lrs
    for r in lrs:
        assert r["train/lr/embed"] == pytest.approx(r["train/lr/body"] / 3)
        assert r["train/lr/matrices"] == pytest.approx(r["train/lr/body"] * 4)
    # MFU = 6 * n_params * tokens/s / peak (1e11): n_params from the exported weights.
    weights = safetensors.load_file(out / "hf_ckpt" / "model.safetensors")
    assert "embed.weight" in weights and "head.weight" in weights  # plain names
    n_params = sum(t.numel() for t in weights.values())
    mfu = [(r["train/mfu"], r["train/tokens_per_s"]) for r in records if "train/mfu" in r]
    assert mfu
    for value, tokens_per_s in mfu:
        assert value == pytest.approx(6 * n_params * tokens_per_s / 1e11, rel=1e-6)


def test_accel_hydra_config_drives_the_run(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("hydra", reason="the accel_hydra example needs the hydra extra")
    out = tmp_path / "run"
    # lr_scheduler_interval: epoch with StepLR(step_size=2): halved after epochs 2, 4 and 6.
    args = ["epochs=6", "lr_scheduler.step_size=2", f"hydra.run.dir={out}"]
    stdout = _run("from_accel_hydra.py", *args, cwd=tmp_path)
    found = re.search(r"(\d+) updates; best val/loss ([0-9.]+) at update (\d+);.* lr (\S+)", stdout)
    assert found, stdout
    assert int(found[1]) == 48  # 16 batches per epoch, gradient_accumulation_steps=2
    assert float(found[4]) == pytest.approx(0.01 * 0.5**3)
    best_step = int(found[3])
    assert (out / ".hydra" / "config.yaml").is_file()  # Hydra's record of the config
    records = _records(out / "metrics.jsonl")
    val = dict(zip([r["step"] for r in records if "val/loss" in r], _series(records, "val/loss")))
    assert sorted(val) == [8, 16, 24, 32, 40, 48]  # once per epoch
    assert min(val, key=val.__getitem__) == best_step
    # save_last_k=1 and checkpoints/best: the newest and the best.
    assert _steps_on_disk(out / "checkpoints") == sorted({48, best_step})

    # lr_scheduler_interval: step: StepLR(step_size=4) counts updates: 8 updates, 2 halvings.
    out = tmp_path / "step"
    args = ["epochs=1", "lr_scheduler_interval=step", "lr_scheduler.step_size=4"]
    stdout = _run("from_accel_hydra.py", *args, f"hydra.run.dir={out}", cwd=tmp_path)
    found = re.search(r"(\d+) updates;.* lr (\S+)", stdout)
    assert found and int(found[1]) == 8 and float(found[2]) == pytest.approx(0.0025), stdout
