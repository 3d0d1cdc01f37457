# mlx-fleet: `make up` starts a local fleet, `make test` runs the test suite.
# Each target installs what is missing first (venv, package, redis-server), idempotently.

# The first interpreter that actually runs and is 3.10-3.13 (pyenv shims may exist but not run).
PYTHON ?= $(shell for p in python3 python3.12 python3.11 python3.10 python3.13; do \
	$$p -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] < (3, 14) else 1)' >/dev/null 2>&1 \
	&& { command -v $$p; break; }; done)
VENV   ?= .venv
BIN    := $(VENV)/bin
NODES  ?= 1
MODEL  ?=
PORT   ?= 8000
ARGS   ?=
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`: the fleet tests run one after another on one of them (tests/conftest.py),
# the in-process suites on the others. 0 runs everything in this process, one test at a time.
TEST_WORKERS ?= 2
# MLX's backend on Linux: cpu (the default) or cuda (MLX's CUDA 13 wheel; docs/gpu.md). macOS always has Metal.
BACKEND ?= cpu
# Where the fleet's state lives; the same for up, down and status. Empty: $$MLX_FLEET_DATA_DIR, else ~/.mlx-fleet.
DATA_DIR ?=

DATA_FLAG := $(if $(DATA_DIR),--data-dir $(DATA_DIR))
UP_FLAGS := --nodes $(NODES) --port $(PORT) $(foreach m,$(MODEL),--model $(m)) $(DATA_FLAG) $(ARGS)

.PHONY: up down status test deps redis netns-tools fleet-token clean

up: $(VENV)/.installed-base redis
	$(BIN)/mlx-fleet up $(UP_FLAGS)

down: $(VENV)/.installed-base
	$(BIN)/mlx-fleet down $(DATA_FLAG)

status: $(VENV)/.installed-base
	$(BIN)/mlx-fleet status $(DATA_FLAG)

test: $(VENV)/.installed-test redis netns-tools
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

deps: $(VENV)/.installed-test redis

redis:
	@deploy/bootstrap/ensure-redis.sh

# What the real `ray up` test needs (tests/deploy/test_ray_up.py); best effort: without it that test skips.
netns-tools:
	@tests/deploy/netns/ensure-tools.sh

$(VENV)/bin/python:
	@test -n "$(PYTHON)" || { echo "mlx-fleet needs Python 3.10-3.13 (e.g. brew install python@3.12); or set PYTHON=/path/to/python3" >&2; exit 1; }
	@echo "creating $(VENV) with $(PYTHON) ..."
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip >/dev/null 2>&1 || $(BIN)/python -m pip install -q --upgrade pip

# pip's and setuptools' chatter goes to a log, shown only if the install fails.
PIP_INSTALL = $(BIN)/python -m pip install -q

$(VENV)/.installed-base: pyproject.toml | $(VENV)/bin/python
	@echo "installing mlx-fleet and its dependencies into $(VENV) (log: $(VENV)/pip.log) ..."
	@$(PIP_INSTALL) -e ".[$(BACKEND)]" >$(VENV)/pip.log 2>&1 || { cat $(VENV)/pip.log; exit 1; }
	@touch $@

$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/python
	@echo "installing mlx-fleet with its test and load-test dependencies into $(VENV) (log: $(VENV)/pip.log) ..."
	@$(PIP_INSTALL) -e ".[$(BACKEND),test,load]" >$(VENV)/pip.log 2>&1 || { cat $(VENV)/pip.log; exit 1; }
	@touch $@ $(VENV)/.installed-base

fleet-token: deploy/.ray-token

deploy/.ray-token:
	@umask 077 && python3 -c 'import secrets; print(secrets.token_hex(32), end="")' > $@ && echo "wrote $@"

clean:
	rm -rf $(VENV) build *.egg-info
