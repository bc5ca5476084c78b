# The two commands of README.md: `make demo` and `make test`. Both install
# what is missing (never replacing an installed torch), build without build
# isolation against the installed torch, and work offline once torch is there.

PYTHON ?= python3
PIP := $(PYTHON) -m pip
# The torch to install where none is (CPU machines); the GPU machines bring their own.
TORCH_PIN ?= torch==2.14.1
# Libraries whose models the tests run graphed on (optional for users); the
# torchvision that matches TORCH_PIN, the transformers the GPU machine has.
MODEL_LIBRARIES ?= transformers==5.17.0 timm torchvision==0.29.1
# The frameworks graphed.integrations adapts (lightning and accelerate as on the
# GPU machine; TRL, which the GPU machine lacks, travels there as wheels), for
# the CPU tier's tests of the callbacks' argument handling and fallbacks.
FRAMEWORKS ?= lightning==2.6.6 accelerate trl==1.16.0 datasets
BUILD_DIR := build/py
PIP_BUILD := $(PIP) install --no-build-isolation --no-deps -C build-dir=$(BUILD_DIR)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test deps deps-build deps-test install install-demo test-cpp test-python clean

# `make demo` needs only torch and the build tools, and builds no tests; the
# model libraries, the frameworks and GoogleTest come with `make test`.
demo: install-demo
	$(PYTHON) -m graphed demo

test: install
	$(MAKE) --no-print-directory test-cpp test-python

deps-build:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_PIN)"
	@$(PYTHON) -c "import scikit_build_core" 2>/dev/null || $(PIP) install "scikit-build-core>=0.10"
	@command -v cmake >/dev/null && command -v ninja >/dev/null || $(PIP) install cmake ninja

deps-test: deps-build
	@$(PYTHON) -c "import pytest, numpy, hypothesis" 2>/dev/null || \
		$(PIP) install pytest numpy hypothesis
	@$(PYTHON) -c "import transformers, timm, torchvision" 2>/dev/null || \
		$(PIP) install $(MODEL_LIBRARIES)
	@$(PYTHON) -c "import lightning, accelerate, trl, datasets" 2>/dev/null || \
		$(PIP) install $(FRAMEWORKS) "$$($(PYTHON) -c 'import torch; print("torch==" + torch.__version__.split("+")[0])')"
	@[ -f /usr/src/googletest/CMakeLists.txt ] || [ -n "$$GRAPHED_GTEST_SOURCE_DIR" ] || \
		$(SUDO) apt-get install -y -q libgtest-dev >/dev/null || \
		echo "graphed: GoogleTest not installed (apt-get install libgtest-dev); C++ tests will be skipped."

deps: deps-test

install-demo: deps-build
	$(PIP_BUILD) -C cmake.define.GRAPHED_BUILD_TESTS=OFF .

install: deps-test
	$(PIP_BUILD) -C cmake.define.GRAPHED_BUILD_TESTS=ON \
		$(if $(GRAPHED_GTEST_SOURCE_DIR),-C cmake.define.GRAPHED_GTEST_SOURCE_DIR=$(GRAPHED_GTEST_SOURCE_DIR)) .

test-cpp:
	@echo "C++ tests in suites named *OnGpu need an NVIDIA GPU; without one they are listed as Skipped."
	ctest --test-dir $(BUILD_DIR) --output-on-failure $(CTEST_ARGS)

test-python:
	$(PYTHON) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf build
