# Two entry points for a fresh clone: `make demo` (the main job) and `make test`.
# Each builds the environment on first use: uv (bootstrapped into .uv/ with pip) installs the
# locked dependencies (uv.lock) into .venv/ with the Python 3.12 that .python-version selects.

SHELL := /bin/bash
UV_VERSION := 0.13.9
UV := .uv/bin/uv
VENV := .venv
export UV_PYTHON_DOWNLOADS := never
export UV_PROJECT_ENVIRONMENT := $(VENV)

.PHONY: demo test bench env clean

env: $(VENV)/.synced

$(UV):
	python3 -m venv .uv
	.uv/bin/pip install --quiet uv==$(UV_VERSION)

$(VENV)/.synced: pyproject.toml uv.lock | $(UV)
	$(UV) sync --frozen --python 3.12
	touch $@

demo: $(VENV)/.synced
	$(VENV)/bin/nvtp demo

test: $(VENV)/.synced
	$(VENV)/bin/python -m pytest -q

bench: $(VENV)/.synced
	$(VENV)/bin/python -m pytest benchmarks -q

clean:
	rm -rf .uv $(VENV) .pytest_cache .benchmarks
