#!/usr/bin/env bash
# Create .venv with the pinned dev stack and pipepar installed in editable mode. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, torchvision, pipepar" >/dev/null 2>&1 \
   || [ requirements-dev.txt -nt .venv/.installed ] || [ pyproject.toml -nt .venv/.installed ]; then
  .venv/bin/pip install --quiet --disable-pip-version-check -r requirements-dev.txt
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps -e .
  touch .venv/.installed
fi
