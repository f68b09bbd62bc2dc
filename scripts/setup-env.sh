#!/usr/bin/env bash
# Creates ./.venv (once) and installs gradtrack into it with its test tools.
# torch: an already installed torch is reused; otherwise torch==$TORCH_VERSION is
# installed (set PIP_INDEX_URL to PyTorch's CPU wheel index to get the small CPU build).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
venv=.venv
if [ ! -x "$venv/bin/python" ]; then
  if "$python" -c "import torch" >/dev/null 2>&1; then
    echo "setup: reusing the torch installed for $python"
    "$python" -m venv --system-site-packages "$venv"
  else
    "$python" -m venv "$venv"
  fi
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "setup: no torch found; installing torch==${TORCH_VERSION:-2.13.0}"
  "${pip[@]}" install "torch==${TORCH_VERSION:-2.13.0}"
fi
# Reinstall only when the project's requirements change.
stamp="$venv/.gradtrack-installed"
want=$(cat pyproject.toml scripts/setup-env.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing gradtrack and its test tools into $venv"
  # DeepSpeed (the ZeRO tests, on the CPU) builds none of its CUDA ops at install.
  DS_BUILD_OPS=0 "${pip[@]}" install -e ".[dev]"
  echo "$want" > "$stamp"
fi
