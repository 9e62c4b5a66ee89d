# voxtral_mlx developer commands. `make install` creates .venv; the other targets use it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
UNAME_S := $(shell uname -s)

# The test-only torch reference (it writes real .pt files). On Linux it should be the CPU
# build: PyPI's Linux torch brings gigabytes of CUDA. The CI machines' package index holds
# 2.13.0+cpu; elsewhere: make install TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
ifeq ($(UNAME_S),Linux)
TORCH_SPEC := torch==2.13.0
else
TORCH_SPEC := torch>=2.4
endif
TORCH_PIP_ARGS ?=
# Test processes (pytest-xdist): one per CPU; TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= auto

.PHONY: install test lint format bench bench-full bench-openblas demo clean

STAMP := $(VENV)/.installed

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check voxtral_mlx tests benchmarks convert
	$(PY) -m pytest -q -n $(TEST_WORKERS)

lint: $(STAMP)
	$(PY) -m ruff check voxtral_mlx tests benchmarks convert
	$(PY) -m ruff format --check voxtral_mlx tests benchmarks convert

format: $(STAMP)
	$(PY) -m ruff format voxtral_mlx tests benchmarks convert
	$(PY) -m ruff check --fix voxtral_mlx tests benchmarks convert

bench: $(STAMP)
	$(PY) benchmarks/run.py $(if $(MODEL),--model "$(MODEL)",--quick) $(if $(NO_RECORD),--no-record)

bench-full: $(STAMP)
	$(PY) benchmarks/run.py --full

bench-openblas: $(STAMP)
	$(PY) benchmarks/run.py --openblas

# Try the main job on a random checkpoint (the real 8 GB download is not needed).
demo: $(STAMP)
	$(VENV)/bin/voxtral-mlx random-checkpoint /tmp/voxtral-tiny --size tiny --force
	$(VENV)/bin/voxtral-mlx speak -m /tmp/voxtral-tiny "Hello from Voxtral." -o /tmp/voxtral-hello.wav --verbose

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
