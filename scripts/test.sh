#!/usr/bin/env bash
# Runs gradtrack's whole test suite (and the doctests) in ./.venv.
#   bash scripts/test.sh               the full suite: on two workers (pytest-xdist), then the
#                                      tests marked `solo` alone (their promises are about time)
#   bash scripts/test.sh ARGS...       one pytest run with ARGS, e.g. -m "not slow" (the fast
#                                      tier) or tests/test_guard.py -k raise
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
status=0
.venv/bin/python -m pytest -n "${GRADTRACK_TEST_WORKERS:-2}" -m "not solo" || status=$?
.venv/bin/python -m pytest -m solo || status=$?
exit "$status"
