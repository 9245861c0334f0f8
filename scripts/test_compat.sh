#!/usr/bin/env bash
# `make test-compat`: moc on the oldest torch it supports, the `torch>=X` of pyproject.toml
# (moc/compat.py says what sets it).
#
# A venv of its own (.compat/venv, gitignored; never .venv) gets exactly torch X.0,
# installed first and pinned, so that nothing pulls another torch; then moc (editable,
# as `make setup` installs it) with pytest and hypothesis. Then, on the CPU:
#   1. `moc train --steps 30`: the tiny config, 2 ranks, --ckpt-mode moc (the two-level
#      engine and its persist process), rank 1 SIGKILLed at step 25 and restarted by
#      torchrun, resumed from memory; then `moc verify` of what it wrote;
#   2. the smoke tests (SMOKE below).
#
# Old torch releases on PyPI are CUDA builds: about 3.7 GB of wheels with their nvidia-*
# libraries (they run on the CPU too), 6.6 GB installed. The wheels are kept in
# .compat/wheels, so a second run downloads nothing, and the venv is kept while its torch
# is the pinned one (COMPAT_FRESH=1 makes it anew). `make clean` removes .compat.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${COMPAT_DIR:-.compat}
venv=$dir/venv
wheels=$dir/wheels
base=${PYTHON:-python3}
min=$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
if [ -z "$min" ]; then
  echo "test-compat: no \"torch>=X\" dependency in pyproject.toml" >&2
  exit 1
fi
pin="torch==$min.0"

# The smoke tests: what leans hardest on torch's APIs, a minute or two on 2 cores. The
# rest of the unit tier passed on the minimum when it was set (moc/compat.py), and what
# the `moc train` run covers is not repeated.
SMOKE=(
  tests/test_compat.py               # the minimum declared and checked at import
  tests/train/test_agent.py          # torchrun's options asked of this torchrun
  tests/checkpoint/test_shards.py    # DTensor layouts, from torch's own layout function
  tests/checkpoint/test_sync.py      # moc.Checkpointer: PEC saves, restore, fallbacks
  tests/checkpoint/test_state.py     # optimizer, LR schedule, RNG, buffers: both engines
  tests/checkpoint/test_preemption.py  # signals agreed over gloo, the final checkpoint
  # FSDP2 + tensor parallel + expert parallel pieces; a DTensor router's routing counts
  tests/checkpoint/test_dtensor.py::test_tensor_parallel_pieces_restore_into_one_process_and_onto_fsdp2_with_ep
  tests/checkpoint/test_dtensor.py::test_watch_routing_counts_a_dtensor_routers_tokens_on_each_rank
)

start=$SECONDS
if [ "${COMPAT_FRESH:-0}" = 1 ] || ! "$venv/bin/python" -c \
    "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$min.0')" 2>/dev/null
then
  echo "test-compat: a venv with $pin in $venv"
  rm -rf "$venv"
  "$base" -m venv "$venv"
  # Files already in $wheels are used as they are ("File was already downloaded").
  "$venv/bin/python" -m pip download -q --dest "$wheels" "$pin"
  "$venv/bin/python" -m pip install -q --no-index --find-links "$wheels" "$pin"
fi
"$venv/bin/python" -m pip install -q --constraint <(echo "$pin") -e . pytest hypothesis
echo "test-compat: installed in $((SECONDS - start)) s:" \
     "$("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)')"

run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
"$venv/bin/moc" train --steps 30 --nproc 2 --device cpu --no-progress \
  --ckpt-dir "$run/ckpt" --ckpt-interval 10 --fault-at 25 --fault-rank 1 --max-restarts 1 \
  --metrics "$run/metrics.jsonl"
"$venv/bin/python" - "$run/metrics.jsonl" <<'EOF'
import sys

from moc.train.metrics import read_events

events = read_events(sys.argv[1])
recovered = [e for e in events if e["event"] == "recovery"]
assert recovered and recovered[0]["source"] == "memory", f"no recovery from memory: {recovered}"
assert events[-1]["event"] == "summary", "the run did not finish"
print(f"test-compat: recovered at step {recovered[0]['resumed_from']} from memory, finished")
EOF
"$venv/bin/moc" verify "$run/ckpt"
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" "${SMOKE[@]}"
echo "test-compat: torch $min passed in $((SECONDS - start)) s"
