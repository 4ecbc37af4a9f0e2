# Every target builds its own virtual environment on first use.
# make bench BENCH_ARGS="--repeat 5" measures five times and prints the range (the compiled
# transformer rows of overhead.py take 5 to 10 minutes of each pass);
# CHECKPOINT_BENCH_ARGS="--rounds 9 --dir /mnt/fast" goes to the checkpoint benchmark.
#
# torch is installed first, pinned, from pip's configured index: on an ordinary Linux x86
# machine PyPI's torch==2.13.0 is the CUDA build (several GB of NVIDIA packages). For the CPU
# build, ask PyTorch's own CPU index:
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# and for another version: make test TORCH=torch==2.6.0. Changing either reinstalls torch.
PYTHON ?= python3.11
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
VENV ?= .venv
BIN := $(VENV)/bin
export OMP_NUM_THREADS ?= 1

.PHONY: FORCE install test test-fast lint type example example-transformer example-hf example-ddp example-tp bench bench-instructions wheel clean

# The torch choice is a file, rewritten only when it changes, so that a new TORCH or
# TORCH_INDEX reinstalls instead of silently keeping the torch already in $(VENV).
$(VENV)/torch-choice: FORCE
	@mkdir -p $(VENV)
	@echo "$(TORCH) $(TORCH_INDEX)" | cmp -s - $@ || echo "$(TORCH) $(TORCH_INDEX)" > $@

$(BIN)/pip:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(BIN)/.torch: Makefile $(VENV)/torch-choice | $(BIN)/pip
	$(BIN)/pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	touch $@

# make example needs the core and the examples extra (scikit-learn) only; every other
# target installs every extra (transformers, lightning, wandb...: ten times the disk).
$(BIN)/.installed-examples: pyproject.toml $(BIN)/.torch
	$(BIN)/pip install --quiet -e ".[examples]"
	touch $@

$(BIN)/.installed: pyproject.toml $(BIN)/.torch
	$(BIN)/pip install --quiet -e ".[dev,examples,loggers,plot,hydra,hf,compare]"
	touch $@

install: $(BIN)/.installed

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

lint: install
	$(BIN)/ruff check toolkit tests examples benchmarks
	$(BIN)/ruff format --check toolkit tests examples benchmarks

type: install
	$(BIN)/mypy toolkit

example: $(BIN)/.installed-examples
	$(BIN)/python examples/digits.py

example-transformer: install
	$(BIN)/python examples/char_transformer.py

example-hf: install
	$(BIN)/python examples/hf_causal_lm.py

example-ddp: install
	$(BIN)/torchrun --standalone --nproc_per_node=2 examples/ddp_digits.py

example-tp: install
	$(BIN)/torchrun --standalone --nproc_per_node=4 examples/tp_char_transformer.py

bench: install
	$(BIN)/python benchmarks/overhead.py --compiled $(BENCH_ARGS)
	$(BIN)/python benchmarks/checkpoint.py $(CHECKPOINT_BENCH_ARGS)
	$(BIN)/python benchmarks/ddp.py

# Instruction counts under valgrind (no timing noise; about 1.5 minutes per variant, two at
# a time: some 6 minutes for all five).
bench-instructions: install
	$(BIN)/python benchmarks/instructions.py $(BENCH_ARGS)

# dist/toolkit_steps-<version>-py3-none-any.whl, to pip install into an environment of your
# own (the build fetches setuptools into an isolated environment, as pip does).
wheel: | $(BIN)/pip
	$(BIN)/pip wheel --quiet --no-deps --wheel-dir dist .

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis dist build

FORCE:
