# dalle-lightning: the two commands of the quick start, plus helpers.
# `make demo` trains every stage on the embedded shapes world; `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Torch is installed first and pinned, so pip never pulls a newer (multi-GB) build by itself.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
OUT ?= outputs/demo

.PHONY: demo test test-fast install install-test bench dist clean

# Two distributions, both installed from the checkout: the plugins alone (strategies/pyproject.toml, import name
# dalle_lightning_plugins) and dalle-lightning (pyproject.toml), which depends on the first at the same version.
$(VENV)/.installed: pyproject.toml strategies/pyproject.toml strategies/VERSION
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ./strategies -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ./strategies -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(VENV)/bin/python -m dalle_lightning.demo out_dir=$(OUT)

# Two workers: files that start processes on one, the others on the other (tests/conftest.py, make_scheduler).
# The 15 slowest tests are listed at the end: the suite must stay well under 15 minutes on 2 cores.
test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow"

# Every benchmark script; files starting with _ are helpers they import (_peak.py, _two_hosts.py,
# _torch_powersgd_hook.py).
bench: $(VENV)/.installed
	for f in benchmarks/[!_]*.py; do $(PY) $$f; done

# An sdist of each distribution from a clean tree (the files git tracks or would track, none it ignores: no
# __pycache__, build/ or egg-info), then each wheel from its sdist (what `python -m build` does by default),
# all into dist/; twine checks the metadata of all four.
dist: $(VENV)/.installed-test
	rm -rf dist
	tree=$$(mktemp -d) && trap 'rm -rf "$$tree"' EXIT && \
	git ls-files -z --cached --others --exclude-standard \
	    | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$$tree" && \
	$(PY) -m build --outdir dist "$$tree/strategies" && \
	$(PY) -m build --outdir dist "$$tree"
	$(PY) -m twine check --strict dist/*

clean:
	rm -rf outputs multirun .pytest_cache dist
