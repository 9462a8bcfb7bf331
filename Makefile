# dalle-lightning: the two commands of the quick start, plus helpers.
# `make demo` trains every stage on the embedded shapes world; `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Torch is installed first and pinned, so pip never pulls a newer (multi-GB) build by itself.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
OUT ?= outputs/demo

# The oldest torch both distributions support (strategies/pyproject.toml says why 2.9 is the floor), in a second
# environment: `make test-oldest` runs the plugin and model tests there (OLDEST_TESTS), the rest installed as for
# the newest (pip keeps this torch: it is inside both distributions' ranges). Its wheel and CUDA 12.8 libraries
# come from PyPI (7.4 GB with the rest installed). OLDEST_TORCH_SPEC="torch==2.11.0 torchvision==0.26.0" tests the
# release the GPU machines this project borrows carry.
OLDEST_VENV ?= .venv-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_TORCH_SPEC ?= torch==2.9.1 torchvision==0.24.1
# Every private name on this torch (test_lightning_internals), each compat shim against torch's own API
# (test_compat), the strategy against ddp and by hand where FSDP2's internals differ between releases
# (test_strategy_exact, test_strategy_like_ddp: whole weights after fit; test_dtensor_collectives; the children
# sharded in place and given back plain through FSDP2's private parts: test_module_patterns, test_in_place,
# test_module_after_stage; compiled regions around the units and the roll call after an error, which read dynamo's
# and torch.distributed's private parts), and the model,
# compile and precision-plugin tests that are fast. test_dtensor_collectives first: it forks the pytest process,
# which fails once autograd has run in it.
OLDEST_TESTS ?= tests/test_dtensor_collectives.py tests/test_lightning_internals.py tests/test_compat.py \
	tests/test_strategy_exact.py tests/test_strategy_like_ddp.py tests/test_resblock_precision.py \
	tests/test_scale_rules.py tests/test_prior.py tests/test_sparse_attention.py tests/test_dvae.py \
	tests/test_compiled_models.py tests/test_flex_recompiles.py tests/test_boundary_kernels.py \
	tests/test_module_patterns.py tests/test_in_place.py tests/test_module_after_stage.py \
	tests/test_compiled_in_place.py tests/test_roll_call.py

.PHONY: demo test test-fast test-oldest ci install install-test install-oldest bench dist clean

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

# After the newest environment's install (never beside it: both editable installs write the same egg-info).
$(OLDEST_VENV)/.installed-test: $(VENV)/.installed-test
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install --quiet --upgrade pip
	$(OLDEST_PY) -m pip install --quiet $(OLDEST_TORCH_SPEC)
	$(OLDEST_PY) -m pip install --quiet -e ./strategies -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test
install-oldest: $(OLDEST_VENV)/.installed-test

demo: $(VENV)/.installed
	$(VENV)/bin/python -m dalle_lightning.demo out_dir=$(OUT)

# Two workers: files that start processes on one, the others on the other (tests/conftest.py, make_scheduler).
# The 15 slowest tests are listed at the end: the suite must stay well under 15 minutes on 2 cores.
test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

# One process, its own temporary folder and no cache, so it can run beside `make test` (`make ci` does); at its
# lower priority there, a distributed test's hang detector waits 3x as long (tests/helpers/distributed.py).
test-oldest: $(OLDEST_VENV)/.installed-test
	$(OLDEST_PY) -c "import torch, lightning; print('oldest environment: torch', torch.__version__, 'lightning', lightning.__version__)"
	DALLE_TEST_TIMEOUT_SCALE=3 $(OLDEST_PY) -m pytest -q -p no:cacheprovider --basetemp=$$(mktemp -d) --durations=5 $(OLDEST_TESTS)

# CI: `make test` and, beside it at a lower priority, `make test-oldest` (.ci/run says how).
ci:
	.ci/run

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

# The GPU check on a borrowed GPU machine that has torch, Lightning, torchmetrics, tokenizers, timm and pytest but no
# package index (docs/results.md, "The GPU check"). Here: `make gpu-wheels` builds the wheels of the rest into
# $(WHEELS) (git-ignored). There: `make gpu-check WHEELS=.whl` installs them into $(GPU_SITE) without an index and
# runs every step of benchmarks/_gpu_check.py from the source tree (at most 9 minutes; summary in
# outputs/gpu_check/summary.json, or GPU_CHECK_ARGS="--out-dir DIR"; --smoke runs it at tiny sizes on a CPU).
WHEELS ?= .whl
GPU_SITE ?= /tmp/site
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
GPU_WHEELS := hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 braceexpand==0.1.7 \
	webdataset==1.0.2 open_clip_torch==3.3.0 ftfy==6.3.1 wcwidth==0.9.4 vector-quantize-pytorch==1.32.0 einx==0.4.3 \
	frozendict==2.5.1 torch-einops-utils==0.2.0 loguru==0.7.3

.PHONY: gpu-wheels gpu-check

gpu-wheels:
	$(PYTHON) -m pip wheel --no-deps --quiet --wheel-dir $(WHEELS) $(GPU_WHEELS)

gpu-check:
	@if ls $(WHEELS)/*.whl >/dev/null 2>&1; then \
	    $(GPU_PYTHON) -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE) \
	        $(WHEELS)/*.whl; \
	else echo "== no wheels in $(WHEELS): the check runs with this python's own packages"; fi
	PYTHONPATH=$(GPU_SITE):.:strategies:callbacks $(GPU_PYTHON) benchmarks/gpu.py --all $(GPU_CHECK_ARGS)
