#!/usr/bin/env bash
# Runs gradtrack's whole test suite (and the doctests) in ./.venv; arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec .venv/bin/python -m pytest "$@"
