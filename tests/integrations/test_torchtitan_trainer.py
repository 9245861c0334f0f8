"""torchtitan's own `Trainer` (its `train()` loop, torchtitan's code as it is) with
`checkpoint=MocCheckpointManager.Config(...)` in its config: moc as a drop-in for
torchtitan's CheckpointManager (issue 46), on 2 CPU ranks under torchrun (gloo), EP 2
with FSDP2 over both ranks (tests/integrations/titan_trainer.py, the driver: the
Trainer's config, a tokenizer and a dataloader of one's own, the losses recorded).

Real processes, a real SIGKILL, torchrun's real restart; no mocks. Against an
uninterrupted run of 8 steps (checkpoint interval 2, K = 1):
- rank 1 SIGKILLed once step 4 is checkpointed; torchrun restarts the job, the Trainer's
  `checkpointer.load()` restores step 4 from memory (moc's snapshots in shared memory)
  and steps 5 to 8 give the uninterrupted run's losses, bitwise;
- a fresh job (memory gone: another MOC_SHM_ROOT) with `load_step=4` on that checkpoint
  folder (K = all) restores from storage, and steps 5 to 8 give the same losses, bitwise.

Losses are compared as `float.hex` strings: equal means bitwise equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("titan_trainer.py")
STEPS, INTERVAL, KILL_AT = 8, 2, 4
WORLD = 2


def launch(tmp: Path, name: str, *args: str, dump: Path | None = None) -> Path:
    """One torchrun job of the driver on WORLD ranks, allowed one restart; its output
    directory. The job's shared memory (MOC_SHM_ROOT) is its own: a job launched anew
    finds none of another's snapshots, as after losing the machine."""
    out = tmp / name
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "MOC_SHM_ROOT": str(out / "shm"), "TITAN_DUMP_S": "400"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(WORLD), "--max-restarts", "1", str(DRIVER),
           "--dump", str(dump or out / "dump"), "--out", str(out), "--steps", str(STEPS),
           "--interval", str(INTERVAL), *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp)
    assert r.returncode == 0, f"{name}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return out


def losses(out: Path, rank: int, attempt: int) -> dict[int, str]:
    """The losses `rank` logged in `attempt`, by step, as `float.hex`."""
    got = json.loads((out / f"losses-{rank}-{attempt}.json").read_text())
    return {int(step): loss for step, loss in got.items()}


def record(out: Path, rank: int, attempt: int) -> dict[str, Any]:
    """What `rank` restored in `attempt` (written once its training finished)."""
    return json.loads((out / f"record-{rank}-{attempt}.json").read_text())


def after(reference: dict[int, str], step: int) -> dict[int, str]:
    return {s: v for s, v in reference.items() if s > step}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three jobs, in order (the storage job restores the faulted job's folder)."""
    tmp = tmp_path_factory.mktemp("titan-trainer")
    out = {"reference": launch(tmp, "reference", "--k", "1")}
    out["faulted"] = launch(tmp, "faulted", "--k", "all", "--kill-at", str(KILL_AT))
    out["storage"] = launch(tmp, "storage", "--k", "all", "--load-step", str(KILL_AT),
                            dump=out["faulted"] / "dump")
    return out


def test_uninterrupted_trainer_run_records_every_step(runs: dict[str, Path]) -> None:
    """The reference: torchtitan's Trainer trains STEPS steps from scratch (nothing to
    restore) on both ranks, which log the same global loss at every step; the model
    learns (the last loss is below the first), so the losses compared below are those
    of real training, not of a frozen model."""
    ref = runs["reference"]
    assert not (ref / "losses-0-1.json").exists(), "the reference job was restarted"
    got = losses(ref, 0, 0)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert losses(ref, 1, 0) == got
    assert float.fromhex(got[STEPS]) < float.fromhex(got[1])
    rec = record(ref, 0, 0)
    assert (rec["start"], rec["source"], rec["end"]) == (0, None, STEPS)


def test_sigkilled_rank_restores_from_memory_bitwise(runs: dict[str, Path]) -> None:
    """Rank 1 SIGKILLed after step KILL_AT was checkpointed: the first attempt logged
    steps 1 to KILL_AT (the reference's losses: the runs are deterministic), torchrun's
    restart had the Trainer's `checkpointer.load()` restore step KILL_AT from every
    rank's own memory, losing no token, and steps KILL_AT+1 to STEPS repeat the
    uninterrupted run's losses bitwise (model, optimizer, LR schedulers, the Trainer's
    step and the dataloader's position all restored)."""
    ref, faulted = losses(runs["reference"], 0, 0), runs["faulted"]
    for rank in range(WORLD):
        assert losses(faulted, rank, 0) == {s: v for s, v in ref.items() if s <= KILL_AT}
        rec = record(faulted, rank, 1)
        assert (rec["attempt"], rec["start"], rec["source"], rec["lost_tokens"],
                rec["end"]) == (1, KILL_AT, "memory", 0, STEPS), rec
        assert rec["sources"] == {"memory": list(range(WORLD))}, rec
        assert losses(faulted, rank, 1) == after(ref, KILL_AT)
    assert not (faulted / "record-0-0.json").exists(), "the first attempt was not killed"


def test_fresh_job_restores_from_storage_bitwise(runs: dict[str, Path]) -> None:
    """The node's memory gone (a fresh job, another MOC_SHM_ROOT): `load_step=KILL_AT`
    on the faulted job's checkpoint folder restores from storage, every expert saved
    (K = all), and steps KILL_AT+1 to STEPS repeat the uninterrupted run's losses
    bitwise."""
    ref, storage = losses(runs["reference"], 0, 0), runs["storage"]
    for rank in range(WORLD):
        rec = record(storage, rank, 0)
        assert (rec["start"], rec["source"], rec["lost_tokens"], rec["end"]) == (
            KILL_AT, "storage", 0, STEPS), rec
        assert rec["sources"] == {"storage": list(range(WORLD))}, rec
        assert losses(storage, rank, 0) == after(ref, KILL_AT)


@pytest.mark.parametrize("fault", [(), ("--stop",)], ids=["SIGKILL", "SIGSTOP"])
def test_under_moc_run_a_lost_rank_is_replaced_and_the_survivor_keeps_its_process(
        runs: dict[str, Path], tmp_path: Path, fault: tuple[str, ...]) -> None:
    """In-job recovery for torchtitan's Trainer (issue 49): the driver under `moc run`
    (`--in-job`: `moc.integrations.torchtitan.run` builds the Trainer per generation).
    Rank 1 SIGKILLed, or SIGSTOPped (found by its host's watch after 5 s without a
    heartbeat, and killed), after step KILL_AT was checkpointed: its host starts a new
    process, rank 0 keeps its own, leaves the generation, builds the next generation's
    Trainer and restores step KILL_AT from its memory with the newcomer, and steps
    KILL_AT+1 to STEPS repeat the uninterrupted run's losses bitwise."""
    out = tmp_path / "in-job"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "MOC_SHM_ROOT": str(out / "shm"), "TITAN_DUMP_S": "400"}
    cmd = [sys.executable, "-m", "moc", "run", "--nproc", str(WORLD), "--hang-timeout",
           "5", str(DRIVER), "--in-job", "--dump", str(out / "dump"), "--out", str(out),
           "--steps", str(STEPS), "--interval", str(INTERVAL), "--k", "1", "--kill-at",
           str(KILL_AT), *fault]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    ref = losses(runs["reference"], 0, 0)
    for rank in range(WORLD):
        assert losses(out, rank, 0) == {s: v for s, v in ref.items() if s <= KILL_AT}
        rec = record(out, rank, 1)
        assert (rec["attempt"], rec["start"], rec["source"], rec["lost_tokens"],
                rec["end"]) == (1, KILL_AT, "memory", 0, STEPS), rec
        assert losses(out, rank, 1) == after(ref, KILL_AT)
    pid = {(rank, gen): int((out / f"pid-{rank}-{gen}").read_text())
           for rank in range(WORLD) for gen in (0, 1)}
    assert pid[0, 0] == pid[0, 1] == record(out, 0, 1)["pid"], pid  # the survivor's own
    assert pid[1, 0] != pid[1, 1] == record(out, 1, 1)["pid"], pid  # replaced
    assert not (out / "pid-0-2").exists(), "a second fault nobody injected"
