# dtrain: `make run` trains the main pipeline on the embedded cluster; `make test` runs the tests;
# `make docs` builds the documentation site (docs/, mkdocs.yml) into build/site with --strict.
# Both create the virtual environment when it is missing. Without an NVIDIA GPU the CPU build
# of torch is installed (constraints-cpu.txt), so no multi-GB CUDA download happens.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dtrain-installed
PIPELINE ?= pipelines/digits_async.yaml
PYTEST_ARGS ?=
# The suite runs on this many pytest-xdist workers (many tests wait on real processes, so two
# finish in about 60% of the time on two cores); TEST_WORKERS=0 runs it in this one process.
# The lab tests share one worker (their xdist_group): they share one lab cluster.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

.PHONY: venv chromium run test test-fast test-slow lint docs bench bench-dashboard bench-rec-env bench-rec clean

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

# The browser test (tests/observe/test_page_browser.py, marker `browser`) opens the dashboard page
# in Debian's chromium: installed here where it is missing and this user may (root, apt-get);
# elsewhere the test skips and says how to install it (CI sets DTRAIN_REQUIRE_BROWSER=1: it fails).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			DEBIAN_FRONTEND=noninteractive apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
		else echo "no chromium: the browser test skips (apt-get install -y chromium)"; fi; }

test: $(STAMP) chromium
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# The suite in two tiers (README, Development): `make test` runs both, as CI does.
FAST := not processes and not slow and not lab and not browser

test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "$(FAST)" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "not ($(FAST))" $(PYTEST_ARGS)

# ruff, then mypy over dtrain/ (its configuration: [tool.mypy] in pyproject.toml; docs/development.md).
lint: $(STAMP)
	$(VENV)/bin/ruff check dtrain tests benchmarks examples
	$(VENV)/bin/mypy

# The site's tools are the `docs` extra, installed here when missing (never a main dependency).
# The pipeline reference (docs/reference.md) must equal its generator's output; any MkDocs warning
# (a broken link or anchor, a page left out of the nav) fails the build.
docs: $(STAMP)
	$(PY) -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null || $(PY) -m pip install -q -e '.[docs]'
	$(PY) docs/gen_reference.py --check
	$(PY) docs/gen_results.py --check
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d build/site

bench: $(STAMP)
	$(PY) benchmarks/bench.py

bench-dashboard: $(STAMP) chromium
	$(PY) benchmarks/dashboard_cost.py

# The recommendation benchmark's peers (TorchRec on CPU) in their own environment, never dtrain's:
# benchmarks/rec/requirements-peers*.txt say which versions and why torchrec goes in with --no-deps.
PEERS_VENV ?= .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.peers-installed
REC_REQS := benchmarks/rec/requirements-peers.txt benchmarks/rec/requirements-peers-nodeps.txt

bench-rec-env: $(PEERS_STAMP)

$(PEERS_STAMP): $(REC_REQS) constraints-cpu.txt
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install -q -c constraints-cpu.txt torch
	$(PEERS_VENV)/bin/python -m pip install -q -c constraints-cpu.txt -r benchmarks/rec/requirements-peers.txt
	$(PEERS_VENV)/bin/python -m pip install -q --no-deps -r benchmarks/rec/requirements-peers-nodeps.txt
	$(PEERS_VENV)/bin/python -c "import torchrec, fbgemm_gpu; print('torchrec', torchrec.__version__, 'on torch', __import__('torch').__version__)"
	touch $(PEERS_STAMP)

bench-rec: $(STAMP)
	$(PY) benchmarks/rec_bench.py

clean:
	rm -rf $(VENV) $(PEERS_VENV) runs build *.egg-info .pytest_cache
