# The README's commands. Each target creates or refreshes a local virtualenv in .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.jax_cache

.PHONY: demo test test-all bench lint notebooks native clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(TEST_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install -q -e '.[test,hf,serve]'
	touch $@

demo: $(STAMP)
	$(PY) -m dualpath_jax.demo

# The fast tier: everything but engine processes and the compiled core's build (in-process
# clusters included); minutes on two cores.
test: $(TEST_STAMP)
	$(PY) -m ruff check dualpath_jax configs launch bench tests colab
	$(PY) -m pytest -q -m "not multiprocess and not slow" --durations=15 tests

# Everything, the fast tier first (CI runs this).
test-all: $(TEST_STAMP)
	$(PY) -m ruff check dualpath_jax configs launch bench tests colab
	$(PY) -m pytest -q --durations=40 tests

bench: $(TEST_STAMP)
	$(PY) bench/model_cpu.py
	$(PY) bench/kvstore.py
	$(PY) bench/links.py
	$(PY) bench/transfer.py
	$(PY) bench/sched.py
	$(PY) bench/compare_policies.py --config=configs/cpu_1p2d.py --workdir=bench_out/cpu_1p2d
	$(PY) bench/compare_policies.py --config=configs/cpu_1p1d.py --workdir=bench_out/cpu_1p1d --policies=basic,dualpath,oracle
	$(PY) bench/compare_policies.py --config=configs/balanced.py --workdir=bench_out/balanced --policies=basic,dualpath,oracle
	$(PY) bench/online_capacity.py --config=configs/cpu_1p2d.py --set workload.duration_s=150 --aps=0.04,0.08,0.16,0.32 --bisect=2 --workdir=bench_out/capacity
	$(PY) bench/serve_multiturn.py --workdir=bench_out/serve_multiturn
	$(PY) bench/load_or_recompute.py --workdir=bench_out/load_or_recompute
	$(PY) bench/session_retention.py --workdir=bench_out/session_retention
	$(PY) bench/sim_validate.py --workdir=bench_out/sim_validate
	$(PY) bench/event_loop.py
	$(PY) bench/sim_speed.py --agents=2048
	$(PY) bench/paper_figures.py --quick --out=bench_out/paper_quick

lint: $(TEST_STAMP)
	$(PY) -m ruff check dualpath_jax configs launch bench tests colab
	$(PY) -m ruff format --check dualpath_jax configs launch bench tests

# The .ipynb twins of the colab/*.py notebook sources (--update keeps their cell ids stable);
# tests/test_notebooks.py checks that they match.
notebooks: $(TEST_STAMP)
	$(PY) -m jupytext --update --to ipynb colab/*.py

# The simulator's compiled core (dualpath_jax.native): optional, same results, faster.
native: $(STAMP)
	$(PY) -m pip install -q -e '.[native]'
	$(PY) -m dualpath_jax.native build

clean:
	rm -rf $(VENV) .jax_cache .pytest_cache bench_out demo_out dualpath_jax/_native
