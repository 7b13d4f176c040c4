# `make test` and `make demo` work on a fresh machine: both create the virtual environment first.
VENV ?= .venv
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test lint typecheck demo bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned. From PyPI on Linux x86 that is the CUDA build (several GB); for the CPU build:
	# make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[test]'
	# verl's own reduce_metrics / allgather_dict_into_dict for tests/test_integrations_verl.py; its
	# requirements (ray, an older transformers) are not needed for that, hence --no-deps.
	$(PY) -m pip install -q --no-deps verl==0.9.1
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check rankmem tests bench scripts examples

typecheck: install
	$(VENV)/bin/mypy rankmem

test: lint typecheck
	$(VENV)/bin/pytest -q

# The main job: 2-rank GRPO on the reference worker, about two minutes on 2 CPU cores.
demo: install
	$(VENV)/bin/rankmem train --nproc-per-node 2 --out runs/demo

bench: install
	$(PY) bench/bench_probe.py
	$(PY) bench/bench_gather.py
	$(PY) bench/bench_leaks.py
	$(PY) bench/bench_report.py
	$(PY) bench/bench_overhead.py
	$(PY) bench/bench_hf_overhead.py

clean:
	rm -rf $(VENV) runs .mypy_cache .ruff_cache .pytest_cache
