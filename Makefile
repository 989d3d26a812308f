# `make demo` and `make test` create/update .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU wheel of torch; an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# trio-typing (a libp2p dependency) ships trio-stubs from an older trio; they shadow trio's own,
	# current inline types for mypy (no trio.TaskStatus). The runtime package trio_typing stays.
	rm -rf $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/trio-stubs
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m swarm.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/engine.py --json benchmarks/results/engine.json
	$(BIN)/python benchmarks/expert_rtt.py --json benchmarks/results/expert_rtt.json
	$(BIN)/python benchmarks/market.py --json benchmarks/results/market.json

lint: $(STAMP)
	$(BIN)/ruff check swarm coordinator volunteer relay market tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info
