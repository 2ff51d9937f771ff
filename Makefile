# dtrain: `make run` trains the main pipeline on the embedded cluster; `make test` runs the tests.
# Both create the virtual environment when it is missing. Without an NVIDIA GPU the CPU build
# of torch is installed (constraints-cpu.txt), so no multi-GB CUDA download happens.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dtrain-installed
PIPELINE ?= pipelines/digits_async.yaml
PYTEST_ARGS ?=

.PHONY: venv run test lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q -e '.[test]'; \
	else \
		$(PY) -m pip install -q -c constraints-cpu.txt 'torch' && \
		$(PY) -m pip install -q -c constraints-cpu.txt -e '.[test]'; \
	fi
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/dtrain run $(PIPELINE)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check dtrain tests benchmarks examples

bench: $(STAMP)
	$(PY) benchmarks/bench.py

clean:
	rm -rf $(VENV) runs build *.egg-info .pytest_cache
