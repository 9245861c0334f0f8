"""The edges of DTensor layouts (issue 40, item 4): a tensor one rank holds whole and the
others not at all (a dimension smaller than the ranks: FSDP2 on `Linear(D, 1)`), dimensions
the ranks do not divide, 1-D to 3-D tensors, experts fewer than the ranks; and a layout
refused on some ranks only, refused alike on every rank.

The grid (`test_every_layout_of_the_grid_...`) attacks them systematically: every shape x
world size (1 to 4) x placement is saved with moc, then restored on its own layout, into
one plain process, and onto every other world size, bitwise. Each world size is one launch
of its ranks, which saves all its cases and restores those of the world sizes before it;
the plain restores run in the test's own process. It prints its grid (run with `-s`)."""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import moc
from moc.checkpoint.shards import (
    Box,
    UnsupportedLayoutError,
    agreed_placements,
    refusal,
    sharding_on,
)
from tests.checkpoint import dtensor_moe as tm
from tests.distributed import run_ranks

ENGINES = {"sync": moc.Checkpointer, "twolevel": moc.TwoLevelCheckpointer}


# -- the verdict, pure ----------------------------------------------------------------------

def _piece(offsets: Sequence[int], shape: Sequence[int], whole: Sequence[int]) -> dict:
    return {"pieces": {"head.weight": [list(offsets), list(shape), list(whole)]},
            "refused": None}


def test_a_tensor_one_rank_holds_whole_and_the_others_not_at_all_is_one_piece_of_that_rank():
    reports = [_piece((0, 0), (1, 8), (1, 8)), _piece((1, 0), (0, 8), (1, 8)),
               _piece((1, 0), (0, 8), (1, 8))]
    assert agreed_placements(reports) == {"head.weight": ((Box((0, 0), (1, 8)), (0,)),)}


def test_a_refusal_on_one_rank_is_the_same_one_line_on_every_rank_naming_it():
    ok = _piece((0, 0), (1, 8), (1, 8))
    refused = refusal(UnsupportedLayoutError("head.weight: placements (Partial(sum),)"))
    with pytest.raises(UnsupportedLayoutError) as e:
        agreed_placements([ok, refused, ok])
    assert str(e.value) == "rank 1: head.weight: placements (Partial(sum),)"
    # Every rank refusing alike: the message itself, as a single process says it.
    with pytest.raises(UnsupportedLayoutError) as e:
        agreed_placements([refused, refused])
    assert str(e.value) == "head.weight: placements (Partial(sum),)"
    # Not a layout (a buffer inside an expert module): a ValueError, still agreed.
    with pytest.raises(ValueError, match=r"^ranks 0, 1: persistent buffer") as e:
        agreed_placements([refusal(ValueError("persistent buffer 'b' is inside")),
                           refusal(ValueError("persistent buffer 'b' is inside")), ok])
    assert not isinstance(e.value, UnsupportedLayoutError)


def test_a_tensor_sharded_on_some_ranks_only_or_not_tiled_is_refused_naming_the_ranks():
    plain = {"pieces": {}, "refused": None}
    with pytest.raises(UnsupportedLayoutError,
                       match=r"^head\.weight is a DTensor sharded over the ranks on rank 1 "
                             r"but not on ranks 0, 2; "):
        agreed_placements([plain, _piece((0, 0), (1, 8), (2, 8)), plain])
    with pytest.raises(UnsupportedLayoutError, match="do not tile its \\(2, 8\\)"):
        agreed_placements([_piece((0, 0), (1, 8), (2, 8)), _piece((0, 0), (1, 8), (2, 8))])
    with pytest.raises(UnsupportedLayoutError, match="different shapes"):
        agreed_placements([_piece((0, 0), (1, 8), (2, 8)), _piece((1, 0), (1, 8), (3, 8))])


@st.composite
def layouts(draw):
    """A tensor shape (1-D to 3-D, sizes 1 to 5), a mesh of 1 to 4 ranks (1-D or 2-D)
    and a Shard or Replicate placement per mesh dimension."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    mesh = draw(st.sampled_from([(1,), (2,), (3,), (4,), (1, 2), (2, 1), (2, 2), (1, 3)]))
    kinds = st.sampled_from([Replicate(), *(Shard(d) for d in range(len(shape)))])
    return shape, tuple(draw(kinds) for _ in mesh), mesh


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_every_rank_sees_the_same_pieces_and_the_verdict_of_their_reports_is_them(layout):
    shape, placements, mesh = layout
    ranks = tuple(range(len(list(itertools.product(*map(range, mesh))))))
    seen = [sharding_on(shape, placements, mesh, ranks, coord)
            for coord in itertools.product(*map(range, mesh))]
    first = seen[0]
    assert first is not None  # plain Shard and Replicate always tile
    # What decides a key and a plan is the same on every rank, whatever its own piece:
    # a rank that holds the whole tensor does not call it replicated while another
    # holds nothing (the Linear(D, 1) under FSDP2 on 2 ranks).
    assert all((s.pieces, s.empty, s.whole) == (first.pieces, first.empty, first.whole)
               for s in seen)
    holders = [r for _, who in first.pieces for r in who]
    assert sorted(holders + list(first.empty)) == list(ranks)
    assert first.whole == all(s.mine.shape == shape for s in seen)
    # The ranks' reports (their own boxes) agree with what each computes from its mesh.
    reports = [{"pieces": {} if s.whole else {
        "w": [list(s.mine.offsets), list(s.mine.shape), list(shape)]}, "refused": None}
        for s in seen]
    assert agreed_placements(reports) == ({} if first.whole else {"w": first.pieces})


# -- FSDP2 on a Linear(D, 1): the case, on real ranks -------------------------------

def _with_head(mesh: DeviceMesh | None, seed: int) -> tm.MoE:
    """dtensor_moe's MoE with an output head of one row (`Linear(D, 1)`, bias of size 1),
    under FSDP2 with the rest on `mesh`: rank 0 holds the head whole, the others nothing."""
    model = tm.build(mesh, seed=seed)
    torch.manual_seed(seed + 1)
    model.value = nn.Linear(tm.D, 1)
    if mesh is not None:
        fully_shard(model.value, mesh=mesh)
    return model


def _stepped(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in (1, 2):  # no forward needed: the state is what is checkpointed
        for i, p in enumerate(model.parameters()):
            p.grad = torch.full_like(p, 0.1 * step + 0.01 * i)
        opt.step()
    return opt


def _save_head(rank: int, world: int, kind: str, root: str):
    model = _with_head(tm.mesh_of((world,)), seed=0)
    local = tuple(model.value.weight.to_local().shape), tuple(model.value.bias.to_local().shape)
    opt = _stepped(model)
    extra = {"persist_policy": "wait"} if kind == "twolevel" else {}
    engine = ENGINES[kind](model, opt, root, policy=moc.PECPolicy.full(), **extra)
    engine.save(2)
    engine.wait_for_snapshot()
    engine.close()
    return local, tm.full_state(model, opt)


def _restore_head(rank: int, world: int, root: str, mesh: tuple[int, ...] | None):
    model = _with_head(tm.mesh_of(mesh) if mesh else None, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = moc.Checkpointer(model, opt, root, policy=moc.PECPolicy.full())
    step = engine.restore().step
    engine.close()
    return step, tm.full_state(model, opt)


@pytest.mark.integration
@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_fsdp2_linear_of_one_output_saves_and_restores_bitwise_on_every_layout(tmp_path, kind):
    root = str(tmp_path / "ckpt")
    saved = run_ranks(_save_head, 2, kind, root)
    assert [local for local, _ in saved] == [((1, tm.D), (1,)), ((0, tm.D), (0,))]
    want = saved[0][1]
    entries = json.loads((tmp_path / "ckpt" / "step-00000002" / "manifest.json")
                         .read_text())["entries"]
    # Rank 0's piece is the whole tensor: stored once, under its plain key; rank 1 has none.
    for key in ("param/value.weight", "param/value.bias", "optim/value.weight/exp_avg",
                "optim/value.bias/exp_avg_sq"):
        assert key in entries and not any(k.startswith(key + "@") for k in entries), key
    # The two engines write the same pieces: the second one is restored in one place.
    targets = ((2, (2,)), (1, None), (3, (3,))) if kind == "sync" else ((1, None),)
    for world, mesh in targets:
        step, got = run_ranks(_restore_head, world, root, mesh)[0]
        bad = [k for k in want if not torch.equal(got[k], want[k])]
        assert step == 2 and not bad and set(got) == set(want), (world, bad)


# -- a refusal found on some ranks only ------------------------------------------------------

def _one_rank_refuses(rank: int, world: int, root: str) -> list[str]:
    """Three models, each refused by the checkpointer; on every rank, what it raised, and
    that the ranks still meet in a collective afterwards (none was left behind)."""
    mesh = tm.mesh_of((world,))
    out = []

    def refused(model: nn.Module) -> None:
        with pytest.raises(ValueError) as e:
            moc.Checkpointer(model, torch.optim.AdamW(model.parameters()), root)
        out.append(f"{type(e.value).__name__}: {e.value}")
        dist.barrier()

    # Rank 1 alone holds a sum not yet reduced (Partial): refused at its construction.
    model = _with_head(mesh, seed=0)
    if rank == 1:
        model.value.weight = nn.Parameter(DTensor.from_local(
            torch.zeros(1, tm.D), mesh, [Partial()], run_check=False))
    refused(model)
    # The head sharded on rank 0, replicated on the others: the ranks' reports disagree.
    model = tm.build(mesh)
    model.value = nn.Linear(tm.D, world)
    w = model.value.weight.detach()
    model.value.weight = nn.Parameter(
        DTensor.from_local(w[:1], mesh, [Shard(0)], run_check=False, shape=w.shape,
                           stride=w.stride()) if rank == 0 else
        DTensor.from_local(w, mesh, [Replicate()], run_check=False))
    refused(model)
    # A local piece whose shape is not what the placements say, on the last rank.
    model = tm.build(mesh)
    model.value = nn.Linear(tm.D, 4)
    w = model.value.weight.detach()
    held = w[2 * rank:2 * rank + 2] if rank != world - 1 else torch.zeros(3, tm.D)
    model.value.weight = nn.Parameter(DTensor.from_local(held, mesh, [Shard(0)],
                                                         run_check=False, shape=w.shape,
                                                         stride=w.stride()))
    refused(model)
    # No experts on rank 1 (a pipeline stage without MoE layers): refused by its
    # ExpertSpec.infer, before any collective of the engine's own.
    model = tm.build(mesh)  # collective: built by every rank
    refused(model if rank != 1 else nn.Sequential(nn.Linear(tm.D, tm.D)))
    # An FSDP2 module whose parameters are unsharded now (under `unshard()`), on every
    # rank: found without moc importing FSDP itself (`shards.is_instance_of_loaded`).
    model = tm.build(mesh)
    model.head.unshard()
    refused(model)
    return out


@pytest.mark.integration
def test_a_layout_refused_on_some_ranks_is_the_same_one_line_on_every_rank(tmp_path):
    results = run_ranks(_one_rank_refuses, 3, str(tmp_path / "ckpt"))
    assert all(r == results[0] for r in results), results  # no gloo error on any peer
    partial, lopsided, misshapen, no_experts, unsharded = results[0]
    for message in (partial, lopsided, misshapen):
        assert message.startswith("UnsupportedLayoutError: ") and "\n" not in message
    assert no_experts.startswith("ValueError: rank 1: ExpertSpec.infer found no expert "
                                 "container in Sequential"), no_experts
    assert unsharded == ("UnsupportedLayoutError: the FSDP2 module 'head' holds unsharded "
                         "parameters now; build the checkpointer when the model is sharded: "
                         "after fully_shard, before the first forward or after a backward"), \
        unsharded
    assert partial.startswith("UnsupportedLayoutError: rank 1: value.weight: placements "
                              "(Partial(sum),)"), partial
    assert lopsided == ("UnsupportedLayoutError: value.weight is a DTensor sharded over the "
                        "ranks on rank 0 but not on ranks 1, 2; build the same layout on "
                        "every rank"), lopsided
    assert misshapen.startswith("UnsupportedLayoutError: rank 2: value.weight: ") \
        and "the local tensor is (3, 8), its placements say (0, 8)" in misshapen, misshapen


# -- the grid ---------------------------------------------------------------------------------

SHAPES = [(1,), (5,), (1, 4), (2, 6), (3, 5), (5, 1), (1, 3, 2), (3, 2, 4)]
"""1-D to 3-D; a first dimension of 1 and others smaller than 4 ranks; sizes no world
size from 2 to 4 divides (3, 5), and a last dimension of 1."""
DENSE = ("Shard(0)", "Shard(1)", "Replicate", "FSDP2")
EXPERT = ("EP", "FSDP2 over EP")
"""Batched experts `[E, ...]` (E: the first dimension): `Shard(0)` over the ranks, and
that sharded again by FSDP2 over dp_shard of a (dp_shard, ep) mesh, as torchtitan does."""
WORLDS = (1, 2, 3, 4)
GRID_TIMEOUT_S = 1800
"""One launch saves and restores dozens of cases on up to 4 ranks that share two cores."""

Case = tuple[tuple[int, ...], str]


def cases(shapes: Sequence[tuple[int, ...]] = SHAPES,
          placements: Sequence[str] = DENSE + EXPERT) -> list[Case]:
    """Every (shape, placement) that means something: Shard(1) and experts need 2-D."""
    return [(s, p) for s in shapes for p in placements
            if len(s) >= 2 or p in ("Shard(0)", "Replicate", "FSDP2")]


class _Holder(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w)


class _Grid(nn.Module):
    """The tensor under test as a dense parameter (`layer.w`) or as batched experts
    (`experts.w`), and a plain tensor in the other place (a model has experts)."""

    def __init__(self, shape: tuple[int, ...], expert: bool, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        case, other = torch.randn(shape, generator=g), torch.randn(2, 3, generator=g)
        self.layer = _Holder(other[0] if expert else case)
        self.experts = _Holder(case if expert else other)


@functools.cache
def _mesh(shape: tuple[int, ...]) -> DeviceMesh:
    """One mesh per shape per launch (a mesh is process groups: built once)."""
    names = ("dp_shard", "ep") if len(shape) == 2 else None
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _laid_out(case: Case, world: int | None, seed: int) -> _Grid:
    """The case's model; on `world` ranks (None: one plain process), laid out."""
    shape, placement = case
    model = _Grid(shape, placement in EXPERT, seed)
    if world is None:
        return model
    mesh = _mesh((world,))
    if placement in ("Shard(0)", "Shard(1)", "Replicate"):
        how = {"Shard(0)": Shard(0), "Shard(1)": Shard(1), "Replicate": Replicate()}[placement]
        model.layer.w = nn.Parameter(distribute_tensor(model.layer.w.data, mesh, [how]))
    elif placement == "FSDP2":
        fully_shard(model.layer, mesh=mesh)
    elif placement == "EP":
        model.experts.w = nn.Parameter(distribute_tensor(model.experts.w.data, mesh,
                                                         [Shard(0)]))
    else:
        dp = 2 if world % 2 == 0 else 1
        mesh2 = _mesh((dp, world // dp))
        model.experts.w = nn.Parameter(distribute_tensor(model.experts.w.data,
                                                         mesh2["ep"], [Shard(0)]))
        fully_shard(model.experts, mesh=mesh2["dp_shard"])
    return model


def _dir(root: str, world: int, case: Case) -> Path:
    shape, placement = case
    name = "x".join(map(str, shape)) + "-" + placement.replace(" ", "-").replace("(", "") \
        .replace(")", "")
    return Path(root) / f"w{world}" / name


def _save_case(case: Case, world: int, root: str) -> None:
    model = _laid_out(case, world, seed=0)
    opt = _stepped(model)
    engine = moc.Checkpointer(model, opt, _dir(root, world, case), policy=moc.PECPolicy.full())
    engine.save(2)
    engine.close()
    want = tm.full_state(model, opt)  # collective
    if dist.get_rank() == 0:
        torch.save(want, _dir(root, world, case) / "want.pt")


def _restore_case(case: Case, saved_on: int, world: int | None, root: str) -> None:
    """Restore the case saved on `saved_on` ranks onto `world` ranks (None: plain);
    AssertionError naming what differs."""
    model = _laid_out(case, world, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    where = _dir(root, saved_on, case)
    engine = moc.Checkpointer(model, opt, where, policy=moc.PECPolicy.full())
    step = engine.restore().step
    engine.close()
    got = tm.full_state(model, opt)
    want = torch.load(where / "want.pt", weights_only=True)
    bad = [k for k in want if k not in got or not torch.equal(got[k], want[k])]
    assert step == 2 and not bad and set(got) == set(want), f"step {step}, differ: {bad}"


def _attempt(fn: Callable[[], None], distributed: bool = True) -> str:
    """'ok', or what went wrong on the first rank it did (the same on every rank)."""
    try:
        fn()
        mine = None
    except Exception as e:  # the grid records every failure
        mine = f"{type(e).__name__}: {e}".splitlines()[0][:160]
    if not distributed:
        return mine or "ok"
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return next((m for m in every if m), "ok")


def _grid_launch(rank: int, world: int, root: str, grid: list[Case], earlier: list[int]
                 ) -> dict[tuple, str]:
    """On `world` ranks: save every case, restore it on its own layout, and restore onto
    this layout the cases saved on the `earlier` world sizes."""
    out = {}
    for case in grid:
        out[(case, world, "save")] = _attempt(functools.partial(_save_case, case, world, root))
        out[(case, world, "same")] = (
            _attempt(functools.partial(_restore_case, case, world, world, root))
            if out[(case, world, "save")] == "ok" else "not saved")
        for saved_on in earlier:
            if _dir(root, saved_on, case).joinpath("want.pt").exists():
                out[(case, saved_on, f"onto {world}")] = _attempt(
                    functools.partial(_restore_case, case, saved_on, world, root))
    return out


def run_grid(root: str, grid: list[Case], worlds: Sequence[int]) -> dict[tuple, str]:
    """Every check of the grid: (case, world saved on, what) -> 'ok' or what failed."""
    results: dict[tuple, str] = {}
    for i, world in enumerate(worlds):
        results.update(run_ranks(_grid_launch, world, root, grid, list(worlds[:i]),
                                 timeout=GRID_TIMEOUT_S)[0])
    for world in worlds:  # into one plain process: this one
        for case in grid:
            if _dir(root, world, case).joinpath("want.pt").exists():
                results[(case, world, "1 process")] = _attempt(
                    functools.partial(_restore_case, case, world, None, root),
                    distributed=False)
    return results


def grid_table(results: dict[tuple, str], grid: list[Case], worlds: Sequence[int]) -> str:
    """The grid as text: a row per shape x placement x world saved on, a column per
    check; then every failure in full."""
    checks = ["save", "same", "1 process", *(f"onto {w}" for w in worlds[1:])]
    head = f"{'shape':<11}{'placement':<15}{'world':<7}" + "".join(f"{c:<11}" for c in checks)
    lines = [head, "-" * len(head)]
    failures = []
    for case in grid:
        for world in worlds:
            cells = []
            for check in checks:
                got = results.get((case, world, check))
                cells.append("-" if got is None else "ok" if got == "ok" else "FAIL")
                if got not in (None, "ok"):
                    failures.append(f"{case[0]} {case[1]} on {world}, {check}: {got}")
            lines.append(f"{case[0]!s:<11}{case[1]:<15}{world:<7}"
                         + "".join(f"{c:<11}" for c in cells))
    passed = sum(v == "ok" for v in results.values())
    lines.append(f"{len(grid)} layouts x {len(worlds)} world sizes: {passed} of "
                 f"{len(results)} checks passed")
    return "\n".join(lines + failures)


FAST = cases([(1,), (1, 4), (3, 5)], ("Shard(0)", "FSDP2", "EP"))
"""The edges the issue found (a first dimension of 1, sizes 2 and 3 ranks do not divide),
saved on 2 and 3 ranks: kept in the fast tier."""


@pytest.mark.integration
def test_the_edges_of_fsdp2_and_ep_restore_bitwise_on_2_and_3_ranks_and_in_one_process(tmp_path):
    results = run_grid(str(tmp_path), FAST, (2, 3))
    table = grid_table(results, FAST, (2, 3))
    print("\n" + table)
    assert all(v == "ok" for v in results.values()), table
    assert len(results) == len(FAST) * 7  # save, same, 1 process: of 2 and of 3; 2 onto 3


@pytest.mark.slow
@pytest.mark.integration
def test_every_layout_of_the_grid_restores_bitwise_on_its_layout_in_one_process_and_on_other_worlds(
        tmp_path):
    grid = cases()
    results = run_grid(str(tmp_path), grid, WORLDS)
    table = grid_table(results, grid, WORLDS)
    print("\n" + table)
    assert all(v == "ok" for v in results.values()), table
