# `make demo` and `make test` create/update .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# ggml's CPU kernels (swarm/model/kernels/ggml.py), built portable: x86-64-v3 (AVX2, FMA, F16C, BMI2)
# on every CPU that has it, so most home machines share one kernel id; no llamafile sgemm and no
# BLAS, whose n=1 and n>=2 paths differ (kernels must be batch-invariant); no OpenMP (it would share
# libgomp with torch). GGML_NATIVE=1 make venv opts into a -march=native build of this machine.
GGML_NATIVE ?= 0
GGML_CMAKE_ARGS := -DGGML_NATIVE=$(if $(filter 1,$(GGML_NATIVE)),ON,OFF) -DGGML_CPU_ALL_VARIANTS=OFF \
	-DGGML_BACKEND_DL=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON \
	-DGGML_F16C=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF \
	-DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_LLAMAFILE=OFF \
	-DGGML_CPU_REPACK=OFF -DGGML_CPU_KLEIDIAI=OFF -DGGML_OPENMP=OFF -DGGML_BLAS=OFF -DGGML_CUDA=OFF \
	-DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_RPC=OFF -DGGML_CCACHE=OFF -DGGML_BUILD_TESTS=OFF \
	-DGGML_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release

.PHONY: demo test bench lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU wheel of torch; an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	# ggml-python from source with the flags above; --no-cache-dir: pip's wheel cache ignores CMAKE_ARGS
	$(BIN)/python -m pip install -q numpy typing_extensions
	CMAKE_ARGS="$(GGML_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/python -m pip install -q --no-cache-dir \
		--force-reinstall --no-deps --no-binary ggml-python ggml-python==0.0.45
	$(BIN)/python -m pip install -q -e '.[dev]'
	# trio-typing (a libp2p dependency) ships trio-stubs from an older trio; they shadow trio's own,
	# current inline types for mypy (no trio.TaskStatus). The runtime package trio_typing stays.
	rm -rf $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/trio-stubs
	touch $(STAMP)

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
	$(BIN)/ruff check swarm coordinator volunteer relay market tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info
