# flowrl: `make demo` runs the main job, `make test` the tests; both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flowrl-installed

.PHONY: demo demo-video test test-heavy test-all test-slow bench bench-gpu gpu-check docs docs-serve setup clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	-$(PY) -m pip uninstall -q -y flowrl 2>/dev/null  # the distribution's name before it became flowrl-tree
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/flowrl train configs/tiny_default.yaml

demo-video: $(STAMP)
	$(VENV)/bin/flowrl train configs/tiny_video_default.yaml

# the quick suite, one pytest-xdist worker per core (each with its share of the torch threads); test-heavy the
# end-to-end, sharded, subprocess and site tests, in one process; test-all both in one run
test: $(STAMP)
	$(PY) -m pytest -q -n auto -m 'not slow and not gpu and not heavy'

test-heavy: $(STAMP)
	$(PY) -m pytest -q -m 'heavy and not slow and not gpu'

test-all: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(VENV)/bin/flowrl bench configs/tiny_flow_grpo.yaml

# on a CUDA machine: SD3.5-M and FLUX.1 layouts, update step and rollouts at 512 / 1024 px, with FLOPs and MFU
bench-gpu: $(STAMP)
	$(VENV)/bin/flowrl bench-gpu --out bench_gpu.json

# the one prepared check for a lent GPU (sized for 7 minutes on one H100 80 GB); `make gpu-check GPU_CHECK_ARGS=--tiny` on a CPU
GPU_CHECK_ARGS ?=
gpu-check: $(STAMP)
	$(VENV)/bin/flowrl gpu-check --out gpu_check_$$(date +%Y%m%d_%H%M%S) $(GPU_CHECK_ARGS)

# the documentation site (strict: a broken link or a missing page fails) into site/
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

clean:
	rm -rf runs compare .pytest_cache site site-shots build/docs-layout
