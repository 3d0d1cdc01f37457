# mlx-fleet: `make up` starts a local fleet, `make test` runs the test suite.
# Each target installs what is missing first (venv, package, redis-server), idempotently.

PYTHON ?= $(shell command -v python3.12 || command -v python3.11 || command -v python3.10 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
NODES  ?= 1
MODEL  ?=
PORT   ?= 8000
ARGS   ?=
PYTEST_ARGS ?=

UP_FLAGS := --nodes $(NODES) --port $(PORT) $(foreach m,$(MODEL),--model $(m)) $(ARGS)

.PHONY: up down status test deps redis fleet-token clean

up: $(VENV)/.installed-base redis
	$(BIN)/mlx-fleet up $(UP_FLAGS)

down: $(VENV)/.installed-base
	$(BIN)/mlx-fleet down

status: $(VENV)/.installed-base
	$(BIN)/mlx-fleet status

test: $(VENV)/.installed-test redis
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

deps: $(VENV)/.installed-test redis

redis:
	@deploy/bootstrap/ensure-redis.sh

$(VENV)/bin/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "mlx-fleet needs Python 3.10+; set PYTHON=/path/to/python3.1x")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-base: pyproject.toml | $(VENV)/bin/python
	$(BIN)/python -m pip install -q -e .
	@touch $@

$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/python
	$(BIN)/python -m pip install -q -e ".[test,load]"
	@touch $@ $(VENV)/.installed-base

fleet-token: deploy/.ray-token

deploy/.ray-token:
	@umask 077 && python3 -c 'import secrets; print(secrets.token_hex(32), end="")' > $@ && echo "wrote $@"

clean:
	rm -rf $(VENV) build *.egg-info
