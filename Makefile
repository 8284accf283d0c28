# The two commands the README promises: `make run` and `make test`. Both bootstrap themselves.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
BIND ?= $(or $(CROSSBAR_BIND),127.0.0.1:8080)

.PHONY: setup run test lint clean

$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $@

setup: $(VENV)/.installed
	$(PY) manage.py migrate --noinput
	$(PY) manage.py crossbar_setup

run: setup
	$(VENV)/bin/daphne --bind $(firstword $(subst :, ,$(BIND))) --port $(lastword $(subst :, ,$(BIND))) crossbar_site.asgi:application

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest

clean:
	rm -rf $(VENV) var/static
