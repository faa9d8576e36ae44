# One entry point for setting up and running ampkit.
#   make run    - create .venv if needed, install what the default run needs (.[data]), train it (digits CNN)
#   make test   - create .venv if needed, install with dev deps, run the test suite (2 workers, random order, slow tests skipped)
#   make test-slow - the tests marked slow, alone (CI runs them once)
#   make test-kinds - the tests marked machine_kind again with torch/oneDNN held to AVX2, then to plain AVX512
#   make test-compat - the tests that touch torch internals under every torch of the support window (COMPAT_KEEP=0: remove each venv after its run)
#   make test-ray - Ray Train's TorchTrainer test: installs the `ray` extra into the venv (once), then runs it
#   make dist-run - the default training on 2 CPU processes (torchrun, gloo, DDP); NPROC=N for more
#   make docs   - the docs/ pages and the API reference (mkdocs + mkdocstrings, the `docs` extra) into site/
# TORCH_SPEC selects the torch build; the default is the CPU wheel that lies on this
# machine's disk. CUDA users: make test TORCH_SPEC='torch>=2.11' (the support window: docs/INSTALL.md)
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ampkit-installed

.PHONY: run test test-slow test-kinds test-compat test-ray install bench bench-quick dist-run clean gpu-check docs docs-serve

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

# 2 workers (pytest-xdist): the suite is CPU-bound and most tests run one thread; PYTEST_WORKERS=0 runs it in
# one process. The tests marked slow are skipped here (make test-slow, or AMPKIT_SLOW=1 make test, runs them).
# A random order every run (pytest-randomly, the dev extra): the last line names the seed and how to replay it;
# PYTEST_ORDER='-p no:randomly' runs the files' order, PYTEST_ORDER='-p randomly --randomly-seed=N' replays one
PYTEST_WORKERS ?= 2
PYTEST_ORDER ?= -p randomly
test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ORDER)

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

# Ray Train (tests/integrations/test_ray_train.py: TorchTrainer, 2 CPU workers, a tiny model): the `ray` extra is
# not in dev (ray[train] with pyarrow), so this target installs it into the venv once (its own stamp) and runs
# the test alone; where ray is not installed that test skips, naming this target
RAY_STAMP := $(VENV)/.ampkit-ray-installed

$(RAY_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[ray]"
	touch $(RAY_STAMP)

test-ray: $(RAY_STAMP)
	$(PY) -m pytest --slow tests/integrations/test_ray_train.py

# The tests whose expectation depends on the CPU's kernels, as the AVX2 and the plain-AVX512 kinds would run
# them (.ci/kinds says which ISA each run really got: a setting lowers the ISA, never raises it)
test-kinds: $(STAMP)
	PY=$(PY) .ci/kinds

# The support window (docs/INSTALL.md): the floor (2.11: torchao 0.18's kernels) and the newest torch pip gives
# here, each in its own venv, built once and kept (.venv-torch2.11 ...; PyPI's default Linux wheels are CUDA
# builds: torch + its nvidia-* libraries, ~3 GB and ~5 min per version on a fresh machine; they import and run
# on a CPU-only machine). COMPAT_TORCH='2.11 2.12' picks others.
COMPAT_TORCH ?= 2.11 2.14
COMPAT_TESTS ?= tests/precision/test_compile_step.py tests/precision/test_compile_cudagraphs.py tests/optim/test_bitcast.py \
	tests/train/test_trainer_compile.py tests/precision/test_scaler_equivalence.py \
	tests/precision/test_scaler_torch_suite.py tests/precision/test_scaler_extras.py \
	tests/precision/test_scaler_counters.py tests/precision/test_sync_free.py \
	tests/precision/test_distributed_scaler.py tests/precision/test_fp8.py tests/precision/test_fp8_modes_of_use.py \
	tests/precision/test_mxfp8.py tests/precision/test_dcp_state_dict.py tests/train/test_fsdp_modes.py \
	tests/train/test_sharded_checkpoints.py tests/train/test_resume.py tests/faults/test_bad_checkpoints.py \
	tests/faults/test_unsafe_checkpoint.py tests/precision/test_nonfinite_policy.py tests/precision/test_step_without_backward.py

.venv-torch%/.ampkit-installed: pyproject.toml
	test -x .venv-torch$*/bin/python || $(PYTHON) -m venv .venv-torch$*
	.venv-torch$*/bin/python -m pip install -q "torch~=$*.0"
	.venv-torch$*/bin/python -m pip install -q -e ".[test-compat]" "torch~=$*.0"
	touch $@

# COMPAT_KEEP=0 (what CI sets) builds, runs and removes one venv at a time: each is ~5 GB, and a CI machine's disk
# may hold one beside .venv but not two
COMPAT_KEEP ?= 1
test-compat:
	@set -e; for v in $(COMPAT_TORCH); do \
		$(MAKE) --no-print-directory .venv-torch$$v/.ampkit-installed; \
		echo "== torch $$(.venv-torch$$v/bin/python -c 'import torch; print(torch.__version__)')"; \
		.venv-torch$$v/bin/python -m pytest -n $(PYTEST_WORKERS) $(COMPAT_TESTS); \
		if [ "$(COMPAT_KEEP)" = 0 ]; then rm -rf .venv-torch$$v; fi; done

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
	rm -rf $(VENV) build site *.egg-info  # the .venv-torch* of make test-compat are kept (rm -rf .venv-torch*)

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
