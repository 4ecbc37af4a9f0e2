# Every target builds its own virtual environment on first use.
# make bench BENCH_ARGS="--repeat 5" measures five times and prints the range.
# torch is installed first, pinned, so that pip never pulls a CUDA build; override with
#   make test TORCH=torch==2.6.0
PYTHON ?= python3.11
TORCH ?= torch==2.13.0
VENV ?= .venv
BIN := $(VENV)/bin
export OMP_NUM_THREADS ?= 1

.PHONY: install test test-fast lint type example example-transformer bench bench-instructions clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev,examples,loggers]"
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

example: install
	$(BIN)/python examples/digits.py

example-transformer: install
	$(BIN)/python examples/char_transformer.py

bench: install
	$(BIN)/python benchmarks/overhead.py $(BENCH_ARGS)

# Instruction counts under valgrind (no timing noise; about 1.5 minutes per variant, two at
# a time: some 6 minutes for all five).
bench-instructions: install
	$(BIN)/python benchmarks/instructions.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
