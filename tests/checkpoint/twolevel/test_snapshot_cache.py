"""The snapshot's cached layout (`twolevel.snapshot.state_cache`): made once, checked at every
snapshot, made anew whenever what it was made of is replaced (a restore, a
`load_state_dict`, state the first step creates, a group added, a parameter's memory
swapped, another selection of experts), so that a snapshot never copies a stale tensor:
after each, the snapshot holds what a fresh flatten holds, byte for byte. And the
snapshot thread's Python work per snapshot no longer grows with the number of tensors."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch

from moc.checkpoint.phases import Phases
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.spec import parse_expert_key
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.checkpoint.twolevel.memory.places import SlotLayout
from moc.checkpoint.twolevel.memory.slots import SnapshotHeader, SnapshotStore
from moc.checkpoint.twolevel.snapshot import state_cache
from moc.checkpoint.twolevel.snapshot.capture import HostCopy, capture, seal
from moc.checkpoint.twolevel.snapshot.tensors import Picked, SnapshotTensors
from moc.model import ModelConfig, Transformer

pytestmark = pytest.mark.integration  # real persist processes

CFG = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)


def _build(seed: int = 0, cfg: ModelConfig = CFG, params=None):
    torch.manual_seed(seed)
    model = Transformer(cfg)
    return model, torch.optim.AdamW(params(model) if params else model.parameters(), lr=1e-2)


def _engine(tmp_path, model, opt, **kwargs) -> TwoLevelCheckpointer:
    # "wait": every checkpoint is persisted, so every plan derives a persist's share.
    kwargs.setdefault("policy", PECPolicy(k=1))
    return TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", interval=1,
                                persist_policy="wait", **kwargs)


def _step(model, opt, ckpt, step: int) -> None:
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(step))
    model(idx, idx).loss.backward()
    ckpt.wait_for_snapshot()
    opt.step()
    opt.zero_grad()


def _snapshot_is_the_state(ckpt: TwoLevelCheckpointer) -> SnapshotHeader:
    """The newest snapshot holds, for every key it holds, the bytes a fresh flatten of
    the state holds now (nothing changed it since its save); all of them when it is
    complete."""
    ckpt.flush()
    assert all(r.error is None for r in ckpt.drain_completed())
    slot, header = max(ckpt.snapshots.store.headers().items(), key=lambda sh: sh[1].step)
    got = ckpt.snapshots.store.read(slot, header)
    want = ckpt.parts.state.flatten()
    assert set(got) <= set(want)
    if header.meta["k_snapshot"] == CFG.n_experts:
        assert set(got) == set(want)
    for key, t in got.items():
        assert torch.equal(t, want[key]), key
    return header


@pytest.fixture
def checked(monkeypatch):
    """Every use of the cache is checked against a derivation from scratch: the layout
    a snapshot takes views the same memory as a fresh flatten, and whatever the layout
    remembers equals what making it again gives."""
    real_take, real_remember = state_cache.FlatState.take, state_cache.StateLayout.remember

    def take(self, rng, captured):
        flat = real_take(self, rng, captured)
        fresh = self.state.flatten(rng, captured)
        assert flat.keys == list(fresh)
        for key, t in flat.as_dict().items():
            f = fresh[key]
            if key in flat.tail:
                assert torch.equal(t, f), key
            else:  # the same memory, seen the same way
                assert (t.data_ptr(), t.dtype, t.shape, t.stride()) == (
                    f.data_ptr(), f.dtype, f.shape, f.stride()), key
        return flat

    def remember(self, key, make):
        got, again = real_remember(self, key, make), make()
        if isinstance(got, Picked):
            assert got.layout.keys == again.layout.keys
            assert got.layout.offsets == again.layout.offsets
            assert all(a is b for a, b in zip(got.tensors, again.tensors, strict=True))
        else:
            assert got == again
        return got

    monkeypatch.setattr(state_cache.FlatState, "take", take)
    monkeypatch.setattr(state_cache.StateLayout, "remember", remember)


def test_the_layout_is_made_once_and_kept_while_the_state_keeps_its_tensors(tmp_path,
                                                                            checked):
    model, opt = _build()
    ckpt = _engine(tmp_path, model, opt, policy=PECPolicy(k=None))
    for step in (1, 2):
        _step(model, opt, ckpt, step)
        ckpt.save(step)
    ckpt.flush()
    builds = ckpt.planner.flat.builds
    for step in (3, 4, 5):
        _step(model, opt, ckpt, step)
        ckpt.save(step)
        _snapshot_is_the_state(ckpt)
    assert ckpt.planner.flat.builds == builds  # kept: checked, not made again
    ckpt.close()


def test_state_the_first_step_creates_is_in_the_next_snapshot(tmp_path, checked):
    model, opt = _build()
    ckpt = _engine(tmp_path, model, opt)
    ckpt.save(0)  # before any step: no optimizer state yet
    assert not any(k.startswith("optim/") and "param_groups" not in k
                   for k in _snapshot_is_the_state(ckpt).entries)
    builds = ckpt.planner.flat.builds
    _step(model, opt, ckpt, 1)  # AdamW creates its moments now
    ckpt.save(1)
    header = _snapshot_is_the_state(ckpt)
    assert any(parse_expert_key(k) and k.startswith("optim/") for k in header.entries)
    assert ckpt.planner.flat.builds == builds + 1
    ckpt.close()


def test_a_state_loaded_with_load_state_dict_is_what_the_next_snapshot_copies(tmp_path,
                                                                             checked):
    model, opt = _build()
    ckpt = _engine(tmp_path, model, opt)
    for step in (1, 2):
        _step(model, opt, ckpt, step)
        ckpt.save(step)
    ckpt.flush()
    other = copy.deepcopy(opt.state_dict())
    for s in other["state"].values():
        s["exp_avg"].mul_(3.0)
    opt.load_state_dict(other)  # new tensors: the layout's are no longer the optimizer's
    _step(model, opt, ckpt, 3)  # updates the new ones in place; a stale copy would differ
    ckpt.save(3)
    _snapshot_is_the_state(ckpt)
    ckpt.close()


def test_a_restore_replaces_the_state_and_the_next_snapshot_copies_the_new_one(tmp_path,
                                                                              checked):
    model, opt = _build()
    ckpt = _engine(tmp_path, model, opt)
    for step in (1, 2, 3):
        _step(model, opt, ckpt, step)
        ckpt.save(step)
    before = ckpt.planner.flat.builds
    report = ckpt.restore()  # from memory: every optimizer tensor is a new one
    assert (report.step, report.source) == (3, "memory")
    for step in (4, 5):
        _step(model, opt, ckpt, step)
        ckpt.save(step)
        _snapshot_is_the_state(ckpt)
    assert ckpt.planner.flat.builds == before + 1
    report = ckpt.restore(step=2)  # a rollback, from storage: new tensors again
    assert (report.step, report.source) == (2, "storage")
    for step in (3, 4):
        _step(model, opt, ckpt, step)
        ckpt.save(step)
        _snapshot_is_the_state(ckpt)
    assert ckpt.planner.flat.builds == before + 2
    ckpt.close()


def test_partial_snapshots_copy_the_experts_each_selects(tmp_path, checked):
    """K_snapshot < N: each snapshot holds the rotating selection's experts (and those
    its persist writes), from the tensors the state holds now."""
    model, opt = _build()
    ckpt = _engine(tmp_path, model, opt, k_snapshot=1)
    held = []
    for step in range(1, 8):
        _step(model, opt, ckpt, step)
        ckpt.save(step)
        header = _snapshot_is_the_state(ckpt)
        held.append({parse_expert_key(k)[2] for k in header.entries if parse_expert_key(k)})
    assert held[0] == set(range(CFG.n_experts))  # the chain's first: every expert
    assert len({frozenset(h) for h in held[1:]}) > 1  # the selection moves
    assert all(len(h) < CFG.n_experts for h in held[2:])
    ckpt.close()


def test_a_group_added_and_a_parameter_given_new_memory_are_seen(tmp_path, checked):
    """A parameter group added later (its state appears at its first step), and a
    parameter whose memory is swapped under it (`p.data = ...`: same object, new
    storage): both are what the next snapshot copies."""
    model, opt = _build(params=lambda m: [p for n, p in m.named_parameters()
                                          if not n.startswith("lm_head")])
    ckpt = _engine(tmp_path, model, opt)
    for step in (1, 2):
        _step(model, opt, ckpt, step)
        ckpt.save(step)
    ckpt.flush()
    opt.add_param_group({"params": list(model.lm_head.parameters())})
    _step(model, opt, ckpt, 3)
    ckpt.save(3)
    header = _snapshot_is_the_state(ckpt)
    assert any(k.startswith("optim/lm_head") for k in header.entries)
    with torch.no_grad():
        model.lm_head.weight.data = model.lm_head.weight.data * 2  # new storage
    ckpt.save(4)
    _snapshot_is_the_state(ckpt)
    ckpt.close()


def _tensors(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {"w": torch.randn(300, generator=g), "t": torch.randn(30, 20, generator=g).t(),
            "h": torch.randn(101, generator=g).bfloat16(), "empty": torch.empty(0),
            "i": torch.arange(37, dtype=torch.int16) * n}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "copy-then-seal"])
def test_a_kept_selection_copies_the_tensors_as_they_are_at_each_capture(fused):
    """What is derived from a kept selection is derived once, but never a value: a
    strided tensor, made contiguous at each copy, and the tail, made anew, hold what
    they hold at that capture, and the sealed header's JSON is the one a plain header
    of the same entries writes."""
    state = _tensors(1)
    layout = SlotLayout.of(state)
    picked = Picked.of(layout, state.values())
    store, copier = SnapshotStore("job", rank=0), HostCopy(fused=fused)
    for step in (1, 2, 3):
        with torch.no_grad():
            for t in state.values():
                t.copy_(_tensors(step)[next(k for k, v in state.items() if v is t)])
        tail = {"rng": torch.arange(step + 3, dtype=torch.uint8)}  # its size varies
        got = capture(store, copier, step % 3, step, SnapshotTensors(picked, tail),
                      phases=Phases())
        header = seal(store, got, {"step": step})
        plain = SnapshotHeader(step, dict(header.entries), {"step": step})
        assert header.to_json() == plain.to_json()
        assert SnapshotHeader.from_json(header.to_json()) == plain
        read = store.read(step % 3, SnapshotStore("job", 0).header(step % 3))
        for key, t in {**state, **tail}.items():
            assert torch.equal(read[key], t), (step, key)
    assert json.loads(header.to_json())["entries"]["rng"][0] >= layout.size


def _calls_per_snapshot(tmp_path, cfg: ModelConfig, snapshots: int) -> tuple[int, int]:
    """(Python calls and calls of C functions the snapshot thread makes per snapshot,
    the tensors a snapshot holds), once the layout is kept and every selection seen.
    Every call counts: the persist message (its key lists encoded in one C-level pass,
    `codec`) and the param groups' JSON (their names read as they are) included."""
    model, opt = _build(cfg=cfg)
    ckpt = _engine(tmp_path / str(cfg.n_experts), model, opt, policy=PECPolicy(k=None))
    counts = {"call": 0, "c_call": 0}

    def profile(frame, event, arg):
        if event in counts:
            counts[event] += 1

    for step in (1, 2, 3):  # the layout is made, the share and the selection remembered
        _step(model, opt, ckpt, step)
        ckpt.save(step)
        ckpt.flush()
    worker = ckpt.snapshots.worker
    worker.submit(lambda: sys.setprofile(profile)).result()
    for step in range(4, 4 + snapshots):
        _step(model, opt, ckpt, step)
        ckpt.save(step)
        ckpt.flush()
    worker.submit(lambda: sys.setprofile(None)).result()
    n = len(ckpt.snapshots.store.headers()[ckpt.books.newest_slot].entries)
    ckpt.close()
    return (counts["call"] + counts["c_call"]) // snapshots, n


def test_the_snapshot_threads_python_calls_do_not_grow_with_the_tensors(tmp_path):
    """Per snapshot, the snapshot thread's calls for a model of N tensors and for one of
    about 7N with as many layers: before the cache, about 40 per tensor (25,965 at
    `bench`'s 610); now about the same thousand for both (1152 and 1155 when written).
    What grows with the MoE layers (the selection, the token counts' rows) is not held
    to this: a model has tens of layers, and thousands of tensors."""
    small, n_small = _calls_per_snapshot(tmp_path, CFG, 3)
    big_cfg = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32,
                          n_experts=48)  # as many layers: what grows per layer stays
    big, n_big = _calls_per_snapshot(tmp_path, big_cfg, 3)
    assert n_big >= 6 * n_small
    print(f"calls per snapshot: {small} for {n_small} tensors, {big} for {n_big}")
    assert big - small < 0.1 * (n_big - n_small), (small, n_small, big, n_big)
