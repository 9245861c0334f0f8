"""MocTrainer in one process: a resume from storage equals an uninterrupted run bit for bit
(losses, lr, log history, epoch), Trainer's own checkpoints live beside moc's, and every
bad input of issue 32 is one clear error before anything trains. The SIGKILL, DDP and
memory resumes run in tests/test_examples.py (examples/hf_trainer.py under torchrun)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import moc

transformers = pytest.importorskip("transformers")
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from moc.integrations.hf_trainer import MocArguments, MocTrainer  # noqa: E402
from tests.checkpoint import hf_moe_zoo  # noqa: E402

pytestmark = pytest.mark.integration  # a real persist process per engine

VOCAB, LENGTH = 64, 8


def tiny(family: str = "mixtral") -> torch.nn.Module:
    """The zoo's tiny `family`, with attention dropout: a resume must bring the RNG back."""
    config = hf_moe_zoo.tiny_config(family)
    config.attention_dropout = 0.1
    torch.manual_seed(0)
    return hf_moe_zoo.model_class(family, config)(config)


def data(n: int = 20) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = (torch.randint(VOCAB, (n, 1), generator=g)
           + torch.randint(1, 4, (n, 1), generator=g) * torch.arange(LENGTH)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in ids]


class Losses(TrainerCallback):
    """Every step's exact loss and lr, as Trainer logged them (logging_steps=1)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[str, float]] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.seen[state.global_step] = (float(logs["loss"]).hex(), logs["learning_rate"])


def trainer(tmp_path, name: str, steps: int, *, model: str = "mixtral", ga: int = 2,
            batch: int = 2, moc_args: MocArguments | None = None, eval_data=None,
            **overrides):
    settings = dict(
        output_dir=str(tmp_path / name), max_steps=steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=ga, learning_rate=1e-2,
        lr_scheduler_type="constant_with_warmup", warmup_steps=3, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
        dataloader_pin_memory=False, seed=0)
    args = TrainingArguments(**{**settings, **overrides})
    t = MocTrainer(model=tiny(model), args=args, train_dataset=data(), eval_dataset=eval_data,
                   moc=moc_args or MocArguments(dir=tmp_path / name / "moc", interval=2))
    losses = Losses()
    t.add_callback(losses)
    return t, losses


def test_a_resume_from_storage_equals_the_uninterrupted_run_bit_for_bit(tmp_path):
    straight, seen = trainer(tmp_path, "straight", 9)
    straight.train()
    assert straight.recovery is None
    # 10 batches of 2 per epoch, GA 2: 5 optimizer steps per epoch; step 4 is mid-epoch.
    # The first run stops there (its final checkpoint, persisted at close); the second
    # resumes it from storage.
    first, _ = trainer(tmp_path, "resumed", 4)
    first.train()
    assert [r.step for r in first.checkpoint_results] == [2, 4]
    second, resumed = trainer(tmp_path, "resumed", 9)
    second.train()
    assert second.recovery is not None
    assert (second.recovery.step, second.recovery.source) == (4, "storage")
    assert sorted(resumed.seen) == list(range(5, 10))
    for step, (loss, lr) in resumed.seen.items():
        assert (loss, lr) == seen.seen[step], f"step {step}"
    # Trainer's state came back whole: the log history of steps 1-4 is in it.
    logged = [e["step"] for e in second.state.log_history if "loss" in e]
    assert logged == list(range(1, 10))
    assert math.isclose(second.state.epoch, straight.state.epoch)
    assert second.state.global_step == 9


def test_trainer_checkpoints_live_beside_and_the_restart_takes_mocs(tmp_path):
    t, _ = trainer(tmp_path, "both", 5, save_strategy="steps", save_steps=3)
    t.train()
    assert (tmp_path / "both" / "checkpoint-3" / "trainer_state.json").exists()
    steps = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "both" / "moc").glob("step-*"))
    assert steps[-1] == 5  # (4's persist may be skipped on a busy machine: one in flight)
    again, _ = trainer(tmp_path, "both", 7, save_strategy="steps", save_steps=3)
    again.train()
    assert again.recovery is not None and again.recovery.step == 5  # moc's, not checkpoint-3


def test_resume_from_checkpoint_path_is_refused_when_moc_has_newer(tmp_path):
    t, _ = trainer(tmp_path, "fork", 4, save_strategy="steps", save_steps=2)
    t.train()
    again, _ = trainer(tmp_path, "fork", 6, save_strategy="steps", save_steps=2)
    with pytest.raises(ValueError, match=r"already holds step 4 .* resume_from_checkpoint=None"):
        again.train(resume_from_checkpoint=str(tmp_path / "fork" / "checkpoint-2"))


def test_changed_gradient_accumulation_is_one_clear_error(tmp_path):
    trainer(tmp_path, "ga", 2)[0].train()
    again, _ = trainer(tmp_path, "ga", 4, ga=4)
    with pytest.raises(ValueError) as e:
        again.train()
    msg = str(e.value)
    assert "\n" not in msg
    assert "gradient_accumulation_steps=2, this run has gradient_accumulation_steps=4" in msg


def test_changed_batch_size_is_refused(tmp_path):
    trainer(tmp_path, "bs", 2)[0].train()
    with pytest.raises(ValueError, match="train_batch_size=2, this run has train_batch_size=4"):
        trainer(tmp_path, "bs", 4, batch=4)[0].train()


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    trainer(tmp_path, "model", 2)[0].train()
    with pytest.raises(moc.IncompatibleCheckpointError, match="different model"):
        trainer(tmp_path, "model", 4, model="qwen2_moe")[0].train()


@pytest.mark.parametrize(("overrides", "match"), [
    ({"save_strategy": "no"}, "save_strategy='no' gives none"),
    ({"save_strategy": "epoch"}, "save_strategy='epoch' gives none"),
    ({"ignore_data_skip": True}, "ignore_data_skip=True"),
    ({"auto_find_batch_size": True}, "auto_find_batch_size=True"),
])
def test_conflicting_settings_are_refused_before_training(tmp_path, overrides, match):
    t, _ = trainer(tmp_path, "conflict", 2, moc_args=MocArguments(dir=tmp_path / "m"),
                   **overrides)
    with pytest.raises(ValueError, match=match):
        t.train()
    assert not (tmp_path / "m").exists()  # nothing was written


def test_the_interval_defaults_to_trainers_save_steps(tmp_path):
    t, _ = trainer(tmp_path, "steps", 4, save_strategy="steps", save_steps=2,
                   moc_args=MocArguments())  # dir: <output_dir>/moc
    t.train()
    assert [r.step for r in t.checkpoint_results] == [2, 4]
    assert (tmp_path / "steps" / "moc" / "step-00000004" / "manifest.json").exists()


def test_a_checkpoint_not_written_by_moc_trainer_is_refused(tmp_path):
    own, _ = trainer(tmp_path, "own", 3)  # the same model and optimizer, another loop
    own.create_optimizer()
    ckpt = moc.TwoLevelCheckpointer(own.model, own.optimizer, tmp_path / "own" / "moc",
                                    experts=moc.ExpertSpec.infer(own.model), interval=1)
    ckpt.save(1, {"epoch": 0}, final=True)
    ckpt.close()
    with pytest.raises(ValueError, match="not written by MocTrainer"):
        trainer(tmp_path, "own", 3)[0].train()


def test_the_saved_trainer_state_is_json_of_trainers_own_dataclass(tmp_path):
    """The state travels as Trainer's own JSON (as trainer_state.json): a field Trainer adds
    in a later release comes along without a change here."""
    t, _ = trainer(tmp_path, "state", 2)
    t.train()
    extra = json.loads((tmp_path / "state" / "moc" / "step-00000002" / "manifest.json")
                       .read_text())["extra"]["trainer"]
    state = json.loads(extra["state"])
    assert set(state) == {f.name for f in dataclasses.fields(t.state)}
    assert state["global_step"] == 2


def test_resume_true_moves_a_run_from_trainers_checkpoints_onto_moc(tmp_path):
    """No moc checkpoint yet: `resume_from_checkpoint=True` takes Trainer's last
    checkpoint-N (Trainer's own loaders), and moc goes on from there."""
    old, _ = trainer(tmp_path, "move", 4, save_strategy="steps", save_steps=2,
                     moc_args=MocArguments(dir=tmp_path / "old-moc", interval=2))
    old.train()
    moved, seen = trainer(tmp_path, "move", 6, save_strategy="steps", save_steps=2,
                          moc_args=MocArguments(dir=tmp_path / "new-moc", interval=2))
    moved.train(resume_from_checkpoint=True)
    assert moved.recovery is None  # not moc's: Trainer's checkpoint-4
    assert sorted(seen.seen) == [5, 6]
    assert [r.step for r in moved.checkpoint_results] == [6]


def test_resume_true_on_an_empty_directory_is_a_fresh_start(tmp_path):
    t, seen = trainer(tmp_path, "fresh", 2)
    t.train(resume_from_checkpoint=True)
    assert t.recovery is None and sorted(seen.seen) == [1, 2]


def test_a_checkpoint_at_an_epochs_end_holds_the_epochs_evaluation(tmp_path):
    """Trainer evaluates after `on_epoch_end` (its second `_maybe_log_save_evaluate` call
    for the step), and the evaluation's dataloader draws from the RNG: a checkpoint at
    the epoch's last step must be taken after it, or the resume's log history lacks the
    evaluation and every later loss differs (the first version saved before it)."""
    epoch = {"eval_strategy": "epoch", "per_device_eval_batch_size": 4}
    straight, seen = trainer(tmp_path, "straight", 8, eval_data=data(8), **epoch)
    straight.train()
    first, _ = trainer(tmp_path, "resumed", 5, eval_data=data(8), **epoch)  # 5: epoch 1's end
    first.train()
    second, resumed = trainer(tmp_path, "resumed", 8, eval_data=data(8), **epoch)
    second.train()
    assert second.recovery is not None and second.recovery.step == 5
    assert sorted(resumed.seen) == [6, 7, 8]
    for step, value in resumed.seen.items():
        assert value == seen.seen[step], f"step {step}"
    evals = [e["step"] for e in second.state.log_history if "eval_loss" in e]
    assert evals == [e["step"] for e in straight.state.log_history if "eval_loss" in e]
    assert 5 in evals


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_an_early_stop_is_the_final_checkpoint(tmp_path):
    t, _ = trainer(tmp_path, "stop", 8)
    t.add_callback(StopAt(3))
    t.train()
    assert [r.step for r in t.checkpoint_results] == [2, 3]
    last = t.checkpoint_results[-1]
    assert last.n_experts_saved == 2 * 4  # final: every expert of both MoE layers


def test_a_finished_run_started_again_trains_nothing(tmp_path):
    trainer(tmp_path, "done", 4)[0].train()  # 4 of the 5 steps of an epoch
    again, seen = trainer(tmp_path, "done", 4)
    out = again.train()
    assert again.recovery is not None and again.recovery.step == 4
    assert seen.seen == {}  # Trainer's own resume would train a step 5 here
    assert out.global_step == 4 and again.state.global_step == 4


def test_model_init_is_refused(tmp_path):
    t, _ = trainer(tmp_path, "init", 2)
    t.model_init = lambda *a: tiny()
    with pytest.raises(ValueError, match="model_init"):
        t.train()
