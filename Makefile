# The README's two commands: `make serve` and `make test`. Both set everything up on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTHON ?= python3

.PHONY: setup serve test bench clean

$(STAMP): pyproject.toml Makefile
	@echo "blink set-up (first run only): a virtual environment in $(VENV), then pip installs, about a minute"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "blink set-up: upgrading pip"
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: on these machines 2.13.0 is a local CPU build (a CUDA build is several GB)
	@echo "blink set-up: installing torch 2.13.0 (the CPU engine's)"
	$(PY) -m pip install -q torch==2.13.0
	@echo "blink set-up: installing blink and its dependencies (aiohttp, grpcio, tokenizers, transformers, pytest, ...)"
	$(PY) -m pip install -q -e '.[backend,gateway,test]'
	# Hugging Face's `kernels` (transformers >= 5.25 pulls it in) has our kernels/ package's import name: an earlier
	# set-up may have installed it into this environment (pyproject.toml, tests/test_installs.py)
	$(PY) -m pip uninstall -q -y kernels 2>/dev/null || true
	# fetch and import the demo model once (cached under $${BLINK_CACHE:-~/.cache/blink})
	@echo "blink set-up: fetching the demo model (SmolLM2-135M-Instruct, 93 MB) once"
	$(PY) -m blink.cli model demo
	touch $@

setup: $(STAMP)

serve: setup
	$(PY) -m blink.cli serve $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
