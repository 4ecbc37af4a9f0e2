"""Jobs launched as users launch them: torchrun with 2 (or 4) CPU ranks over gloo.

The DDP and FSDP2 examples in their ``--quick`` mode, the tensor-parallel one on 4 ranks
(dp 2 x tp 2), and a job whose worker is SIGKILLed and restarted by torchrun. Each launch
has a timeout; a rank that dies by SIGABRT (gloo at interpreter exit,
shared/research/feasibility.md item 1c) is retried once in a fresh folder.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # each launches torchrun: a few seconds of 2 processes


def _torchrun(
    tmp_path: pathlib.Path, script: pathlib.Path, *args: str, restarts: int = 0, ranks: int = 2
) -> tuple[pathlib.Path, str]:
    """Run ``script`` under torchrun on ``ranks`` ranks in a fresh folder: (the folder, its
    output)."""
    for attempt in range(2):
        folder = tmp_path / f"attempt{attempt}"
        folder.mkdir(parents=True)
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            f"--max-restarts={restarts}",
            str(script),
            *args,
        ]
        result = subprocess.run(
            command,
            cwd=folder,
            # Warnings are errors in the workers too, as in the rest of the suite.
            env={
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(ROOT),
                "PYTHONWARNINGS": "error",
            },
            capture_output=True,
            text=True,
            timeout=60 * ranks,
        )
        output = result.stdout + result.stderr
        if result.returncode == 0:
            return folder, result.stdout
        if "SIGABRT" not in output or attempt:
            break
    raise AssertionError(f"{script.name} failed ({result.returncode}):\n{output[-6000:]}")


def _metrics(path: pathlib.Path) -> list[dict[str, float]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    # Rank 0 alone writes: every training interval once, at increasing steps.
    steps = [r["step"] for r in records if "train/loss" in r]
    assert steps and steps == sorted(set(steps)), steps
    return records


def test_ddp_example_trains_on_two_ranks(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("sklearn", reason="the digits examples need the `examples` extra")
    folder, stdout = _torchrun(tmp_path, ROOT / "examples" / "ddp_digits.py", "--quick")
    found = re.search(r"final validation accuracy: ([0-9.]+) \(EMA: ([0-9.]+)\)", stdout)
    assert found and "on 2 rank(s)" in stdout, stdout
    assert float(found[1]) > 0.5 and float(found[2]) > 0.5, stdout  # chance is 0.1
    assert stdout.count("final validation accuracy") == 1  # rank 0 prints, rank 1 does not
    records = _metrics(folder / "runs" / "ddp_digits" / "metrics.jsonl")
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert losses[-1] < losses[0], losses
    val = [r["val/accuracy"] for r in records if "val/accuracy" in r]
    assert val[-1] == pytest.approx(float(found[1]), abs=5e-5)
    checkpoints = folder / "runs" / "ddp_digits" / "ckpt"
    assert (checkpoints / "latest").read_text().strip() == "step_000066"
    # One writer, the single-process format, plus rank 1's RNG states and data position.
    assert (checkpoints / "step_000066" / "model.safetensors").is_file()
    assert (checkpoints / "step_000066" / "rank_00001.json").is_file()


def test_fsdp2_example_trains_on_two_ranks(tmp_path: pathlib.Path) -> None:
    folder, stdout = _torchrun(tmp_path, ROOT / "examples" / "fsdp2_char_transformer.py", "--quick")
    found = re.search(r"final validation loss: ([0-9.]+) nats/char", stdout)
    assert found and "20 updates on 2 rank(s)" in stdout, stdout
    run_dir = folder / "runs" / "fsdp2_char_transformer"
    val = [r["val/loss"] for r in _metrics(run_dir / "metrics.jsonl") if "val/loss" in r]
    assert len(val) >= 2 and val[-1] < val[0], val
    assert val[-1] == pytest.approx(float(found[1]), abs=5e-5)
    newest = run_dir / "ckpt" / "step_000020"
    assert (run_dir / "ckpt" / "latest").read_text().strip() == newest.name
    # Sharded: each rank wrote its own shard file, and no rank gathered the whole model.
    assert not (newest / "model.safetensors").exists()
    assert len(list((newest / "sharded").glob("shard-*"))) == 2


def test_tp_example_trains_on_a_dp_by_tp_mesh(tmp_path: pathlib.Path) -> None:
    script = ROOT / "examples" / "tp_char_transformer.py"
    folder, stdout = _torchrun(tmp_path, script, "--quick", ranks=4)
    found = re.search(r"final validation loss: ([0-9.]+) nats/char", stdout)
    assert found and "10 updates on 4 rank(s) (dp 2 x tp 2)" in stdout, stdout
    assert stdout.count("final validation loss") == 1  # rank 0 alone prints
    run_dir = folder / "runs" / "tp_char_transformer"
    records = _metrics(run_dir / "metrics.jsonl")
    val = [r["val/loss"] for r in records if "val/loss" in r]
    # Below a uniform guess over the 104 characters of the vocabulary, and falling.
    assert len(val) == 2 and val[-1] < val[0] < math.log(104), val
    assert val[-1] == pytest.approx(float(found[1]), abs=5e-5)
    # The two ranks of a tensor-parallel replica are counted once: each interval of 5 updates
    # of 2 micro-batches of 32 rows over the data ranks has at most 64 targets a row (the
    # last row of a document is padded), not twice as many.
    most = 5 * 2 * 32 * 64
    tokens = [r["train/tokens"] for r in records if "train/tokens" in r]
    assert len(tokens) == 2 and all(0.95 * most < n <= most for n in tokens), tokens
    assert records[-1]["train/total/tokens"] == sum(tokens)
    for r in records:  # samples counted over the same ranks as the tokens
        assert 0.95 * 64 < r["train/tokens_per_s"] / r["train/samples_per_s"] <= 64, r
    newest = run_dir / "ckpt" / "step_000010"
    assert (run_dir / "ckpt" / "latest").read_text().strip() == newest.name
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    assert len(list((newest / "sharded").glob("shard-*"))) == 4  # each rank its 2-D shards


def test_a_lost_worker_is_not_a_lost_job(tmp_path: pathlib.Path) -> None:
    job = ROOT / "tests" / "elastic_job.py"
    reference, _ = _torchrun(tmp_path / "whole", job, "--ckpt", "ckpt", "--out", "result")
    arguments = ("--ckpt", "ckpt", "--out", "result", "--kill-at", "7")
    killed, _ = _torchrun(tmp_path / "killed", job, *arguments, restarts=2)
    for rank in (0, 1):
        whole = json.loads((reference / f"result.rank{rank}.json").read_text())
        got = json.loads((killed / f"result.rank{rank}.json").read_text())
        assert whole["attempt"] == 0 and got["attempt"] == 1  # torchrun restarted the group
        assert got["started"] == 6  # from the newest checkpoint (every 3; lost in update 8)
        assert (got["step"], got["params"], got["optimizer"]) == (
            whole["step"],
            whole["params"],
            whole["optimizer"],
        )
        # The resumed pass loaded only the samples it trained on: the last 24 of 48.
        assert got["loaded"] == whole["loaded"][24:]
