# Two commands for a fresh machine: `make demo` and `make test`.
# Both create .venv on first use and reuse it after.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-fast lint format install bench clean

$(STAMP): pyproject.toml setup.py src/gpt2lab/inference/_gemv.c constraints.txt
	@echo "Installing gpt2lab, torch (CPU) and the test tools into $(VENV): once, a few minutes on a first run (pip is quiet meanwhile)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m gpt2lab demo

# Two pytest workers of one thread each: most tests are single-threaded Python or launch their
# own processes, so two workers keep two cores busy where one worker left one idle.
# tests/unit (in-process) and tests/e2e (whatever starts a process), without the tests marked slow
# (torchrun ranks against one process, kill -9 and resume, the demos, the GPU script's smoke run,
# lm-eval end to end): those are `make test-slow`, which CI runs after this.
test: $(STAMP) lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -x -n 2 -m "not slow" --durations=15 tests/unit tests/e2e

test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -x -n 2 -m slow --durations=15 tests/unit tests/e2e

# ruff: the lint rules and the format pyproject.toml sets, checked (`make format` applies them).
lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks

format: $(STAMP)
	$(PY) -m ruff check --fix src tests benchmarks
	$(PY) -m ruff format src tests benchmarks

# The fast lane: the in-process tests only.
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -x -n 2 tests/unit

clean:
	rm -rf $(VENV) runs data build *.egg-info
