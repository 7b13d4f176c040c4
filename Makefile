# `make test` and `make demo` work on a fresh machine: both create the virtual environment first.
VENV ?= .venv
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-slow lint typecheck demo bench clean verl-check

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

# The cases `make test` leaves out: further launches of the reference worker and the launcher, soak and
# long cases (each capability keeps one representative in `make test`). Run it when you change the
# launcher, the reference worker or the forensics of a dying rank.
test-slow: install
	$(VENV)/bin/pytest -q -m slow

# The main job: 2-rank GRPO on the reference worker, about two minutes on 2 CPU cores.
demo: install
	$(VENV)/bin/rankmem train --nproc-per-node 2 --out runs/demo

bench: install
	$(PY) bench/bench_probe.py
	$(PY) bench/bench_heartbeat.py
	$(PY) bench/bench_cold.py
	$(PY) bench/bench_nearoom.py
	$(PY) bench/bench_gather.py
	$(PY) bench/bench_leaks.py
	$(PY) bench/bench_report.py
	$(PY) bench/bench_overhead.py
	$(PY) bench/bench_hf_overhead.py

# verl 0.9.1's own run_ppo and TrainingWorker on 2 ranks of its Ray worker group, with rankmem's setup hook
# (the README's token) and with the hand-written diff: the driver must see the same figures
# (scripts/verl_check.py says what is verl's). verl's requirements (transformers < 5.11) conflict with
# the test extra, so it gets its own venv; not part of `make test`. ~80 s to build with a warm pip cache,
# a few minutes to run on 2 cores (three Ray sessions). Skipped, saying so, when the index is unreachable.
VERL_VENV ?= .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed

$(VERL_STAMP): pyproject.toml
	python3 -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERL_VENV)/bin/python -m pip install -q torch==2.13.0
	# uvicorn and fastapi: verl imports them without declaring them.
	$(VERL_VENV)/bin/python -m pip install -q verl==0.9.1 ray==2.60.0 uvicorn fastapi
	$(VERL_VENV)/bin/python -m pip install -q -e .
	touch $(VERL_STAMP)

verl-check:
	@if [ ! -f $(VERL_STAMP) ] && ! python3 -m pip index versions verl >/dev/null 2>&1; then \
		echo "verl-check: skipped: the package index is unreachable (pip cannot list verl)"; exit 0; fi; \
	$(MAKE) --no-print-directory $(VERL_STAMP) && OMP_NUM_THREADS=1 $(VERL_VENV)/bin/python scripts/verl_check.py

clean:
	rm -rf $(VENV) $(VERL_VENV) runs .mypy_cache .ruff_cache .pytest_cache
