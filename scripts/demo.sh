#!/usr/bin/env bash
# Trains the quickstart CNN on synthetic data, watched by gradtrack; arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec .venv/bin/python examples/quickstart.py "$@"
