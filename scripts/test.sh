#!/usr/bin/env bash
# The test command: set up both environments, lint (ruff, configured in pyproject.toml), then run
# pytest (goldens are recomputed from transformers by tests/conftest.py whenever they are missing or
# stale). Extra args go to pytest. Without test paths among them the suite runs as two processes,
# tests/kernels and tests/bench, then tests/model: the kernels' interpreter runs leave XLA state
# (threads, hundreds of compiled programs) that a single process would carry through the model
# tests, and XLA:CPU once crashed compiling in such a process. Both must pass. Each runs on two
# pytest-xdist workers (most of the time is single-threaded compilation): the kernel tests one by one,
# the model tests a module at a time (their modules share loaded models and compiled programs).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check --quiet .
for arg in "$@"; do
  if [[ "$arg" == tests* ]]; then exec .venv/bin/python -m pytest "$@"; fi
done
.venv/bin/python -m pytest -n 2 --dist load tests/kernels tests/bench "$@"
exec .venv/bin/python -m pytest -n 2 --dist loadscope tests/model "$@"
