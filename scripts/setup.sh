#!/usr/bin/env bash
# Set up the environments, idempotently:
#   .venv      Python 3.12: this project (editable) with its test extra; JAX pinned to 0.11.2.
#   .venv-ref  Python 3.11: the transformers 5.23.0 reference on torch 2.13.0 (CPU), for goldens.
# Usage: scripts/setup.sh [--no-reference]
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {  # find_python 3.12 -> a python3.12 that runs (pyenv shims need the version named)
  local v=$1 candidate
  for candidate in "python$v" "$HOME/.pyenv/versions/$v"*/bin/python"$v"; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c '' 2>/dev/null; then echo "$candidate"; return; fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    local pv; pv=$(pyenv versions --bare | grep -E "^$v(\.|$)" | tail -n 1)
    if [ -n "$pv" ]; then echo "env PYENV_VERSION=$pv python$v"; return; fi
  fi
  echo "no Python $v found (install it, e.g. with pyenv)" >&2; exit 1
}

stamp() { sha256sum "$@" | sha256sum | cut -c1-16; }

if [ ! -x .venv/bin/python ]; then $(find_python 3.12) -m venv .venv; fi
want=$(stamp pyproject.toml)
if [ "$(cat .venv/.setup-stamp 2>/dev/null)" != "$want" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[test]'
  echo "$want" > .venv/.setup-stamp
fi

if [ "${1:-}" != "--no-reference" ]; then
  if [ ! -x .venv-ref/bin/python ]; then $(find_python 3.11) -m venv .venv-ref; fi
  want=$(stamp tests/reference/requirements.txt)
  if [ "$(cat .venv-ref/.setup-stamp 2>/dev/null)" != "$want" ]; then
    .venv-ref/bin/pip install -q -r tests/reference/requirements.txt
    echo "$want" > .venv-ref/.setup-stamp
  fi
fi
