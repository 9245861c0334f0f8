"""`moc run` and `moc.run`: in-job recovery for a loop of one's own (issue 49).
examples/own_loop.py (its own MoE, DDP on gloo, `moc.TwoLevelCheckpointer`) as its header
runs it: real processes, a real SIGKILL and SIGSTOP, every loss compared bitwise with
the run without faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moc
from moc.model import ModelConfig, Transformer
from tests.procs import moc_here

pytestmark = pytest.mark.integration  # real processes: moc run, torchrun, the ranks

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "own_loop.py"


def _run(*argv: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "PYTHONPATH": path})
    assert r.returncode == 0, f"{argv} exited {r.returncode}:\n{r.stderr[-4000:]}"
    return r


def moc_run(out: Path, *extra: str, options: tuple[str, ...] = ()
            ) -> subprocess.CompletedProcess:
    return _run("-m", "moc", "run", "--nproc", "2", *options, str(EXAMPLE), "--out",
                str(out), *extra, cwd=out.parent)


def lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "losses.jsonl").read_text().splitlines()]


def assert_exact(out: Path, straight: Path) -> None:
    r = _run(str(EXAMPLE), "--compare", str(straight), str(out), cwd=out.parent)
    assert "every loss bitwise equal" in r.stdout
    assert sorted({e["step"] for e in lines(out)}) == list(range(1, 21))


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("own") / "straight"
    moc_run(out)
    return out


def test_a_killed_rank_is_replaced_and_the_survivor_keeps_its_process(tmp_path, straight):
    """Rank 1 SIGKILLed at step 12: its host starts a new process, rank 0 leaves the
    generation inside `moc.run`, rejoins and enters `train` again in the same process;
    both restore step 10 from memory, and every loss is the run without faults'."""
    out = tmp_path / "killed"
    r = moc_run(out, "--fault-at", "12")
    assert_exact(out, straight)
    assert "generation 1: resumed from step 10 (memory), lost tokens 0" in r.stdout, r.stdout
    assert "moc run: rank 1: process" in r.stderr and "died (SIGKILL)" in r.stderr
    assert "moc: rank 0: lost a peer" in r.stderr, r.stderr[-3000:]
    logged = lines(out)
    assert {e["generation"] for e in logged} == {0, 1}
    assert len({e["pid"] for e in logged}) == 1  # rank 0: one process throughout


@pytest.mark.slow  # CI time: the hang detector waits its 5 s floor
def test_a_stopped_rank_is_replaced_by_its_spare_without_code_in_the_loop(tmp_path,
                                                                           straight):
    """SIGSTOP at step 14: no heartbeat (the loop has no moc code for it: the heartbeat
    counts the optimizer's steps), the host kills it and wakes its spare."""
    out = tmp_path / "stopped"
    r = moc_run(out, "--hang-at", "14", options=("--spares", "1"))
    assert_exact(out, straight)
    assert "hung (no heartbeat for" in r.stderr and "replaced by its spare" in r.stderr
    assert len({e["pid"] for e in lines(out)}) == 1


NODES = ("--nodes", "2", "--nproc", "1", "--spares", "1")
"""Two simulated machines of one rank each, each rank with a spare process."""


def faulted(out: Path, straight: Path, faults: list[str]) -> subprocess.CompletedProcess:
    """The example under `moc run` on NODES, the i-th fault (KIND:RANK:STEP) striking in
    generation i; every loss the run without faults', and each fault's rank alone a new
    process in the next generation."""
    r = moc_run(out, *(a for f in faults for a in ("--fault", f)), options=NODES)
    assert_exact(out, straight)
    pids: dict[int, dict[int, int]] = {}
    for e in map(json.loads, (out / "pids.jsonl").read_text().splitlines()):
        pids.setdefault(e["generation"], {})[e["rank"]] = e["pid"]
    assert sorted(pids) == list(range(len(faults) + 1)), pids
    for g, fault in enumerate(faults):
        hit = int(fault.split(":")[1])
        assert [pids[g + 1][q] == pids[g][q] for q in (0, 1)] == [q != hit for q in (0, 1)], (
            g, fault, pids)
    return r


def test_on_two_nodes_a_killed_rank_of_either_is_replaced_and_the_other_keeps_its_process(
        tmp_path, straight):
    """`moc run --nodes 2`: one torchrun agent per simulated machine, the launcher
    serving the job's store. Rank 1, then rank 0, SIGKILLed: each time only the killed
    rank's process is new, and every loss is bitwise."""
    r = faulted(tmp_path / "two", straight, ["kill:1:7", "kill:0:12"])
    assert r.stderr.count("died (SIGKILL); replaced by its spare") == 2, r.stderr[-3000:]


@pytest.mark.slow  # CI time: the hang detector waits its 5 s floor
def test_on_two_nodes_three_kills_and_a_stop_leave_the_survivors_processes(tmp_path,
                                                                           straight):
    """Issue 49's run: on 2 simulated nodes with a spare, a rank SIGKILLed 3 times (one
    of them rank 0) and then one SIGSTOPped; the survivors' pids never change, every
    loss is bitwise (the downtimes against `moc train`'s: `moc bench injob`)."""
    r = faulted(tmp_path / "four", straight, ["kill:1:7", "kill:0:12", "kill:1:14",
                                              "stop:0:18"])
    assert r.stderr.count("died (SIGKILL); replaced by its spare") == 3, r.stderr[-3000:]
    assert "rank 0: process" in r.stderr and "hung (no heartbeat for" in r.stderr


def test_the_same_script_under_plain_torchrun_enters_train_once(tmp_path, straight):
    """Without a rank host `moc.run` joins the job as `moc.init_distributed` does and
    calls `train` once: the same losses as under `moc run`."""
    out = tmp_path / "torchrun"
    _run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLE), "--out", str(out), cwd=tmp_path)
    assert_exact(out, straight)
    assert {e["generation"] for e in lines(out)} == {0}


@pytest.mark.parametrize(("args", "says"), [
    (["--nproc", "0", "x.py"], "--nproc must be >= 1, got 0"),
    (["--hang-timeout", "0", "x.py"], "--hang-timeout must be > 0, got 0.0"),
    (["missing.py"], "missing.py: no such file; give the path of your training script"),
    (["--nodes", "0", "x.py"], "--nodes must be >= 1, got 0"),
    (["--spare-nodes", "1", "x.py"], "--spare-nodes 1 stands machines by for in-job "
                                     "recovery across machines: it needs --nodes 2 or more"),
    (["--nodes", "2", "--machine-restart-s", "-1", "x.py"],
     "--machine-restart-s -1 starts a lost machine again"),
])
def test_bad_options_of_moc_run_are_one_line(args, says, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    code, err = moc_here(capsys, "run", *args)
    assert code == 2 and says in err, err


def test_run_in_one_process_enters_train_once_and_closes_its_engine(tmp_path):
    """No torchrun, no host: one generation, the engine made for it and closed after
    (the directory's lock free again). That a closed engine's routing recorder leaves
    the model is tests/checkpoint/test_routing.py's."""
    config = ModelConfig(vocab_size=16, seq_len=8, d_model=8, n_layers=1, n_heads=1,
                         d_ffn=8, n_experts=2)
    model = Transformer(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x_BT = torch.zeros(1, 8, dtype=torch.long)
    made: list[moc.Checkpointer] = []

    def engine() -> moc.Checkpointer:
        made.append(moc.Checkpointer(model, optimizer, tmp_path / "ckpt"))
        return made[-1]

    def train(gen: moc.Generation) -> int:
        assert (gen.number, gen.rank, gen.world_size, gen.replaced) == (0, 0, 1, [])
        assert gen.engine is made[0] and gen.engine.restore() is None
        model(x_BT, x_BT).loss.backward()
        optimizer.step()
        gen.engine.save(1, {})
        return 7

    assert moc.run(train, engine=engine) == 7
    assert len(made) == 1 and (tmp_path / "ckpt" / "step-00000001" / "manifest.json").exists()
    # Closed: the directory's lock is free for the next engine.
    moc.Checkpointer(model, optimizer, tmp_path / "ckpt").close()


def test_an_engine_train_builds_is_owned_by_run_and_closed_once(tmp_path):
    """`Generation.own`: an engine made inside `train` (as torchtitan's Trainer makes
    its own) is closed by `run` when `train` returns, as `run`'s own would be; a second
    engine for one generation is refused."""
    config = ModelConfig(vocab_size=16, seq_len=8, d_model=8, n_layers=1, n_heads=1,
                         d_ffn=8, n_experts=2)
    model = Transformer(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(gen: moc.Generation) -> None:
        assert gen.engine is None
        gen.own(moc.Checkpointer(model, optimizer, tmp_path / "ckpt"))
        other = moc.Checkpointer(model, optimizer, tmp_path / "other")
        with pytest.raises(ValueError, match="already has its engine"):
            gen.own(other)
        other.close()
        gen.engine.save(1, {})

    moc.run(train)
    assert (tmp_path / "ckpt" / "step-00000001" / "manifest.json").exists()
    moc.Checkpointer(model, optimizer, tmp_path / "ckpt").close()  # run closed it


def test_a_process_group_made_before_run_under_a_host_is_one_clear_error(tmp_path,
                                                                        monkeypatch):
    """Under a host `moc.run` forms the default group in each generation; a script that
    made one first would have failed inside torch ("already initialized")."""
    import torch.distributed as dist

    from moc.injob.membership import ENV_FD

    monkeypatch.setenv(ENV_FD, "99")  # as a rank host sets it
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="remove the script's init_process_group"):
            moc.run(lambda gen: None)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # CI time: moc train's machine losses are in CI (tests/train/test_injob*)
@pytest.mark.parametrize("taken_over", [("--spare-nodes", "1"), ("--machine-restart-s", "1")],
                         ids=["spare node", "started again"])
def test_on_two_nodes_a_lost_machine_is_taken_over_and_the_other_keeps_its_process(
        tmp_path, straight, taken_over):
    """Rank 1's whole simulated machine lost at step 12 (its agent, host, spare and
    memory: `lose_machine`): a spare node, or the machine started again, adopts rank 1
    from the replica on node 0; rank 0 keeps its process, and every loss is bitwise."""
    out = tmp_path / "machine"
    r = moc_run(out, "--fault", "machine:1:12",
                options=("--nodes", "2", "--nproc", "1", *taken_over))
    assert_exact(out, straight)
    pids: dict[int, dict[int, int]] = {}
    for e in map(json.loads, (out / "pids.jsonl").read_text().splitlines()):
        pids.setdefault(e["generation"], {})[e["rank"]] = e["pid"]
    assert pids[1][0] == pids[0][0] and pids[1][1] != pids[0][1], pids
    assert "node 1 lost (its agent SIGKILLed)" in r.stderr, r.stderr[-3000:]


# -- MocTrainer (transformers.Trainer) under moc run: examples/hf_trainer.py --in-job ------

HF_EXAMPLE = REPO / "examples" / "hf_trainer.py"


def hf_run(out: Path, *extra: str, options: tuple[str, ...] = ("--nproc", "2")
           ) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """The Trainer example under `moc run`, `train()` entered per generation: the
    process and its JSON lines."""
    pytest.importorskip("transformers")
    r = _run("-m", "moc", "run", *options, str(HF_EXAMPLE), "--dir", str(out), "--steps",
             "30", "--in-job", *extra, cwd=out.parent, timeout=400)
    return r, [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]


@pytest.fixture(scope="module")
def hf_straight(tmp_path_factory) -> dict[int, str]:
    _, logged = hf_run(tmp_path_factory.mktemp("hf") / "straight")
    return {e["step"]: e["hex"] for e in logged if "step" in e}


def assert_trainer_exact(logged: list[dict], straight: dict[int, str]) -> None:
    steps = [e for e in logged if "step" in e]
    assert [e["step"] for e in steps] == list(range(1, 31))  # none twice, none skipped
    assert all(e["hex"] == straight[e["step"]] for e in steps)


def test_moc_trainer_under_moc_run_keeps_the_survivors_process(tmp_path, hf_straight):
    """`MocTrainer` with `MocArguments(engine=gen.engine)`: rank 1 SIGKILLed in step 17,
    rank 0 leaves its `trainer.train()`, rejoins and builds a new Trainer over the same
    model and optimizer; both resume step 16 from memory, and every loss is the
    uninterrupted run's, bitwise, rank 0 logging from one process throughout."""
    r, logged = hf_run(tmp_path / "killed", "--fault-at", "17")
    assert_trainer_exact(logged, hf_straight)
    assert [e for e in logged if "resumed" in e] == [
        {"resumed": 16, "source": "memory", "recovery_s": pytest.approx(0, abs=5),
         "lost_tokens": 0}]
    assert "died (SIGKILL)" in r.stderr and "moc: rank 0: lost a peer" in r.stderr
    assert len({e["pid"] for e in logged if "step" in e}) == 1


@pytest.mark.slow  # CI time: the hang detector waits its 5 s floor
def test_moc_trainer_on_two_nodes_survives_three_kills_and_a_stop(tmp_path, hf_straight):
    """Issue 49's run for `MocTrainer`: 2 simulated nodes with a spare each; rank 1, 0
    and 1 SIGKILLed, then rank 0 SIGSTOPped, one fault per generation: each resumes
    from memory, rank 0's logging process changes only when rank 0 was the one hit,
    and every loss is bitwise."""
    r, logged = hf_run(tmp_path / "four", "--fault", "kill:1:8", "--fault", "kill:0:14",
                       "--fault", "kill:1:20", "--fault", "stop:0:26", options=NODES)
    assert_trainer_exact(logged, hf_straight)
    assert [(e["resumed"], e["source"]) for e in logged if "resumed" in e] == [
        (7, "memory"), (13, "memory"), (19, "memory"), (25, "memory")]
    pids = [e["pid"] for e in logged if "step" in e]
    # rank 0 logs: new in the generations after the faults that hit rank 0 (steps 14, 26)
    assert len(set(pids[:13])) == len(set(pids[13:25])) == len(set(pids[25:])) == 1
    assert len({pids[0], pids[13], pids[25]}) == 3
    assert r.stderr.count("died (SIGKILL); replaced by its spare") == 3
    assert "hung (no heartbeat for" in r.stderr
