# Fadenstack: `make run` brings the console up, `make test` runs every test.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run lint test test-fast lab-up lab-down lab-status bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || "$$(scripts/find-python)" -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,lab]'
	# The agent's source on the venv's path, for lint-imports (which only reads it: the server never imports it).
	echo "$(CURDIR)/agent" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/fadenstack-agent-source.pth"
	touch $@

## The console on this host: SQLite and a Redis of its own unless DATABASE_URL / REDIS_URL say otherwise.
run: $(VENV)/.installed
	$(VENV)/bin/faden serve

## Imports point one way (the contracts in pyproject.toml); the venv finds the agent's package in agent/ (a .pth file).
lint: $(VENV)/.installed
	$(VENV)/bin/lint-imports

## The whole suite: unit, API, live updates, the lab (as root) and the browser tests. The lab is one per
## host, so its tests run in one worker (in order) and everything else in a second one beside it.
test: lint
	$(PY) -m pytest -n 2 --dist loadgroup --no-loadscope-reorder

## Everything but the lab and the browser.
test-fast: lint
	$(PY) -m pytest -m "not lab and not browser"

lab-up: $(VENV)/.installed
	$(VENV)/bin/faden lab up

lab-down: $(VENV)/.installed
	$(VENV)/bin/faden lab down

lab-status: $(VENV)/.installed
	$(VENV)/bin/faden lab status

bench: $(VENV)/.installed
	$(PY) bench/enrol.py

clean:
	rm -rf $(VENV) staticfiles
