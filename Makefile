# Two entry points on a fresh machine: `make demo` (loom and the demo's extra only) and `make test` (adds the
# test, Ray, Spark and documentation dependencies). Each creates .venv and installs what it lacks first: one
# stamp per layer, so `make test` after `make demo` installs only the rest.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
# The demo's layer skips pip's byte-compilation of every installed module (torch alone has thousands; it was
# the largest part of the install's CPU time): Python compiles what the demo imports as it runs. The test layer
# compiles everything, since the tests start hundreds of processes that import torch.
SITE = $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test test-fast test-gpu lint docs bench install clean

# torch first, by its exact version: the CPU build on this machine's disk (a range would let pip take a CUDA build).
$(DEMO_STAMP): pyproject.toml requirements/demo.lock
	python3 -m venv $(VENV)
	$(PIP) --no-compile torch==2.13.0
	$(PIP) --no-compile -r requirements/demo.lock
	$(PIP) --no-deps -e .
	touch $(DEMO_STAMP)

$(TEST_STAMP): $(DEMO_STAMP) requirements/test.lock
	$(PIP) -r requirements/test.lock
	@# .pyc files only speed imports up: a file that does not compile is one pip's own compilation skips too.
	$(PY) -m compileall -q -j 0 $(SITE) > /dev/null || true
	touch $(TEST_STAMP)

install: $(TEST_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/loom demo

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --ignore-missing-imports src/loom src/loom_bench

# The documentation site, strict: a broken link, reference or docstring cross-reference fails the build.
docs: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

# pytest runs on two xdist workers, a file at a time (`--dist loadfile`; tests/conftest.py keeps the Ray and Spark
# files on one worker, hands the longest files out first by tests/file_seconds.json, and gives each worker its own
# range of ports): 11 min 46 s against 17 min 43 s serially
# (with the 17 waiting tests beside, the run before), now that `loom run`'s workers fork from a zygote and most
# tests' processes no longer fill both cores importing torch (before the zygote, two workers gained ~4%). Tests
# marked `alone` compare a time with a bound and run last, with nothing beside them.
test: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --ignore-missing-imports src/loom src/loom_bench
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site
	@# loom's and the tests' own .pyc files, once: where PYTHONDONTWRITEBYTECODE is set, every worker process
	@# would otherwise compile the loom modules it imports again.
	$(PY) -m compileall -q -j 0 src tests > /dev/null
	$(VENV)/bin/pytest -n 2 --dist loadfile -m "not alone"
	$(VENV)/bin/pytest -p no:xdist -m alone

# The fast lane: the tests marked `unit` (one process, no subprocess; ranks as threads on explicit gloo groups,
# tests/threads.py), under 3 minutes on the 2-core host. `make test` above, the CI gate, runs every lane.
test-fast: $(TEST_STAMP)
	$(VENV)/bin/pytest -m unit -q

# The GPU lane (tests marked `gpu`; skipped, and reported as skipped, without CUDA): on a GPU machine. A lent
# machine without this venv runs benchmarks/device/gpu_lane.sh instead (the same tests, the step benchmark).
test-gpu: $(TEST_STAMP)
	$(VENV)/bin/pytest -p no:xdist -m gpu -v -rs

bench: $(TEST_STAMP)
	$(VENV)/bin/loom bench dp

clean:
	rm -rf $(VENV) build src/*.egg-info
