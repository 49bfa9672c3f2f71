# Two entry points (see README): `make demo` and `make test`. Both set up .venv first.
# torch and torchvision are installed on their own, pinned, before the package, so pip never resolves another torch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PINS := torch==2.14.1 torchvision==0.29.1

.PHONY: setup demo test test-kernels test-gpu clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PINS)
	$(PY) -m pip install -q -e '.[test]' $(TORCH_PINS)
	touch $@

demo: setup
	$(VENV)/bin/opfuse analyze resnet50 --batch 64

# the default run leaves out the tests marked slow (about 5 minutes on 2 cores: README.md); CI runs every test
# without a GPU (about 20 minutes): make test TEST_MARKERS="not gpu"
TEST_MARKERS ?= not gpu and not slow

test: setup
	$(PY) -m pytest -q -m "$(TEST_MARKERS)"

# on a GPU machine (through the device tool): PYTHONPATH=. python3 -m pytest -m gpu tests/gpu
test-gpu:
	OPFUSE_GPU_TESTS=1 PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu

clean:
	rm -rf $(VENV) .pytest_cache
