"""torchtitan's own objects handed to moc as they are: its Qwen3 MoE parallelised by its
own `parallelize_qwen3` (EP and FSDP2), its `OptimizersContainer`, LR schedulers and
stateful dataloader (tests/integrations/titan_worker.py, on real torchrun ranks, gloo).
No ExpertSpec, no routers=: moc finds the experts, the routers and every optimizer.

On 2 ranks (4 in the slow tier), against a run never interrupted:
- a rank SIGKILLed, torchrun restarts the job: restored from memory, bitwise (through
  `MocCheckpointManager`, as torchtitan's Trainer builds and calls it);
- the node's memory gone: restored from storage (K = all), bitwise;
- a partial checkpoint (K = 1) restored from storage: the lost tokens and PLT are those
  counted by hand, from torchtitan's own `tokens_per_expert_E` and the manifests;
- the final checkpoint restored onto 1 rank equals the trained state entry by entry,
  optimizer state and LR schedulers included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan")

from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import complete_steps

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("titan_worker.py")
STEPS, KILL_AT = 6, 3


def launch(tmp: Path, name: str, world: int, *args: str, ckpt: Path | None = None,
           shm: Path | None = None, steps: int = STEPS) -> Path:
    """One job of the worker (`world` ranks under torchrun, 1 in a plain process); its
    output directory."""
    out = tmp / name
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "MOC_SHM_ROOT": str(shm or out / "shm"), "TITAN_DUMP_S": "400"}
    base = [sys.executable, str(WORKER)] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(world), "--max-restarts", "1", str(WORKER)]
    r = subprocess.run([*base, "--ckpt", str(ckpt or out / "ckpt"), "--out", str(out),
                        "--steps", str(steps), *args], env=env, capture_output=True,
                       text=True, timeout=900, cwd=tmp)
    assert r.returncode == 0, f"{name}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return out


def record(out: Path, rank: int = 0) -> dict[str, Any]:
    """The last attempt's record of `rank`."""
    attempts = sorted(out.glob(f"record-{rank}-*.json"))
    return json.loads(attempts[-1].read_text())


def final_state(out: Path) -> dict[str, Any]:
    return torch.load(sorted(out.glob("state-*.pt"))[-1], weights_only=True)


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Entry by entry, bitwise: parameters, expert_bias_E, every optimizer state entry,
    the param groups and the LR schedulers."""
    for part in ("model", "optim"):
        assert got[part].keys() == want[part].keys(), part
        for k, v in want[part].items():
            assert torch.equal(got[part][k], v), f"{part} {k} differs"
    assert got["groups"] == want["groups"]
    assert got["lr_schedulers"] == want["lr_schedulers"]


def hand_count(ckpt: Path, reference: dict[str, Any], step: int
               ) -> tuple[int, list[float]]:
    """What restoring `step` from storage loses, counted by hand: for each (layer,
    expert), the tokens torchtitan counted for it after the newest checkpoint up to
    `step` that saved it (the manifests' `experts_saved`); per layer, that over every
    token assignment up to `step`. (total lost, per-layer proportion)."""
    tokens = {int(s): torch.tensor(t) for s, t in reference["tokens"].items()}
    layers, experts = tokens[1].shape
    saved_at = torch.zeros(layers, experts, dtype=torch.long)
    for s in sorted(x for x in complete_steps(ckpt) if x <= step):
        for layer, ids in Manifest.load(ckpt, s).experts_saved.items():
            saved_at[int(layer), ids] = s
    lost = torch.zeros(layers, dtype=torch.long)
    for s in range(1, step + 1):
        after = (saved_at < s).long()  # updates of step s not in the copy restored
        lost += (tokens[s] * after).sum(dim=1)
    total = sum(tokens[s] for s in range(1, step + 1)).sum(dim=1)
    return int(lost.sum()), (lost.double() / total.double()).tolist()


def check_titan_run(tmp: Path, world: int) -> None:
    reference = launch(tmp, "reference", world, "--k", "1")
    ref_record, ref_state = record(reference), final_state(reference)

    # A rank SIGKILLed after step 3; torchrun's restart restores from memory. Through
    # MocCheckpointManager, built and called as torchtitan's Trainer does.
    faulted = launch(tmp, "faulted", world, "--k", "all", "--kill-at", str(KILL_AT),
                     "--manager")
    got = record(faulted)
    assert (got["attempt"], got["start"], got["source"]) == (1, KILL_AT, "memory"), got
    assert got["counter"] == KILL_AT and got["lost_tokens"] == 0
    assert got["losses"] == {s: v for s, v in ref_record["losses"].items()
                             if int(s) > KILL_AT}
    assert_same(final_state(faulted), ref_state)

    # The node's memory gone: step 3 from storage (every expert saved: K = all).
    storage = launch(tmp, "storage", world, "--k", "all", "--restore-step", str(KILL_AT),
                     ckpt=faulted / "ckpt")
    got = record(storage)
    assert (got["start"], got["source"], got["lost_tokens"]) == (KILL_AT, "storage", 0), got
    assert got["losses"] == {s: v for s, v in ref_record["losses"].items()
                             if int(s) > KILL_AT}
    assert_same(final_state(storage), ref_state)

    # The final checkpoint (complete whatever K) onto 1 rank: the trained state, entry
    # by entry (the data position of 2 ranks does not apply to 1: not restored).
    one = launch(tmp, "one-rank", 1, "--k", "1", "--restore-step", str(STEPS),
                 "--no-dataloader", ckpt=reference / "ckpt")
    assert record(one)["start"] == STEPS
    assert_same(final_state(one), ref_state)

    # A partial checkpoint (K = 1) from storage: PLT as counted by hand (restored only).
    restored = STEPS - 1
    partial = launch(tmp, "partial", world, "--k", "1", "--restore-step", str(restored),
                     ckpt=reference / "ckpt", steps=restored)
    got = record(partial)
    lost, per_layer = hand_count(reference / "ckpt", ref_record, restored)
    assert got["source"] == "storage" and got["start"] == restored
    assert lost > 0 and got["lost_tokens"] == lost, (got, lost)
    assert got["plt"] == pytest.approx(sum(per_layer) / len(per_layer), rel=1e-12)


def test_torchtitan_on_2_ranks_restores_bitwise_and_counts_plt(tmp_path):
    check_titan_run(tmp_path, 2)


@pytest.mark.slow
def test_torchtitan_on_4_ranks_restores_bitwise_and_counts_plt(tmp_path):
    check_titan_run(tmp_path, 4)
