# One entry point for setting up and running ampkit.
#   make run    - create .venv if needed, install what the default run needs (.[data]), train it (digits CNN)
#   make test   - create .venv if needed, install with dev deps, run the test suite
#   make dist-run - the default training on 2 CPU processes (torchrun, gloo, DDP); NPROC=N for more
#   make docs   - the docs/ pages and the API reference (mkdocs + mkdocstrings, the `docs` extra) into site/
# TORCH_SPEC selects the torch build; the default is the CPU wheel that lies on this
# machine's disk. CUDA users: make test TORCH_SPEC='torch>=2.4'
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ampkit-installed

.PHONY: run test install bench bench-quick dist-run clean gpu-check docs docs-serve

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	# fastai's core without torchvision/spacy (its metadata pulls both; the `clients` extra holds the rest)
	$(PY) -m pip install -q --no-deps "fastai>=2.8,<2.9"
	touch $(STAMP)

install: $(STAMP)

# make run needs only ampkit and its data extra (scikit-learn: the digits set), not the dev toolchain
RUN_STAMP := $(VENV)/.ampkit-run-installed

$(RUN_STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[data]"
	touch $(RUN_STAMP)

run: $(RUN_STAMP)
	$(VENV)/bin/ampkit train

test: $(STAMP)
	$(PY) -m pytest

NPROC ?= 2
dist-run: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) -m ampkit train --no-progress

bench-quick: $(STAMP)
	$(VENV)/bin/ampkit bench --quick

bench: $(STAMP)
	$(VENV)/bin/ampkit bench

DOCS_STAMP := $(VENV)/.ampkit-docs-installed

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(PY) -m mkdocs build --clean

docs-serve: $(DOCS_STAMP)
	$(PY) -m mkdocs serve

clean:
	rm -rf $(VENV) build site *.egg-info

# On a CUDA machine: install a CUDA torch first, e.g.
#   make gpu-check TORCH_SPEC='torch --index-url https://download.pytorch.org/whl/cu126'
# Fits a 15-minute lease: each part under 90 s (GPU_CHECK_PART_BUDGET), the whole under 480 s
# (GPU_CHECK_TOTAL_BUDGET), most important first: every mode's steps under sync debug "error", HF Llama and
# GPT-2 vs plain loops and peers, compiled ampkit fp8 vs torchao fp8 vs bf16, the fp8 filter, the memory plan,
# FSDP2 + sharded checkpoint, bench --paired, fp8 vs bf16 and MFU on GPT-2 124M, the CUDA test files
# (GPU_CHECK_ARGS='--suite full': all) last; writes benchmarks/gpu-check-<device>-<time>/, one table at the end.
# Without CUDA it runs the CPU smoke (tiny sizes, CUDA-only parts skipped with the reason).
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)
