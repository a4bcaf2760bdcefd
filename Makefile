# Two entry points for a fresh clone: `make demo` (the main job) and `make test`.
# Each builds the environment on first use: uv (bootstrapped into .uv/ with pip) installs the
# locked dependencies (uv.lock) into .venv/ with the Python 3.12 that .python-version selects.

SHELL := /bin/bash
UV_VERSION := 0.13.9
UV := .uv/bin/uv
VENV := .venv
export UV_PYTHON_DOWNLOADS := never
export UV_PROJECT_ENVIRONMENT := $(VENV)

.PHONY: demo test test-all bench env clean

env: $(VENV)/.synced

$(UV):
	python3 -m venv .uv
	.uv/bin/pip install --quiet uv==$(UV_VERSION)

# --compile-bytecode: the venv holds its .pyc files, so a fresh process does not compile torch,
# transformers and Thunder from source first (this machine's environment sets
# PYTHONDONTWRITEBYTECODE=1, so nothing would ever write them): about 9 s of every `nvtp explain`.
$(VENV)/.synced: pyproject.toml uv.lock | $(UV)
	$(UV) sync --frozen --python 3.12 --compile-bytecode
	touch $@

demo: $(VENV)/.synced
	$(VENV)/bin/nvtp demo

# The default tier (what CI runs): every feature, in-process or on small gloo meshes. The slow
# tier (@pytest.mark.slow: multi-process training, torchrun, checkpoints, the other transformers
# families) runs with `make test-all`.
# Two pytest workers (pytest-xdist), each a whole file at a time (--dist loadfile: a file's
# module-scoped fixtures are made once): the tests are single-threaded Python (Thunder's
# interpreter) and this machine has 2 cores.
test: $(VENV)/.synced
	$(VENV)/bin/python -m pytest -q -m "not slow" -n 2 --dist loadfile

test-all: $(VENV)/.synced
	$(VENV)/bin/python -m pytest -q

bench: $(VENV)/.synced
	$(VENV)/bin/python -m pytest benchmarks -q

clean:
	rm -rf .uv $(VENV) .pytest_cache .benchmarks
