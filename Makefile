# Two entry points on a fresh machine: `make demo` (loom and the demo's extra only) and `make test` (adds the
# test, Ray, Spark and documentation dependencies). Each creates .venv and installs what it lacks first: one
# stamp per layer, so `make test` after `make demo` installs only the rest.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test lint docs bench install clean

# torch first, by its exact version: the CPU build on this machine's disk (a range would let pip take a CUDA build).
$(DEMO_STAMP): pyproject.toml requirements/demo.lock
	python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -r requirements/demo.lock
	$(PIP) --no-deps -e .
	touch $(DEMO_STAMP)

$(TEST_STAMP): $(DEMO_STAMP) requirements/test.lock
	$(PIP) -r requirements/test.lock
	touch $(TEST_STAMP)

install: $(TEST_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/loom demo

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --ignore-missing-imports src/loom

# The documentation site, strict: a broken link, reference or docstring cross-reference fails the build.
docs: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

test: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --ignore-missing-imports src/loom
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site
	$(VENV)/bin/pytest

bench: $(TEST_STAMP)
	$(VENV)/bin/loom bench dp

clean:
	rm -rf $(VENV) build src/*.egg-info
