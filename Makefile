# All set-up happens here: `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch; override for a CUDA machine, e.g. TORCH_SPEC="torch==2.13.0".
TORCH_SPEC ?= torch==2.13.0
PORT ?= 8080

.PHONY: install serve test test-xla lint format bench bench-gpu gpu-check gpu-wheels soak demo-model clean grpc-stubs

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/tgis serve --port $(PORT)

# In a new random order each run (pytest-randomly, which prints "Using --randomly-seed=N" first);
# `$(PY) -m pytest -q --randomly-seed=N` replays an order, `-p no:randomly` turns it off. A worker
# per core (pytest-xdist), each kept to its own cores (tests/conftest.py); a worker takes the next
# test when it is free. TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= auto
test: install
	$(PY) -m pytest -q -p randomly -n $(TEST_WORKERS) --dist worksteal

# The tpu backend on XLA:CPU (PJRT_DEVICE=CPU): torch-xla 2.9.0 pins torch 2.9.0, so it has a
# virtualenv of its own. PyPI's torch 2.9.0 is the CUDA build (its libraries run on the CPU).
XLA_VENV ?= .venv-xla
$(XLA_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/python -m pip install -q --upgrade pip
	$(XLA_VENV)/bin/python -m pip install -q "torch==2.9.0" "torch-xla==2.9.0"
	$(XLA_VENV)/bin/python -m pip install -q -e . pytest pytest-timeout
	touch $@

test-xla: $(XLA_VENV)/.installed
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -q tests_xla

lint: install
	$(VENV)/bin/ruff check tgis tests tests_xla scripts
	$(VENV)/bin/ruff format --check tgis tests tests_xla scripts
	$(VENV)/bin/hadolint Dockerfile.cuda Dockerfile.neuron Dockerfile.tpu Dockerfile.gaudi
	$(PY) scripts/check_deploy.py

# The gRPC stubs of TGIS's API, checked in (tests/fmaas/test_stubs.py fails when they are stale).
grpc-stubs: install
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. tgis/fmaas/generation.proto

format: install
	$(VENV)/bin/ruff format tgis tests tests_xla scripts
	$(VENV)/bin/ruff check --fix tgis tests tests_xla scripts

# tgis serve vs transformers serve --continuous-batching on a SmolLM2-135M-shaped model.
# The peer lives in its own virtualenv: transformers 4.57's continuous batching cannot size its
# KV cache on a CPU, 5.x's can (and 5.x would not fit tgis's own pins).
.venv-peer/.installed:
	$(PYTHON) -m venv .venv-peer
	.venv-peer/bin/pip install -q "$(TORCH_SPEC)" "transformers[serving]>=5"
	touch $@

# With LLAMA_SERVER (llama.cpp's llama-server, built outside this repository) and the two
# models converted to f32 GGUF by llama.cpp's convert_hf_to_gguf.py (DEMO_GGUF, SMOL_GGUF), the
# runtime's targets against llama.cpp are measured too (scripts/bench_llamacpp.py).
bench: install .venv-peer/.installed
	$(PY) scripts/bench_serve.py --workdir $(or $(BENCH_DIR),/tmp/tgis-bench) --output bench-results.json
	$(VENV)/bin/tgis benchmark --engine --model-id $(or $(BENCH_DIR),/tmp/tgis-bench)/smollm2-135m-random \
		--batch-sizes 1,4,16,32 --prompt-tokens 100 --decode-tokens 16 --runs 3 \
		--output bench-engine.json --plot bench-engine.png
	$(if $(LLAMA_SERVER),$(PY) scripts/bench_llamacpp.py --llama-server $(LLAMA_SERVER) \
		--demo-gguf $(DEMO_GGUF) --smol-gguf $(SMOL_GGUF) \
		--workdir $(or $(BENCH_DIR),/tmp/tgis-bench) --output bench-llamacpp.json)

# Two minutes of `tgis serve` at 2x its request limit: none lost or hung, the excess answered 429.
soak: install
	$(PY) scripts/soak.py --output soak-results.json

# On a CUDA machine: Llama-3.2-1B- and Llama-3.1-8B-shaped random models served in bf16 at 1, 16
# and 64 streams, with CUDA graphs and eager; the table goes to docs/performance.md.
bench-gpu: install
	$(PY) scripts/bench_gpu.py --workdir $(or $(BENCH_DIR),/tmp/tgis-bench-gpu)

# On a machine with an NVIDIA GPU, with its own Python and CUDA torch (no virtualenv), in one
# command of at most 8 minutes (GPU_CHECK_ARGS="--budget S" changes that): the probe, the CUDA
# tests, the attention kernels' bandwidth, a profile of one decode step and bench-gpu's loads,
# each stage within its time, into GPU_CHECK_DIR (at most 8 files: probe.json, tests.log,
# tests.json, kernels.json, profile.txt, bench.json, summary.md) and the tables into
# docs/performance.md. STAGE=probe, tests, kernels, profile, bench or docs
# runs one (GPU_CHECK_ARGS="--loads 8b:graphs" narrows bench); `make gpu-check STAGE=docs
# GPU_CHECK_DIR=<the folder fetched back>` writes the table where the repository lives. Without a
# package index there, `make gpu-wheels` (here) fetches into .whl/ the wheels of what tgis needs
# at run time and that machine's image lacks (GPU_IMAGE: its package list, scripts/gpu_image.txt
# or a probe.json from it); each stage installs them into a private folder first.
GPU_PYTHON ?= python3
GPU_CHECK_DIR ?= gpu-check
GPU_IMAGE ?= scripts/gpu_image.txt
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py $(or $(STAGE),all) --out $(GPU_CHECK_DIR) $(GPU_CHECK_ARGS)

gpu-wheels: install
	$(PY) scripts/gpu_check.py wheels --wheels .whl --image $(GPU_IMAGE)

# Re-train the bundled demo model (about 20 minutes on 2 cores).
demo-model: install
	$(PY) scripts/train_demo_model.py --output tgis/assets/demo-model

clean:
	rm -rf $(VENV) $(XLA_VENV) .pytest_cache .ruff_cache build *.egg-info
