# The README's two commands: `make serve` and `make test`. Both set everything up on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTHON ?= python3

.PHONY: setup serve test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: on these machines 2.13.0 is a local CPU build (a CUDA build is several GB)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[backend,gateway,test]'
	# fetch and import the demo model once (cached under $${BLINK_CACHE:-~/.cache/blink})
	$(PY) -m blink.cli model demo
	touch $@

setup: $(STAMP)

serve: setup
	$(PY) -m blink.cli serve $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
