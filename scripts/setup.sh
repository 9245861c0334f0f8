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
# torchtitan for its tests and example (tests/integrations/test_torchtitan.py,
# examples/train_torchtitan.py), pinned, without its own dependencies: datasets, wandb
# and tensorboard are for torchtitan's data, logging and Trainer, which the tests do not
# use, and datasets' fsspec pin against s3fs's sends pip's resolver past ten minutes.
# These are what its models, parallelisation, optimizers and dataloader import; triton
# only because its MoE modules import it (it imports without a GPU). Skipped on a torch
# older than torchtitan 0.3.0 needs: those tests then skip.
if "$venv/bin/python" -c "import sys, torch; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 11))"; then
  "$venv/bin/python" -m pip install -q --no-deps torchtitan==0.3.0 triton==3.9.0 \
    tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 spmd_types==0.2.3 \
    torchdata==0.11.0 torch_checkpointing==0.1.1 einops==0.8.2
fi
