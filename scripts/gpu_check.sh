#!/usr/bin/env bash
# Two-level checkpointing end to end on the GPU: a SIGKILLed training process resumes
# from its snapshot in shared memory and matches an uninterrupted run bit for bit; then
# `moc train --nproc 2 --device cuda` (NCCL) does the same through a torchrun restart
# (needs 2 GPUs; skipped, and said so, on a machine with one).
# Sets up .venv like `make test` (a CUDA torch already installed is used as is).
set -euo pipefail
cd "$(dirname "$0")/.."
make setup >/dev/null
export CUBLAS_WORKSPACE_CONFIG=:4096:8
exec .venv/bin/python scripts/gpu_check.py --device "${1:-cuda}"
