"""The README's quick start runs as written and trains; the README starts
with getting started, and the reference moved to docs/ keeps its code and links working."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


@pytest.mark.slow
def test_quick_start_runs_and_trains(tmp_path: Path) -> None:
    blocks = _python_blocks(README.read_text())
    assert blocks, "README.md has no python block"
    script = tmp_path / "quick_start.py"
    script.write_text(blocks[0])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    accuracy = float(re.search(r"train accuracy: ([0-9.]+)", done.stdout).group(1))
    assert accuracy > 0.9  # chance is 0.1
    rows = [
        json.loads(line) for line in (tmp_path / "runs/a/metrics.jsonl").read_text().splitlines()
    ]
    assert [row["step"] for row in rows] == [50, 100, 150, 200]
    # validate(every=100) publishes val/loss and val/accuracy, as the text after the block says
    validated = [row["step"] for row in rows if {"val/loss", "val/accuracy"} <= row.keys()]
    assert validated == [100, 200]
    assert rows[-1]["val/accuracy"] == pytest.approx(accuracy, abs=5e-4)


def test_getting_started_comes_first_and_fits_in_80_lines() -> None:
    lines = README.read_text().splitlines()
    assert lines.index("## Getting started") < 10
    first_reference = next(
        i
        for i, line in enumerate(lines)
        if line.startswith("## ") and i > 1 and "Getting" not in line
    )
    assert first_reference <= 80, f"{first_reference} lines before {lines[first_reference]!r}"
    getting_started = "\n".join(lines[:first_reference])
    for needed in ("make example", "make test-fast", "make test ", "toolkit-steps", "eval_fn"):
        assert needed in getting_started, needed
    assert len(README.read_bytes()) < 40_000  # the reference lives in docs/


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_python_blocks_parse_and_import_only_public_names(page: Path) -> None:
    for block in _python_blocks(page.read_text()):
        tree = ast.parse(block)  # a SyntaxError names the page's block
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("toolkit"):
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not missing, f"{page.name}: {node.module} has no {missing}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_reach_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def test_a_broken_link_would_be_reported() -> None:
    assert _anchor('What "exact" covers') == "what-exact-covers"
    assert _anchor("Quick start") == "quick-start"
    assert not (ROOT / "docs" / "no-such-page.md").exists()


_HF_PAGE_CHECKS = """
# The test's checks, after the page's blocks.
import os
batch = collator([tokenizer(t) for t in texts[:4]])  # long and short: a shuffled batch may not mix
padding = batch["attention_mask"] == 0
assert padding.any() and torch.equal(batch["labels"] == -100, padding), batch
assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
assert scheduler.last_epoch == 8 and scheduler.get_last_lr()[0] == 0.0  # warmed up, decayed
assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir("runs/a/hf"))
probe = batch["input_ids"]
with torch.no_grad():
    live = AutoModelForCausalLM.from_pretrained("runs/a/hf")(input_ids=probe).logits
    saved = AutoModelForCausalLM.from_pretrained("runs/a/hf_from_checkpoint")(input_ids=probe)
    assert torch.equal(live, saved.logits)
    trained = state.model.eval()(input_ids=probe).logits
    assert torch.equal(loaded.eval()(input_ids=probe).logits, trained)
    merged = AutoModelForCausalLM.from_pretrained("runs/lora/merged")(input_ids=probe).logits
    assert (merged - trained).abs().max() < 1e-4
print("the page ran")
"""


@pytest.mark.slow
def test_the_hugging_face_page_runs_in_order_and_exports_what_it_says(tmp_path: Path) -> None:
    # The LoRA path (trainable_only checkpoints, then export) works as
    # written, and so do the collator, parameter groups, warm-up and gradient checkpointing.
    pytest.importorskip("transformers", reason="needs the `hf` extra")
    pytest.importorskip("peft", reason="needs the `hf` extra")
    blocks = _python_blocks((ROOT / "docs" / "hugging-face.md").read_text())
    script = tmp_path / "page.py"
    script.write_text("\n".join(blocks) + _HF_PAGE_CHECKS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    peft_warning = "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"  # peft's
    done = subprocess.run(
        [sys.executable, "-W", "error", "-W", peft_warning, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the page ran" in done.stdout
