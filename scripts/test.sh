#!/usr/bin/env bash
# The test command: set up both environments, then run pytest (goldens are recomputed from
# transformers by tests/conftest.py whenever they are missing or stale). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
