#!/usr/bin/env bash
# Create the project's virtual environment and install moc into it.
#
# torch: a user's own torch (CUDA or CPU) in the base interpreter is kept by letting the
# venv see the base site-packages. Without one, the pinned CPU wheel is installed first,
# because an open-ended `torch` requirement with no torch present pulls a multi-GB CUDA
# build (on these machines torch==2.13.0 is a CPU wheel that lies on disk).
set -euo pipefail
venv=${1:-.venv}
base=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  if "$base" -c "import torch" 2>/dev/null; then
    echo "setup: using the torch already installed for $base"
    "$base" -m venv --system-site-packages "$venv"
  else
    "$base" -m venv "$venv"
  fi
fi
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: torch missing; installing the pinned CPU wheel torch==2.13.0"
  "$venv/bin/python" -m pip install -q torch==2.13.0
fi
"$venv/bin/python" -m pip install -q -e ".[dev]"
