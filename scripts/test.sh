#!/usr/bin/env bash
# Runs gradtrack's whole test suite (and the doctests) in ./.venv.
#   bash scripts/test.sh               the full suite: on two workers (pytest-xdist), then the
#                                      tests marked `solo` alone (their promises are about time)
#   bash scripts/test.sh ARGS...       one pytest run with ARGS, e.g. -m "not slow" (the fast
#                                      tier) or tests/test_guard.py -k raise
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
# Only the pytest plugins the suite needs: a venv that reuses the interpreter's torch also
# sees the interpreter's other packages, and their plugins (pytest-benchmark, ...) would
# otherwise load into the suite and change what it does.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
pytest=(.venv/bin/python -m pytest -p xdist.plugin)
if [ "$#" -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi
status=0
"${pytest[@]}" -n "${GRADTRACK_TEST_WORKERS:-2}" -m "not solo" || status=$?
"${pytest[@]}" -m solo || status=$?
exit "$status"
