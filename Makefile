# minillm: `make run` sets up and generates text; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODELS := models/SmolLM2-135M-Instruct.Q4_1.gguf models/gemma-3-270m-q4_k_m.gguf
DEFAULT_MODEL := models/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: install install-dev models test test-fast bench bench-serve bench-speculative run gpu-check gpu-parts clean

# what a user runs (the CLI and its server), with the common architectures' CPU kernels compiled
# ahead (the others' compile on a model's first use)
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[server]'
	$(PY) -m minillm warm --all --common
	touch $@

# and what the tests and gpu-check need besides: pytest, OpenAI's client, numba-cuda, Ray Serve
install-dev: $(VENV)/.installed-dev

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[test,cuda,server,cluster]'
	touch $@

models: install
	$(PY) models/fetch.py

# two workers (a test file each) overlap the kernels' first compilation; OpenMP threads sleep
# rather than spin while they wait, as two workers share the cores
TEST_WORKERS ?= 2
test: install-dev models
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

test-fast: install-dev
	$(PY) -m pytest -q -m "not slow"

# LLAMA_BENCH=path/to/llama-bench (tests/llama_ref/build.sh builds it): llama.cpp measured beside us
bench: install models
	$(PY) -m minillm.cli.benchmarks $(MODELS) --out bench-results.json $(if $(LLAMA_BENCH),--llama-bench $(LLAMA_BENCH))

# LLAMA_SERVER=path/to/llama-server: the same HTTP load on llama-server, one after the other
bench-serve: install models
	$(PY) -m minillm.cli.bench_serve $(DEFAULT_MODEL) --out bench-serve.json $(if $(LLAMA_SERVER),--llama-server $(LLAMA_SERVER)) $(if $(DEVICE),--device $(DEVICE))

# LLAMA_BIN=folder of llama-lookup and llama-speculative-simple: llama.cpp on the same prompts
bench-speculative: install models
	$(PY) -m minillm.cli.bench_speculative --out bench-speculative.json $(if $(LLAMA_BIN),--llama-bin $(LLAMA_BIN))

# on a machine with an NVIDIA GPU: golden parity and speed on CUDA, then the CUDA tests for real
# GPU_CHECK_OUT=path: where the JSON report goes (rewritten after each stage)
# OFFLINE=1, on a GPU machine without network: the machine's own python3 and numba-cuda, the
# project installed editable without dependencies (wheels/*.whl first: gguf and pyyaml; into a
# system Python too, which PEP 668 would refuse); the real models are checked where models/ has
# them, or SMOLLM2_PARTS names `make gpu-parts`' pieces, which it joins first
GPU_CHECK_OUT ?= gpu-check.json
ifeq ($(OFFLINE),1)
gpu-check:
	$(if $(SMOLLM2_PARTS),cat $(SMOLLM2_PARTS) > $(DEFAULT_MODEL))
	PIP_BREAK_SYSTEM_PACKAGES=1 $(PYTHON) -m pip install --quiet --no-index --no-deps --no-build-isolation \
		$(wildcard wheels/*.whl) -e .
	@$(PYTHON) -c "import gguf" 2>/dev/null || { echo "gpu-check: the gguf package is missing (or its pyyaml): put their wheels in wheels/" >&2; exit 1; }
	$(PYTHON) -m minillm.cli.gpu_check --out $(GPU_CHECK_OUT)
else
gpu-check: install-dev models
	$(PY) -m minillm.cli.gpu_check --out $(GPU_CHECK_OUT)
endif

# SmolLM2 in two pieces under gpu-parts/, each small enough for one upload to a GPU machine
# without network (docs/performance.md: a piece a call, SMOLLM2_PARTS joins them there)
gpu-parts: models
	rm -rf gpu-parts && mkdir gpu-parts
	split -b 50000000 -d $(DEFAULT_MODEL) gpu-parts/smollm2.part

run: install models
	$(VENV)/bin/minillm generate $(DEFAULT_MODEL) --chat --temp 0 -n 64 -p "Write one sentence about the sea."

clean:
	rm -rf $(VENV) build *.egg-info
	find . -name __pycache__ -prune -exec rm -rf {} +
