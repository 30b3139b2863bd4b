# Two commands for a fresh machine: `make demo` and `make test`.
# Both create .venv on first use and reuse it after.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m gpt2lab demo

test: $(STAMP)
	$(PY) -m pytest -q -x --durations=15

clean:
	rm -rf $(VENV) runs data build *.egg-info
