#!/usr/bin/env bash
# The GPU check (issues 39 and 45), one prepared script that fits a 15-minute device lease:
# the CUDA tests (nothing on the training thread waits for the device, slots pinned before
# the first checkpoint and after a memory restore, fused and capturable AdamW and dropout
# resumed bitwise, a SIGKILL between capture and seal), a SIGKILLed run resumed bitwise
# from memory, the capture after a memory restore against pinned device-to-host, with two
# GPUs a rank SIGKILLed and recovered by restart and in-job (NCCL), every step paired at
# gpu-400m and gpu-800m (`moc bench loop`), and none / dcp-async / moc at a checkpoint
# every 5 steps on gpu-400m and bench. Writes its figures, every criterion and the
# verdict as JSON: $OUT/gpu-check.json. Its last line is the verdict: PASS (every
# criterion measured and met), FAIL (names each one not met) or NOT MEASURED (names each
# one missing); it exits 0, 1 or 2.
#
#   scripts/gpu_check.sh [OUT] [BUDGET_S]     (default OUT: ./gpu-check, budget 540 s)
#
# Runs with the machine's own python3 and torch, offline: no venv, nothing installed
# from a registry (crc32c, safetensors and tqdm are not needed; the JSON says which
# packages were there). moc runs from this checkout (PYTHONPATH); its C extension is
# built in place with the machine's compiler, and without one moc's Python fallbacks run
# (the JSON says which). Each section runs in a session of its own, killed whole at its
# time limit, with its own temporary directory and shared-memory root, removed after it.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-check}}
budget=${2:-540}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8
if ! "$py" setup.py -q build_ext --inplace >"$out/build.log" 2>&1; then
  echo "gpu_check: the C extension did not build (see $out/build.log): Python fallbacks run"
fi
# Three slots of gpu-800m's 9.3 GB snapshot, and the persist's reads: 40 GB of shared
# memory. A smaller /dev/shm gets a tmpfs of its own where this runs as root.
shm_gb=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
if [ "${shm_gb:-0}" -lt 40 ] && [ "$(id -u)" = 0 ]; then
  mkdir -p /tmp/moc-shm && mount -t tmpfs -o size=64g tmpfs /tmp/moc-shm \
    && export MOC_SHM_ROOT=/tmp/moc-shm \
    && echo "gpu_check: /dev/shm has ${shm_gb} GB free; snapshots in a 64 GB tmpfs instead"
fi
exec "$py" scripts/gpu_check.py --device cuda --out "$out" --budget "$budget"
