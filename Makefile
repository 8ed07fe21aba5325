# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.gyre-installed

.PHONY: run test venv clean bench-bus

venv: $(STAMP)

$(STAMP): requirements.txt requirements/*.txt pyproject.toml
	@# Mooncake needs libibverbs even over TCP; installed when we may (root + apt), else its tests skip.
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! dpkg -s libibverbs1 >/dev/null 2>&1; then \
	  (apt-get update -qq && apt-get install -y -qq libibverbs1) >/dev/null 2>&1 || echo "note: libibverbs1 not installed"; fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -r requirements/nodeps.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/gyre up -c configs/embedded.yaml

# the suite runs in PYTEST_WORKERS processes (pytest-xdist); 0 runs it in this one
PYTEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

bench-bus: $(STAMP)
	$(BIN)/gyre bench bus --json

clean:
	rm -rf $(VENV) .gyre
