# Two entry points on a fresh machine: `make demo` and `make test`. Each creates .venv and installs first.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench install clean

$(STAMP): pyproject.toml requirements.lock
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/loom demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --ignore-missing-imports src/loom

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --ignore-missing-imports src/loom
	$(VENV)/bin/pytest

bench: $(STAMP)
	$(VENV)/bin/loom bench dp

clean:
	rm -rf $(VENV) build src/*.egg-info
