#!/usr/bin/env bash
# Runs tests on another torch release, in its own venv (.venv-torch-VERSION, made once):
#   bash scripts/test-on-torch.sh 2.14.1 tests/scenarios
# CI runs the scenario tests this way on a second release, so a release whose numerics break a
# scenario's precondition fails by the scenario's name. Users never need this: set-up reuses
# the torch you have (scripts/setup-env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/test-on-torch.sh TORCH_VERSION [PYTEST ARGS...]}
shift
venv=.venv-torch-$version
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"  # without the interpreter's packages: this release, nothing else
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
stamp="$venv/.gradtrack-installed"
want=$(cat pyproject.toml scripts/test-on-torch.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "test-on-torch: installing torch==$version, gradtrack and its test tools into $venv"
  "${pip[@]}" install "torch==$version"
  DS_BUILD_OPS=0 "${pip[@]}" install -e ".[dev]"
  echo "$want" > "$stamp"
fi
"$venv/bin/python" -c "import torch; print('test-on-torch: torch', torch.__version__)"
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
exec "$venv/bin/python" -m pytest -p xdist.plugin "$@"
