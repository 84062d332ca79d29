# The two commands a new machine needs: `make serve` (serve the default model over HTTP)
# and `make test` (the whole CPU test suite). Both set up the virtualenv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
TANDEM := $(VENV)/bin/tandem
# the CPU build of torch; on a machine with a GPU, set TORCH_SPEC to the build you want
TORCH_SPEC ?= torch==2.13.0
# the Triton the kernels are written for (the GPU machine's); tests run it interpreted on the CPU
TRITON_SPEC ?= triton==3.6.0
PROMPT ?= What is the capital of France?
# `make serve PORT=9000 HOST=0.0.0.0 MODEL=qwen2.5-coder-0.5b-instruct`
PORT ?= 8000
HOST ?= 127.0.0.1
MODEL ?= smollm2-135m-instruct

.PHONY: install test lint run serve bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH_SPEC)' '$(TRITON_SPEC)'
	$(PY) -m pip install -q -e '.[dev,triton]'
	touch $@

# two pytest-xdist workers, a test file each at a time (tests/xdist_scheduling.py); a plain
# `pytest` runs in one process (the GPU machine has no xdist)
test: install
	$(PY) -m pytest -m "not gpu" -q -n 2

lint: install
	$(VENV)/bin/ruff check cluster workers router kvstore tests tools
	$(VENV)/bin/mypy

run: install
	$(TANDEM) generate --chat --prompt "$(PROMPT)" --max-tokens 64

serve: install
	$(TANDEM) serve --model '$(MODEL)' --host '$(HOST)' --port '$(PORT)'

bench: install
	$(TANDEM) bench throughput --model smollm2-135m-instruct --num-requests 32 --min-len 100 \
	  --max-len 512 --hf-batch-sizes 8,32 --hf-max-new-tokens 128 --hf-batch-requests 0

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
