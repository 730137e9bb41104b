#!/usr/bin/env bash
# The test command: set up both environments, lint (ruff, configured in pyproject.toml), then run
# pytest (goldens are recomputed from transformers by tests/conftest.py whenever they are missing or
# stale). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check --quiet .
exec .venv/bin/python -m pytest "$@"
