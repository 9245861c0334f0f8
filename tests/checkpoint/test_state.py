"""A checkpoint holds the whole training state: parameters, persistent buffers, optimizer
state and param groups, RNG; on both engines, through snapshots and persists."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from moc.checkpoint.errors import IncompatibleCheckpointError
from moc.checkpoint.optimizers import TorchOptimizerState
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.recovery import CheckpointReader
from moc.checkpoint.spec import PARAM_GROUPS_KEY, ExpertSpec, rng_keys, rng_rank_of
from moc.checkpoint.state import decode_param_groups
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.sync import Checkpointer
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.model import ModelConfig, Transformer
from moc.model.transformer import Router
from tests.engines import save_now

CFG = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)
ENGINES = ["sync", pytest.param("twolevel-memory", marks=pytest.mark.integration),
           pytest.param("twolevel-storage", marks=pytest.mark.integration)]


@pytest.fixture(autouse=True)
def shm(tmp_path, monkeypatch):
    """Two-level snapshots under the test's own directory, never in /dev/shm."""
    monkeypatch.setenv("MOC_SHM_ROOT", str(tmp_path / "shm"))


def _router(model: torch.nn.Module) -> Router:
    return next(m for m in model.modules() if isinstance(m, Router))


def _model(seed: int, buffers: bool = True, n_bias: int = CFG.n_experts) -> Transformer:
    """The tiny MoE with, on its router, a persistent bias (aux-loss-free balancing)
    and a non-persistent scratch buffer."""
    torch.manual_seed(seed)
    model = Transformer(CFG)
    if buffers:
        router = _router(model)
        router.register_buffer("bias_E", torch.zeros(n_bias))
        router.register_buffer("scratch_E", torch.zeros(CFG.n_experts), persistent=False)
    return model


def _groups(model: torch.nn.Module, *, reverse: bool = False) -> list[dict]:
    """Matrices decayed, vectors not: two groups with different weight_decay."""
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return groups[::-1] if reverse else groups


def _optim(model: torch.nn.Module, **kw) -> tuple[torch.optim.AdamW, LambdaLR]:
    opt = torch.optim.AdamW(_groups(model, reverse=kw.pop("reverse", False)), lr=1e-2, **kw)
    return opt, LambdaLR(opt, lambda s: 0.7 ** s)


def _step(model, opt, sched, step: int) -> float:
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(step))
    out = model(idx, idx)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    router = _router(model)
    if hasattr(router, "bias_E"):
        with torch.no_grad():  # updated in place from the load, as aux-loss-free balancing
            router.bias_E.mul_(0.5).add_(out.tokens_per_expert[0].float())
            router.scratch_E.add_(1.0)
    return out.loss.item()


def _engine(kind: str, root, model, opt):
    if kind == "sync":
        return Checkpointer(model, opt, root, policy=PECPolicy.full())
    return TwoLevelCheckpointer(model, opt, root, policy=PECPolicy.full(),
                                persist_policy="wait")


def _close(kind: str, ckpt) -> None:
    if kind == "twolevel-memory":
        ckpt.close(keep_snapshots=True)  # as after a crash: the snapshots survive
    else:
        ckpt.close()


def _save_after(kind: str, root, steps: int, model=None, opt=None, sched=None):
    """Train `steps` steps, checkpoint (the scheduler in extra_state, as a user would)."""
    if model is None:
        model = _model(0)
        opt, sched = _optim(model)
    for step in range(1, steps + 1):
        _step(model, opt, sched, step)
    ckpt = _engine(kind, root, model, opt)
    assert save_now(ckpt, steps, {"sched": sched.state_dict()}).ok
    _close(kind, ckpt)
    return model, opt, sched


def _restore(kind: str, root, model, opt, sched=None):
    ckpt = _engine(kind, root, model, opt)
    report = ckpt.restore()
    ckpt.close()
    if sched is not None:
        sched.load_state_dict(report.extra["sched"])
    return report


@pytest.mark.parametrize("kind", ENGINES)
def test_a_lambda_lr_schedule_resumes_at_the_saved_lr_and_continues_bitwise(tmp_path, kind):
    model, opt, sched = _save_after(kind, tmp_path / "ckpt", 3)
    saved_lr = [g["lr"] for g in opt.param_groups]
    want = [_step(model, opt, sched, s) for s in range(4, 7)]

    fresh = _model(1)
    fresh_opt, fresh_sched = _optim(fresh)
    report = _restore(kind, tmp_path / "ckpt", fresh, fresh_opt, fresh_sched)
    assert report.step == 3
    assert [g["lr"] for g in fresh_opt.param_groups] == saved_lr
    assert [g["initial_lr"] for g in fresh_opt.param_groups] == [1e-2, 1e-2]
    got = [_step(fresh, fresh_opt, fresh_sched, s) for s in range(4, 7)]
    assert got == want  # bitwise


@pytest.mark.parametrize("kind", ENGINES)
def test_persistent_buffers_come_back_and_non_persistent_ones_stay_out(tmp_path, kind):
    model, opt, sched = _save_after(kind, tmp_path / "ckpt", 3)
    saved_bias = _router(model).bias_E.clone()
    assert saved_bias.abs().sum() > 0
    entries = Manifest.load(tmp_path / "ckpt", 3).entries
    assert [k for k in entries if k.startswith("buffer/")] == [
        "buffer/layers.0.ffn.router.bias_E"]

    fresh = _model(1)
    fresh_opt, fresh_sched = _optim(fresh)
    _router(fresh).scratch_E.fill_(-1.0)
    _restore(kind, tmp_path / "ckpt", fresh, fresh_opt, fresh_sched)
    assert torch.equal(_router(fresh).bias_E, saved_bias)
    assert torch.equal(_router(fresh).scratch_E, torch.full((CFG.n_experts,), -1.0))
    for s in range(4, 6):
        _step(model, opt, sched, s)
        _step(fresh, fresh_opt, fresh_sched, s)
    assert torch.equal(_router(fresh).bias_E, _router(model).bias_E)


@pytest.mark.parametrize("kind", ENGINES)
def test_param_groups_are_matched_by_their_parameters_not_their_position(tmp_path, kind):
    _save_after(kind, tmp_path / "ckpt", 2)
    fresh = _model(1)
    vectors = [p for p in fresh.parameters() if p.dim() < 2]
    matrices = [p for p in fresh.parameters() if p.dim() >= 2]
    # Built in the other order, with another weight decay and betas for every group.
    fresh_opt = torch.optim.AdamW([{"params": vectors}, {"params": matrices}], lr=1e-2,
                                  weight_decay=0.5, betas=(0.5, 0.5))
    _restore(kind, tmp_path / "ckpt", fresh, fresh_opt)
    assert [g["weight_decay"] for g in fresh_opt.param_groups] == [0.0, 0.1]
    assert [g["betas"] for g in fresh_opt.param_groups] == [(0.9, 0.999)] * 2
    assert fresh_opt.param_groups[0]["params"] == vectors  # the parameters stay


def test_the_param_groups_key_holds_canonical_json_of_every_group(tmp_path):
    _save_after("sync", tmp_path / "ckpt", 2)
    reader = CheckpointReader(tmp_path / "ckpt", Manifest.load(tmp_path / "ckpt", 2))
    groups = decode_param_groups(reader.get(PARAM_GROUPS_KEY))
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert groups[0]["betas"] == [0.9, 0.999] and "initial_lr" in groups[0]
    assert "params" in groups[1] and "norm.weight" in groups[1]["params"]
    # An expert tensor is named by its stem: the same whatever the layout.
    stems = {p.stem for p in ExpertSpec.infer(_model(1)).params}
    assert stems <= set(groups[0]["params"])


def test_a_different_number_of_param_groups_is_refused_clearly(tmp_path):
    _save_after("sync", tmp_path / "ckpt", 2)
    fresh = _model(1)
    one_group = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with pytest.raises(IncompatibleCheckpointError, match="2 param groups, this optimizer 1"):
        _restore("sync", tmp_path / "ckpt", fresh, one_group)


def test_a_buffer_of_another_shape_is_refused(tmp_path):
    _save_after("sync", tmp_path / "ckpt", 2)
    fresh = _model(1, n_bias=CFG.n_experts + 1)
    with pytest.raises(IncompatibleCheckpointError, match="bias_E"):
        _restore("sync", tmp_path / "ckpt", fresh, _optim(fresh)[0])


class ThreeMethods:
    """A user's OptimizerState of the original protocol: no hyperparameter hooks."""

    def __init__(self, optimizer, model) -> None:
        self.inner = TorchOptimizerState(optimizer, model)

    def owned_names(self):
        return self.inner.owned_names()

    def local_state(self):
        return self.inner.local_state()

    def load_local_state(self, states) -> None:
        self.inner.load_local_state(states)


def test_a_checkpoint_without_buffers_or_param_groups_still_restores(tmp_path, caplog):
    """What a checkpoint written before this change holds: no buffer keys (the model had
    none, or they were not saved) and no param groups (the optimizer gave none)."""
    model = _model(0, buffers=False)
    opt, sched = _optim(model)
    for step in (1, 2):
        _step(model, opt, sched, step)
    ckpt = Checkpointer(model, ThreeMethods(opt, model), tmp_path, policy=PECPolicy.full())
    assert save_now(ckpt, 2).ok
    keys = Manifest.load(tmp_path, 2).entries
    assert PARAM_GROUPS_KEY not in keys and not any(k.startswith("buffer/") for k in keys)

    fresh = _model(1)
    _router(fresh).bias_E.fill_(3.0)
    fresh_opt, _ = _optim(fresh)
    with caplog.at_level(logging.WARNING, logger="moc.checkpoint.state"):
        assert _restore("sync", tmp_path, fresh, fresh_opt).step == 2
    assert torch.equal(_router(fresh).bias_E, torch.full((CFG.n_experts,), 3.0))
    assert [g["lr"] for g in fresh_opt.param_groups] == [1e-2, 1e-2]  # kept
    assert "bias_E" in caplog.text and PARAM_GROUPS_KEY in caplog.text
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_a_persistent_buffer_inside_the_experts_is_refused_at_construction(tmp_path):
    model = _model(0)
    experts = next(m for n, m in model.named_modules() if n.endswith("experts"))
    experts.register_buffer("load_E", torch.zeros(CFG.n_experts))
    with pytest.raises(ValueError, match=r"'layers\.0\.ffn\.experts\.load_E'.*persistent=False"):
        Checkpointer(model, torch.optim.AdamW(model.parameters()), tmp_path)
    experts.register_buffer("load_E", torch.zeros(CFG.n_experts), persistent=False)
    Checkpointer(model, torch.optim.AdamW(model.parameters()), tmp_path)  # not state: fine


def test_what_a_save_takes_aside_is_its_own_values_and_never_reads_them_back_early():
    """`RankState.capture` at save(): buffers cloned and param groups as JSON values, a
    tensor learning rate (a capturable optimizer's) copied aside, not read: the values
    are those of the save even when the loop changes them before the plan encodes them,
    and the encoded groups are the same bytes as a direct encoding of that moment."""
    from moc.checkpoint.optimizers import as_optimizer_state
    from moc.checkpoint.state import RankState

    torch.manual_seed(0)
    model = Transformer(ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32,
                                    n_experts=4))
    model.register_buffer("seen", torch.zeros(3))
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    opt.param_groups[0]["schedule"] = [1, 2]  # a mutable entry a loop keeps in its group
    state = RankState(model, as_optimizer_state(opt, model), ExpertSpec.infer(model), 0)
    direct = state.flatten()[PARAM_GROUPS_KEY].clone()
    taken = state.capture()
    opt.param_groups[0]["lr"].fill_(5.0)  # the loop moves on before the plan runs
    opt.param_groups[0]["schedule"][0] = 9
    model.seen.add_(1)
    later = taken.tensors()
    assert torch.equal(later[PARAM_GROUPS_KEY], direct)
    assert decode_param_groups(later[PARAM_GROUPS_KEY])[0]["lr"] == pytest.approx(1e-3)
    assert torch.equal(later["buffer/seen"], torch.zeros(3))
    # The slots are sized without reading a value: the same keys and nearly the bytes.
    sizing = state.sizing()
    assert sizing.keys() == state.flatten().keys()


def _zero_is_adapted_as_its_partition(rank: int, world: int) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from moc.checkpoint.optimizers import as_optimizer_state

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
    state = as_optimizer_state(zero, model)
    return (isinstance(state, TorchOptimizerState) and state.optimizer is zero.optim
            and state.groups is zero)


@pytest.mark.integration  # two gloo ranks
def test_a_users_zero_optimizer_is_checkpointed_as_its_local_partition():
    """ZeRO is recognised without moc importing torch.distributed.optim (1.1 s of every
    process's start): a user's ZeRO optimizer has imported it."""
    from tests.distributed import run_ranks

    assert run_ranks(_zero_is_adapted_as_its_partition, 2) == [True, True]


# -- the RNG of every generator a rank uses ------------------------------------------------


def test_rng_keys_name_each_accelerator_by_its_place_among_the_ranks_devices_of_its_type():
    devices = [torch.device(d) for d in ("cuda:3", "cpu", "meta", "cuda:1", "xpu:0", "cuda:3")]
    keys = rng_keys(2, devices)
    assert keys == {"rng/rank=2": torch.device("cpu"),
                    "rng/rank=2/cuda=0": torch.device("cuda:1"),
                    "rng/rank=2/cuda=1": torch.device("cuda:3"),
                    "rng/rank=2/xpu=0": torch.device("xpu:0")}
    assert rng_keys(0, [torch.device("cpu"), torch.device("meta")]) == {
        "rng/rank=0": torch.device("cpu")}  # meta has no generator
    assert [rng_rank_of(k) for k in keys] == [2, 2, 2, 2]
    assert rng_rank_of("rng/rank=12") == 12
    for other in ("param/rng/rank=1", "optim/w/step", "rng/rank=x", "rng/rank=1/cuda"):
        assert rng_rank_of(other) is None, other


class FakeAccelerator:
    """`torch.cuda`'s two RNG functions on a machine without CUDA: one generator per
    device index, its state `size` bytes; every install recorded."""

    def __init__(self, size: int = 16) -> None:
        self.states: dict[int, torch.Tensor] = {}
        self.size = size
        self.installed: list[int] = []

    def state(self, index: int) -> torch.Tensor:
        return self.states.setdefault(index, torch.full((self.size,), index, dtype=torch.uint8))

    def get_rng_state(self, device: torch.device) -> torch.Tensor:
        return self.state(device.index).clone()

    def set_rng_state(self, new_state: torch.Tensor, device: torch.device) -> None:
        assert new_state.shape == (self.size,)
        self.states[device.index] = new_state.clone()
        self.installed.append(device.index)


@pytest.fixture
def accelerator(monkeypatch):
    """A rank whose parameters live on the host, as if they also lived on `cuda:<i>`
    (set `accelerator.index`; None: on no accelerator) with a `FakeAccelerator`'s
    generators: the rank's generator keys are computed from that device list (patched
    where `RankState` and `load_rank_state` look it up)."""
    from moc.checkpoint.state import rank as state_module

    fake = FakeAccelerator()
    fake.index = None
    monkeypatch.setattr(torch.cuda, "get_rng_state", fake.get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", fake.set_rng_state)
    real = state_module.rank_generators

    def generators(rank, named):
        devices = [] if fake.index is None else [torch.device("cuda", fake.index)]
        return {**real(rank, named), **rng_keys(rank, devices)}

    monkeypatch.setattr(state_module, "rank_generators", generators)
    return fake


class DropoutMoE(torch.nn.Module):
    """Two experts behind dropout: its forward draws from the CPU generator."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 8)
        self.drop = torch.nn.Dropout(0.5)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 1) for _ in range(2))

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        h_NH = self.drop(self.proj(x_ND))
        return sum(expert(h_NH) for expert in self.experts)


def _rng_model(seed: int) -> DropoutMoE:
    torch.manual_seed(seed)
    return DropoutMoE()


def _save_rng(root, accelerator, index, kind: str = "sync"):
    accelerator.index = index
    model = _rng_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = _engine(kind, root, model, opt)
    assert save_now(ckpt, 1).ok
    _close(kind, ckpt)
    return model, torch.rand(4)  # what the run draws next


def _restore_rng(root, accelerator, index, kind: str = "sync"):
    accelerator.index = index
    model = _rng_model(5)  # another RNG state than the saved one
    ckpt = _engine(kind, root, model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        report = ckpt.restore()
    finally:
        ckpt.close()
    return report


@pytest.mark.parametrize("kind", ENGINES)
def test_a_rank_saves_every_generator_it_uses_and_a_restore_sets_each_on_its_device(
        tmp_path, accelerator, kind):
    saved_on_3 = accelerator.state(3).clone()
    _, next_draw = _save_rng(tmp_path, accelerator, 3, kind)
    if kind != "twolevel-memory":
        entries = Manifest.load(tmp_path, 1).entries
        assert sorted(k for k in entries if k.startswith("rng/")) == ["rng/rank=0",
                                                                      "rng/rank=0/cuda=0"]
    accelerator.states.clear()
    report = _restore_rng(tmp_path, accelerator, 1, kind)  # resumed on cuda:1
    assert report.step == 1 and report.source == ("memory" if kind == "twolevel-memory"
                                                  else "storage")
    assert torch.equal(torch.rand(4), next_draw)
    assert accelerator.installed == [1]
    assert torch.equal(accelerator.states[1], saved_on_3)


def test_a_checkpoint_holding_only_the_cpu_generator_leaves_the_accelerators_alone(
        tmp_path, accelerator):
    """A checkpoint written before accelerator generators were saved, or by a CPU run,
    restored by a rank on an accelerator: the CPU generator is set, the other is left
    as it is."""
    _, next_draw = _save_rng(tmp_path, accelerator, None)
    assert [k for k in Manifest.load(tmp_path, 1).entries if k.startswith("rng/")] == [
        "rng/rank=0"]
    before = accelerator.state(0).clone()
    _restore_rng(tmp_path, accelerator, 0)
    assert torch.equal(torch.rand(4), next_draw)
    assert accelerator.installed == []
    assert torch.equal(accelerator.state(0), before)


def test_an_rng_state_of_another_size_is_refused_in_one_line_before_anything_is_installed(
        tmp_path, accelerator):
    saved, _ = _save_rng(tmp_path, accelerator, 0)
    accelerator.size, accelerator.states = 32, {}  # another generator: 32-byte states
    torch.manual_seed(7)
    cpu_before = torch.get_rng_state()
    accelerator.index = 0
    fresh = _rng_model(5)
    ckpt = Checkpointer(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), tmp_path,
                        policy=PECPolicy.full())
    torch.set_rng_state(cpu_before)  # building the model drew from it
    with pytest.raises(IncompatibleCheckpointError) as refused:
        ckpt.restore()
    ckpt.close()
    message = str(refused.value)
    assert "\n" not in message
    assert "rng/rank=0/cuda=0" in message and "(16,)" in message and "(32,)" in message
    assert accelerator.installed == []
    assert torch.equal(torch.get_rng_state(), cpu_before)
    for a, b in zip(fresh.parameters(), saved.parameters(), strict=True):
        assert not torch.equal(a, b)  # the parameters were not installed either


def _dropout_run(model, opt, steps) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()  # dropout draws from the CPU generator
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_model_with_dropout_resumes_bitwise(tmp_path):
    model = _rng_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _dropout_run(model, opt, range(1, 4))
    ckpt = Checkpointer(model, opt, tmp_path, policy=PECPolicy.full())
    assert save_now(ckpt, 3).ok
    ckpt.close()
    want = _dropout_run(model, opt, range(4, 8))

    fresh = _rng_model(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ckpt = Checkpointer(fresh, fresh_opt, tmp_path, policy=PECPolicy.full())
    assert ckpt.restore().step == 3
    ckpt.close()
    assert _dropout_run(fresh, fresh_opt, range(4, 8)) == want
