"""K_snapshot: how many experts a snapshot holds and which (pure functions)."""

from __future__ import annotations

import pytest
import torch

from moc.checkpoint.twolevel.memory.slots import SlotEntry, SnapshotHeader
from moc.checkpoint.twolevel.snapshot.sizing import choose_k, parse_k_snapshot, snapshot_experts

N, LAYERS = 8, 2


def _header(experts: range = range(N)) -> SnapshotHeader:
    """Dense state of 1,000 float32 (4 kB); each expert of each layer 250 float32 (1 kB)."""
    entries = {"param/dense": SlotEntry(0, "float32", (1000,), 0)}
    for m in range(LAYERS):
        for e in experts:
            entries[f"param/l{m}.experts.w/expert={e}"] = SlotEntry(0, "float32", (250,), 0)
    return SnapshotHeader(1, entries, {})


STEMS = {f"l{m}.experts.w": m for m in range(LAYERS)}


def test_auto_takes_the_largest_k_whose_copy_fits_the_window():
    # 20 kB copied in 1 s: 20 kB/s. A window of 0.6 s less 0.1 s of planning copies
    # 10 kB: the 4 kB of dense state and 3 experts per layer (2 kB each).
    choice = choose_k(_header(), seconds=1.0, window=0.6, plan_s=0.1, stems=STEMS,
                      n_experts=N, n_moe_layers=LAYERS, floor=1)
    assert choice["k_snapshot"] == 3
    assert choice["copy_Bps"] == pytest.approx(20_000)
    assert (choice["window_s"], choice["plan_s"]) == (0.6, 0.1)
    # Why not N, in numbers: the snapshot's size, the copy's time and bandwidth, the room.
    assert "0.500 s" in choice["reason"]
    assert "3 of the rank's 8 experts per layer fit, so 3 of 8" in choice["reason"]


def test_auto_also_fits_the_seal_into_the_time_between_saves():
    # The capture alone fits every expert (20 kB in 1 s, 60 s of window); but a seal of
    # 1 s more makes 2 s per 20 kB (10 kB/s), and saves come every 1.1 s less 0.1 s of
    # planning: 10 kB, the dense 4 kB and 3 experts per layer.
    choice = choose_k(_header(), seconds=1.0, window=60.0, plan_s=0.1, stems=STEMS,
                      n_experts=N, n_moe_layers=LAYERS, floor=1, seal_s=1.0, period=1.1)
    assert choice["k_snapshot"] == 3
    assert (choice["seal_s"], choice["period_s"]) == (1.0, 1.1)
    assert "seals at 0.00 GB/s in the 1.100 s between saves" in choice["reason"]
    # Without a period (the first save) or without a seal (the fused CPU capture took
    # the checksums), the window alone decides.
    for seal_s, period in ((1.0, None), (0.0, 1.1)):
        assert choose_k(_header(), seconds=1.0, window=60.0, plan_s=0.1, stems=STEMS,
                        n_experts=N, n_moe_layers=LAYERS, floor=1, seal_s=seal_s,
                        period=period)["k_snapshot"] == N


def test_auto_never_goes_below_k_persist_nor_above_n():
    tight = choose_k(_header(), seconds=1.0, window=0.1, plan_s=0.1, stems=STEMS,
                     n_experts=N, n_moe_layers=LAYERS, floor=2)
    assert tight["k_snapshot"] == 2  # the persist reads its experts from the snapshot
    roomy = choose_k(_header(), seconds=1.0, window=60.0, plan_s=0.0, stems=STEMS,
                     n_experts=N, n_moe_layers=LAYERS, floor=1)
    assert roomy["k_snapshot"] == N and roomy["reason"] is None


def test_under_expert_parallelism_a_rank_measures_only_its_own_experts():
    # ep = 2: this rank holds experts 4..7 of 8 (12 kB with the dense state). Copied in
    # 1 s, with 0.9 s of room: 10.8 kB, the dense 4 kB and 3 of its 4 experts per layer.
    # Sequential selection interleaves over the ranks, so K = 6 puts 3 on each.
    mine = _header(range(4, 8))
    tight = choose_k(mine, seconds=1.0, window=1.0, plan_s=0.1, stems=STEMS, n_experts=N,
                     n_moe_layers=LAYERS, floor=1, ep=2)
    assert tight["k_snapshot"] == 6
    assert "3 of the rank's 4 experts per layer fit, so 6 of 8" in tight["reason"]
    # The whole share fits: a complete snapshot, K = N, though the rank's copy could
    # not have held N experts per layer (the count in the rank's own experts was once
    # compared to N: 6 of 8 where every expert fitted).
    fits = choose_k(mine, seconds=1.0, window=1.6, plan_s=0.1, stems=STEMS, n_experts=N,
                    n_moe_layers=LAYERS, floor=1, ep=2)
    assert fits["k_snapshot"] == N and fits["reason"] is None
    # ep not dividing N: no interleaving, a window may land on one rank whole. 14 kB in
    # 1 s, 0.7 s of room: 9.8 kB, the dense 4 kB and 2 of the rank's 5 experts per layer.
    uneven = choose_k(_header(range(5)), seconds=1.0, window=0.8, plan_s=0.1, stems=STEMS,
                      n_experts=N, n_moe_layers=LAYERS, floor=1, ep=3)
    assert uneven["k_snapshot"] == 2


def test_a_snapshot_holds_its_rotation_plus_what_it_persists():
    assert snapshot_experts(N, LAYERS, 2, 0, 1, None, first=True) == [set(range(N))] * 2
    assert snapshot_experts(N, LAYERS, N, 5, 1, None, first=False) == [set(range(N))] * 2
    rotation = snapshot_experts(N, LAYERS, 2, 0, 1, None, first=False)
    assert rotation == [{0, 1}, {2, 3}]  # sequential: layer m starts at K (m + c)
    with_persist = snapshot_experts(N, LAYERS, 2, 0, 1, [[7], [0]], first=False)
    assert with_persist == [{0, 1, 7}, {0, 2, 3}]
    # Over N / K snapshots every expert is in one.
    seen = [set(), set()]
    for c in range(N // 2):
        for m, ids in enumerate(snapshot_experts(N, LAYERS, 2, c, 1, None, first=False)):
            seen[m] |= ids
    assert seen == [set(range(N))] * 2


@pytest.mark.parametrize(("value", "expected"), [
    (None, (N, False)), ("all", (N, False)), ("auto", (N, True)), (3, (3, False)),
    (N, (N, False))])
def test_k_snapshot_values(value, expected):
    assert parse_k_snapshot(value, N) == expected


@pytest.mark.parametrize("value", [N + 1, 99])
def test_k_snapshot_beyond_the_experts_is_refused_not_clamped(value):
    """As PECPolicy(k=...) is: a K above N is a mistake about the model, once quietly
    read as 'all' (issue 29, item 14)."""
    with pytest.raises(ValueError, match=f"k_snapshot={value} is more than the {N} experts "
                                         f"per MoE layer; use k_snapshot <= {N}"):
        parse_k_snapshot(value, N)


def test_a_two_level_engine_refuses_k_snapshot_beyond_the_experts(tmp_path, monkeypatch):
    from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
    from moc.model import ModelConfig, Transformer

    monkeypatch.setenv("MOC_SHM_ROOT", str(tmp_path / "shm"))
    model = Transformer(ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32,
                                    n_experts=4))
    with pytest.raises(ValueError, match="k_snapshot=9 is more than the 4 experts"):
        TwoLevelCheckpointer(model, torch.optim.AdamW(model.parameters()), tmp_path / "ckpt",
                             k_snapshot=9)


@pytest.mark.parametrize("value", [0, -1, "some", 2.5, True])
def test_bad_k_snapshot_is_a_clear_error(value):
    with pytest.raises(ValueError, match="k_snapshot must be an integer >= 1, 'all' or 'auto'"):
        parse_k_snapshot(value, N)
