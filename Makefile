# `make demo` and `make test` create/update .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# ggml's CPU kernels (swarm/model/kernels/ggml.py), built portable: x86-64-v3 (AVX2, FMA, F16C, BMI2)
# on every CPU that has it, so most home machines share one kernel id; no llamafile sgemm and no
# BLAS, whose n=1 and n>=2 paths differ (kernels must be batch-invariant); no OpenMP (it would share
# libgomp with torch). GGML_NATIVE=1 make venv opts into a -march=native build of this machine.
# The flags live in ops/ggml-cmake-args, so `CMAKE_ARGS="$(cat ops/ggml-cmake-args)" pip install .`
# (README, Install) builds the same library without make.
GGML_NATIVE ?= 0
GGML_CMAKE_ARGS := $(subst -DGGML_NATIVE=OFF,-DGGML_NATIVE=$(if $(filter 1,$(GGML_NATIVE)),ON,OFF),$(shell cat ops/ggml-cmake-args))

.PHONY: demo test bench lint venv clean

venv: $(STAMP)

# Prerequisites first (ops/check-prereqs.sh names a missing one with its Debian package), then each
# step says what it does; pip shows its progress (no -q on the long steps) and the ggml build its
# compile steps and how long it took.
$(STAMP): pyproject.toml Makefile ops/ggml-cmake-args ops/check-prereqs.sh
	@PY=$(PY) GGML_NATIVE=$(GGML_NATIVE) sh ops/check-prereqs.sh
	@echo "==> virtualenv $(VENV) ($(PY))"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@echo "==> torch 2.13.0, the CPU wheel (an unpinned torch would pull a multi-GB CUDA build)"
	$(BIN)/python -m pip install torch==2.13.0
	@echo "==> numpy and typing_extensions (ggml-python's own dependencies)"
	$(BIN)/python -m pip install numpy typing_extensions
	@echo "==> ggml-python 0.0.45 from source with ops/ggml-cmake-args (3-5 minutes on 2 cores)"
	@# --no-cache-dir: pip's wheel cache ignores CMAKE_ARGS
	@start=$$(date +%s) && \
	CMAKE_ARGS="$(GGML_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/python -m pip install -v --no-cache-dir \
		--force-reinstall --no-deps --no-binary ggml-python ggml-python==0.0.45 && \
	echo "==> ggml-python built in $$(( $$(date +%s) - start )) s"
	@echo "==> moe-swarm (editable) and its development tools"
	$(BIN)/python -m pip install -e '.[dev]'
	# trio-typing (a libp2p dependency) ships trio-stubs from an older trio; they shadow trio's own,
	# current inline types for mypy (no trio.TaskStatus). The runtime package trio_typing stays.
	rm -rf $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/trio-stubs
	touch $(STAMP)
	@echo "==> $(VENV) ready: $(BIN)/moe-swarm --help"

demo: $(STAMP)
	KEEP=$(KEEP) $(BIN)/python -m swarm.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/engine.py --json benchmarks/results/engine.json
	$(BIN)/python benchmarks/expert_rtt.py --json benchmarks/results/expert_rtt.json
	$(BIN)/python benchmarks/market.py --json benchmarks/results/market.json
	$(BIN)/python benchmarks/offload.py --json benchmarks/results/offload.json

lint: $(STAMP)
	$(BIN)/ruff check swarm coordinator volunteer relay market gateway sim tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info
