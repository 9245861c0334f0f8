"""FSDP2 and DTensor expert parallelism (the layout torchtitan trains MoE models with),
checkpointed by both engines on real gloo ranks, and restored on the same layout, into
one plain process, on 4 ranks, and from a 2-D mesh onto 2 ranks: bitwise, by reading
slices of the pieces each layout wrote."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import moc
from moc.checkpoint.export import export
from moc.checkpoint.shards import UnsupportedLayoutError
from moc.checkpoint.store.format import ITEM_SIZES
from moc.checkpoint.tools import format_verify, verify_checkpoints
from tests.checkpoint import dtensor_moe as tm
from tests.distributed import run_ranks

pytestmark = pytest.mark.integration  # real processes: see README, Tests

ENGINES = {"sync": moc.Checkpointer, "twolevel": moc.TwoLevelCheckpointer}
STEPS, EVERY = 6, 2
PARTIAL = 4
"""The step restored: a partial one (the two-level engine's close() completes step 6)."""


def _engine(kind: str, model: nn.Module, opt: torch.optim.Optimizer, root: str,
            policy: moc.PECPolicy):
    # Every save persisted, however loaded the machine: the test reads each step.
    extra = {"persist_policy": "wait"} if kind == "twolevel" else {}
    return ENGINES[kind](model, opt, root, policy=policy, **extra)


class Counts:
    """The test's own router counts: tokens per (layer, expert) at every step, summed
    over the ranks as the checkpoint's ledger sums them."""

    def __init__(self, model: tm.MoE) -> None:
        self.now = torch.zeros(tm.LAYERS, tm.E, dtype=torch.int64)
        for layer, block in enumerate(model.layers):
            block.router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def hook(module, args, out):
            ids = tm.top1(module, args, out.detach()).flatten()
            self.now[layer] += torch.bincount(ids, minlength=tm.E)
        return hook

    def summed(self) -> torch.Tensor:
        t = self.now.clone()
        if dist.is_initialized():
            dist.all_reduce(t)
        return t


def _train(rank: int, world: int, kind: str, root: str):
    """2 ranks: FSDP2 + DTensor EP, PEC K=1, routing watched; every saved step's whole
    state and the router counts (the test's own) at each step."""
    model = tm.build(tm.mesh_of((world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = _engine(kind, model, opt, root, moc.PECPolicy(k=1))
    engine.watch_routing(model, routers={i: b.router for i, b in enumerate(model.layers)},
                         indices=tm.top1)
    counts = Counts(model)
    states, cumulative = {}, {}
    for step in range(1, STEPS + 1):
        tm.train_step(model, opt, step)
        cumulative[step] = counts.summed()
        if step % EVERY == 0:
            engine.save(step)
            engine.wait_for_snapshot()
            states[step] = tm.full_state(model, opt)
    engine.close()
    return states, cumulative


def _restore(rank: int, world: int, kind: str, root: str, mesh: tuple[int, ...] | None,
             step: int | None = None):
    model = tm.build(tm.mesh_of(mesh) if mesh else None, seed=7)  # not the trained values
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = _engine(kind, model, opt, root, moc.PECPolicy(k=1))
    report = engine.restore(step=step)
    out = tm.full_state(model, opt)
    engine.close()
    return report, out


def _expected(root: Path, states: dict, step: int) -> dict[str, torch.Tensor]:
    """What a restore of `step` must install, from the manifest's own account of where
    each expert's newest copy is and the states recorded when each step was saved."""
    manifest = json.loads((root / f"step-{step:08d}" / "manifest.json").read_text())
    want = {k: v.clone() for k, v in states[step].items()}
    for key, entry in manifest["entries"].items():
        if "/expert=" not in key or key.endswith("/step"):
            continue
        kind, rest = key.split("/", 1)
        stem, _, tail = rest.partition("/expert=")
        gid, _, state = tail.partition("/")
        name = f"{kind}/{stem}" + (f"/{state}" if state else "")
        want[name][int(gid)] = states[entry["step"]][name][int(gid)]
    return want


def _same(got: dict, want: dict) -> list[str]:
    """Keys that differ. A batched expert tensor's AdamW `step` is one scalar for the
    experts a rank holds (the newest of their copies), so it depends on the layout."""
    bad = [k for k in want if not (".experts." in k and k.endswith("/step"))
           and not torch.equal(got[k], want[k])]
    return bad + sorted(set(want) ^ set(got))


@pytest.mark.parametrize("kind", [
    pytest.param(k, marks=pytest.mark.slow) if k == "twolevel" else k  # CI time: slow tier
    for k in sorted(ENGINES)])
def test_fsdp2_dtensor_ep_restores_bitwise_on_its_layout_in_one_process_and_on_4_ranks(
        tmp_path, kind):
    root = str(tmp_path / "ckpt")
    states, cumulative = run_ranks(_train, 2, kind, root)[0]
    manifest = json.loads((tmp_path / "ckpt" / f"step-{PARTIAL:08d}" / "manifest.json")
                          .read_text())
    # Pieces: FSDP2's dense rows by offset, the EP experts whole by global id.
    assert "param/layers.0.attn.weight@4,0" in manifest["entries"]
    assert "param/layers.1.experts.w1/expert=3" in manifest["entries"]
    assert [len(ids) for ids in manifest["experts_saved"].values()] == [1, 1]  # K=1
    # Bytes of the partial step: all non-expert state and K/N of the experts' (params and
    # optimizer state), exactly.
    def nbytes(e: dict) -> int:
        return ITEM_SIZES[e["dtype"]] * math.prod(e["shape"])
    entries = manifest["entries"]
    experts = sum(nbytes(e) for k, e in entries.items() if "/expert=" in k)
    dense = sum(nbytes(e) for k, e in entries.items() if "/expert=" not in k)
    written = sum(nbytes(e) for e in entries.values() if e["step"] == PARTIAL)
    assert written * tm.E == dense * tm.E + experts * 1

    want = _expected(tmp_path / "ckpt", states, PARTIAL)
    entries = json.loads((tmp_path / "ckpt" / f"step-{PARTIAL:08d}" / "manifest.json")
                         .read_text())["entries"]
    at_save = torch.tensor([[cumulative[entries[f"param/layers.{m}.experts.w1/expert={e}"]
                                        ["step"]][m, e] for e in range(tm.E)]
                            for m in range(tm.LAYERS)])
    lost = cumulative[PARTIAL] - at_save  # each expert: the tokens since its newest copy
    assert lost.sum() > 0
    plt = float((lost.sum(1).double() / cumulative[PARTIAL].sum(1).double()).mean())
    targets = {"same layout": (2, (2,)), "one plain process": (1, None), "4 ranks": (4, (4,))}
    for label, (world, mesh) in targets.items():
        # The first rolls back to the partial step (setting step 6 aside); then it is the
        # newest.
        report, got = run_ranks(_restore, world, kind, root, mesh, PARTIAL)[0]
        assert report.step == PARTIAL, label
        assert not _same(got, want), (label, _same(got, want))
        # The ledger's account of what the restore lost, against the test's own counts.
        assert report.lost_tokens == int(lost.sum()), label
        assert report.plt == pytest.approx(plt), label


def _train_2d(rank: int, world: int, root: str, fsdp_experts: bool):
    model = tm.build(tm.mesh_of((2, 2)), fsdp_experts=fsdp_experts)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = moc.Checkpointer(model, opt, root, policy=moc.PECPolicy.full())
    for step in (1, 2):
        tm.train_step(model, opt, step)
    engine.save(2)
    engine.close()
    return tm.full_state(model, opt)


@pytest.mark.parametrize("fsdp_experts", [False, True], ids=["experts-replicated",
                                                          "experts-strided"])
def test_a_2d_mesh_dp_shard_by_ep_on_4_ranks_restores_bitwise_on_2_ranks(tmp_path,
                                                                       fsdp_experts):
    """The experts Shard(0) over ep and either replicated over dp_shard (each piece
    written by one of its two holders) or sharded again by FSDP2 over dp_shard, as
    torchtitan does (_StridedShard(0), Shard(0): each rank holds one expert)."""
    root = str(tmp_path / "ckpt")
    want = run_ranks(_train_2d, 4, root, fsdp_experts)[0]
    manifest = json.loads((tmp_path / "ckpt" / "step-00000002" / "manifest.json").read_text())
    # The experts are replicated over dp_shard: each piece is written by one rank only.
    written = [k for f in manifest["files"] for k in _keys(tmp_path / "ckpt" / "step-00000002" / f)]
    assert len(written) == len(set(written)) == len(manifest["entries"])
    assert "param/layers.0.experts.w1/expert=1" in written
    report, got = run_ranks(_restore, 2, "sync", root, (2,))[0]
    assert report.step == 2
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad and set(got) == set(want), bad
    # Export assembles the pieces from the files alone; verify checks that they tile.
    out = tmp_path / "export"
    export(root, out, format="safetensors")
    exported = load_file(out / "model.safetensors")
    assert set(exported) == {k[len("param/"):] for k in want if k.startswith("param/")}
    assert all(torch.equal(exported[k], want[f"param/{k}"]) for k in exported)
    assert verify_checkpoints(root).damaged_steps == []
    path = tmp_path / "ckpt" / "step-00000002" / "manifest.json"
    doc = json.loads(path.read_text())
    last = max(k for k in doc["entries"] if k.startswith("param/layers.0.attn.weight@"))
    del doc["entries"][last]  # the last piece: no gap inside what is left
    path.write_text(json.dumps(doc))
    report = verify_checkpoints(root)
    assert report.damaged_steps == [2]
    assert "pieces of param/layers.0.attn.weight do not tile it" in format_verify(report)


def _keys(path: Path) -> list[str]:
    """The tensor keys of a safetensors file, from its header."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def _refused(rank: int, world: int, root: str):
    mesh1 = tm.mesh_of((world,))
    messages = []
    partial = tm.build(mesh1)
    w = partial.layers[0].experts.w1
    partial.layers[0].experts.w1 = nn.Parameter(DTensor.from_local(
        w.full_tensor(), mesh1, [Partial()], run_check=False))
    from torch.distributed.device_mesh import init_device_mesh
    mesh2 = init_device_mesh("cpu", (2, 2))
    strided = tm.build(None)
    strided.layers[0].attn.weight = nn.Parameter(distribute_tensor(
        strided.layers[0].attn.weight.data, mesh2,
        [Shard(0), _StridedShard(0, split_factor=2)]))
    for model in (partial, strided):
        with pytest.raises(UnsupportedLayoutError) as e:
            moc.Checkpointer(model, torch.optim.AdamW(model.parameters()), root)
        messages.append(str(e.value))
    return messages


def test_a_layout_moc_cannot_save_is_refused_at_construction_in_one_line(tmp_path):
    partial, strided = run_ranks(_refused, 4, str(tmp_path / "ckpt"))[0]
    for message in (partial, strided):
        assert "\n" not in message
    assert "layers.0.experts.w1" in partial and "Partial" in partial, partial
    assert "layers.0.attn.weight" in strided and "_StridedShard" in strided, strided
    assert not (tmp_path / "ckpt").exists() or not any(
        p.name.startswith("step-") for p in (tmp_path / "ckpt").iterdir())


class _SequenceParallelRouter(nn.Module):
    """A router whose weight is a replicated DTensor and whose logits are a DTensor
    sharded over the tokens (sequence parallel): each rank holds its own tokens' logits."""

    def __init__(self, mesh) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(distribute_tensor(torch.randn(tm.E, tm.D), mesh,
                                                     [Replicate()]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = DTensor.from_local(x, self.weight.device_mesh, [Shard(0)], run_check=False)
        return tokens @ self.weight.t()


def _top1_of_each_ranks_tokens(module: nn.Module, inputs: tuple, output: DTensor) -> DTensor:
    """`indices` for the sequence-parallel router: each rank's tokens' experts, still a
    DTensor of the logits' layout (an argmax of the DTensor itself needs torch 2.10)."""
    ids = output.to_local().argmax(-1, keepdim=True)
    return DTensor.from_local(ids, output.device_mesh, output.placements, run_check=False)


def _dtensor_router(rank: int, world: int):
    from moc.checkpoint.routing import RoutingRecorder
    model = tm.build(tm.mesh_of((world,)))
    router = _SequenceParallelRouter(model.layers[0].experts.w1.device_mesh)
    spec = moc.ExpertSpec.infer(model)
    recorder = RoutingRecorder(model, spec, routers={0: router},
                               indices=_top1_of_each_ranks_tokens)
    x = torch.randn(10 + rank, tm.D, generator=torch.Generator().manual_seed(rank))
    logits = router(x)
    assert isinstance(logits, DTensor)
    want = torch.bincount((x @ router.weight.to_local().t()).argmax(-1), minlength=tm.E)
    return recorder.take()[0], want


def test_watch_routing_counts_a_dtensor_routers_tokens_on_each_rank():
    for got, want in run_ranks(_dtensor_router, 2):
        assert torch.equal(got, want), (got, want)


def _tensor_parallel(model: tm.MoE, mesh) -> tm.MoE:
    """Tensor parallelism over `mesh`: attention weights split by column (Shard(1)), the
    routers by row (Shard(0)), every expert split along its F dimension (Shard(2) of the
    batched tensors: pieces of each expert), the rest replicated."""
    for block in model.layers:
        for module, name, placement in ((block.attn, "weight", Shard(1)),
                                        (block.attn, "bias", Replicate()),
                                        (block.router, "weight", Shard(0)),
                                        (block.experts, "w1", Shard(2)),
                                        (block.experts, "w2", Shard(1))):
            w = getattr(module, name)
            setattr(module, name, nn.Parameter(distribute_tensor(w.data, mesh, [placement])))
        # A router's load-balancing bias, sharded like its rows: a buffer saved as pieces.
        block.router.register_buffer("lb_bias", distribute_tensor(
            torch.arange(tm.E, dtype=torch.float32) + 10, mesh, [Shard(0)]))
    return model


def _train_tp(rank: int, world: int, root: str):
    model = _tensor_parallel(tm.build(None), tm.mesh_of((world,)))
    for block in model.layers:
        block.router.lb_bias.to_local().mul_(rank + 2)  # not the value a build gives
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in (1, 2):  # no forward needed: the state is what is checkpointed
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.1 * step)
        opt.step()
    engine = moc.Checkpointer(model, opt, root, policy=moc.PECPolicy.full())
    engine.save(2)
    engine.close()
    return {**tm.full_state(model, opt),
            **{f"buffer/{n}": tm.full(b) for n, b in model.named_buffers()}}


def _restore_tp(rank: int, world: int, root: str, mesh: tuple[int, ...] | None):
    """A restore with the router biases as buffers: sharded on a mesh, plain otherwise."""
    model = tm.build(tm.mesh_of(mesh) if mesh else None, seed=7)
    for block in model.layers:
        bias = torch.zeros(tm.E)
        block.router.register_buffer("lb_bias", distribute_tensor(
            bias, block.experts.w1.device_mesh, [Shard(0)]) if mesh else bias)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = moc.Checkpointer(model, opt, root, policy=moc.PECPolicy.full())
    report = engine.restore()
    engine.close()
    return report, {**tm.full_state(model, opt),
                    **{f"buffer/{n}": tm.full(b) for n, b in model.named_buffers()}}


def test_tensor_parallel_pieces_restore_into_one_process_and_onto_fsdp2_with_ep(tmp_path):
    root = str(tmp_path / "ckpt")
    want = run_ranks(_train_tp, 2, root)[0]
    entries = json.loads((tmp_path / "ckpt" / "step-00000002" / "manifest.json")
                         .read_text())["entries"]
    assert "param/layers.0.attn.weight@0,4" in entries  # a column piece
    assert "param/layers.0.experts.w1/expert=3@0,8" in entries  # a piece of an expert
    assert "param/layers.0.attn.bias" in entries  # replicated: whole, written once
    assert "buffer/layers.0.router.lb_bias@2" in entries  # a sharded buffer's piece
    assert torch.equal(want["buffer/layers.0.router.lb_bias"], torch.tensor([20., 22, 36, 39]))
    for world, mesh in ((1, None), (2, (2,))):
        report, got = run_ranks(_restore_tp, world, root, mesh)[0]
        assert report.step == 2
        bad = [k for k in want if not torch.equal(got[k], want[k])]
        assert not bad and set(got) == set(want), (world, bad)


def _moc_model_as_dtensors(rank: int, world: int, root: str):
    """moc's own Transformer laid out as torchtitan would: FSDP2 on every dense module,
    its batched experts as DTensors Shard(0) over the ranks."""
    from torch.distributed.fsdp import fully_shard

    from moc.model import Transformer
    from moc.model.transformer import Experts
    from moc.parallel import split_parameters
    from tests.distributed import TINY

    mesh = tm.mesh_of((world,))
    torch.manual_seed(0)
    model = Transformer(TINY)
    for module in model.modules():
        if isinstance(module, Experts):
            for name in ("w1_LDF", "w2_LFD"):
                w = getattr(module, name)
                setattr(module, name, nn.Parameter(distribute_tensor(w.data, mesh, [Shard(0)])))
        elif isinstance(module, nn.Linear | nn.Embedding | nn.LayerNorm):
            fully_shard(module, mesh=mesh)
    # The param groups of moc train's ShardedAdamW: matrices, vectors (no decay), experts.
    dense, experts = split_parameters(model)
    opt = torch.optim.AdamW([{"params": [p for _, p in dense if p.dim() >= 2]},
                             {"params": [p for _, p in dense if p.dim() < 2],
                              "weight_decay": 0.0},
                             {"params": [p for _, p in experts]}],
                            lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.1)
    opt.step()
    engine = moc.Checkpointer(model, opt, root, policy=moc.PECPolicy.full())
    engine.save(1)
    engine.close()
    return {n: tm.full(p) for n, p in model.named_parameters()}


def _moc_train_layout(rank: int, world: int, root: str):
    """moc train's own layout: expert parallelism over 2 ranks, ZeRO-1 AdamW."""
    from tests.distributed import build_sharded

    groups, model, opt = build_sharded(world)
    engine = moc.Checkpointer(model, opt, root, groups=groups, policy=moc.PECPolicy.full())
    report = engine.restore()
    engine.close()
    experts = {n: p.detach().clone() for n, p in model.named_parameters()}
    offset = next(m.expert_offset for m in model.modules() if hasattr(m, "expert_offset"))
    return report.step, experts, offset


def test_moc_models_dtensor_checkpoint_restores_into_moc_trains_own_layout(tmp_path):
    root = str(tmp_path / "ckpt")
    want = run_ranks(_moc_model_as_dtensors, 2, root)[0]
    for step, got, offset in run_ranks(_moc_train_layout, 2, root):
        assert step == 1
        for name, t in got.items():
            if t.shape == want[name].shape:
                assert torch.equal(t, want[name]), name
            else:  # this rank's experts of the layer
                assert torch.equal(t, want[name][offset:offset + t.shape[0]]), name


class _ListMoE(nn.Module):
    """Experts as an nn.ModuleList of MLPs, each sharded by FSDP2 (Mixtral's layout
    under fully_shard): each expert's tensors are pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(2):
            block = nn.Module()
            block.attn = nn.Linear(tm.D, tm.D)
            block.experts = nn.ModuleList(
                nn.Sequential(nn.Linear(tm.D, tm.F), nn.Linear(tm.F, tm.D)) for _ in range(tm.E))
            self.layers.append(block)


def _list_moe(rank: int, world: int, root: str, save: bool):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0 if save else 5)
    model = _ListMoE()
    if world > 1:
        mesh = tm.mesh_of((world,))
        for block in model.layers:
            for module in (block.attn, *block.experts):
                fully_shard(module, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = moc.Checkpointer(model, opt, root, policy=moc.PECPolicy.full())
    if save:
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.1)
        opt.step()
        engine.save(1)
    else:
        assert engine.restore().step == 1
    engine.close()
    return tm.full_state(model, opt)


@pytest.mark.parametrize(("saved", "restored"), [(2, 1), (1, 2)],
                         ids=["fsdp2-into-one-process", "one-process-into-fsdp2"])
def test_modulelist_experts_under_fsdp2_restore_across_the_layout_both_ways(tmp_path, saved,
                                                                          restored):
    root = str(tmp_path / "ckpt")
    want = run_ranks(_list_moe, saved, root, True)[0]
    entries = json.loads((tmp_path / "ckpt" / "step-00000001" / "manifest.json")
                         .read_text())["entries"]
    if saved == 2:  # expert 3's first layer, rows 8.. of its weight: a piece of an expert
        assert "param/layers.0.experts.0.weight/expert=3@8,0" in entries
    got = run_ranks(_list_moe, restored, root, False)[0]
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad and set(got) == set(want), bad


def _continue_on(rank: int, world: int, root: str, mesh: tuple[int, ...]):
    """Restore the newest step on another layout and save the next one (PEC K=1)."""
    model = tm.build(tm.mesh_of(mesh), seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = moc.Checkpointer(model, opt, root, policy=moc.PECPolicy(k=1))
    step = engine.restore().step
    tm.train_step(model, opt, step + 1)
    engine.save(step + 1)
    engine.close()
    return step, tm.full_state(model, opt)


def test_a_chain_never_mixes_the_pieces_of_two_layouts(tmp_path):
    """A partial chain written on 2 ranks, continued on 4: the first step on the new
    layout saves every expert (an expert made of pieces of two steps would be neither),
    its manifest names only the new layout's pieces, and it restores bitwise on 2."""
    root = str(tmp_path / "ckpt")
    run_ranks(_train, 2, "sync", root)
    step, want = run_ranks(_continue_on, 4, root, (4,))[0]
    manifest = json.loads((tmp_path / "ckpt" / f"step-{step + 1:08d}" / "manifest.json")
                          .read_text())
    assert manifest["experts_saved"] == {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]}
    pieces = sorted(k for k in manifest["entries"] if k.startswith("param/layers.0.attn.weight"))
    assert pieces == [f"param/layers.0.attn.weight@{r},0" for r in (0, 2, 4, 6)], pieces
    assert all(e["step"] == step + 1 for k, e in manifest["entries"].items()
               if k.startswith("param/"))
    report, got = run_ranks(_restore, 2, "sync", root, (2,))[0]
    assert report.step == step + 1 and report.lost_tokens == 0
    assert not _same(got, want), _same(got, want)


def _uneven(rank: int, world: int, root: str):
    """4 experts and 4-row routers over 3 ranks: pieces of 2, 2 and 0 rows (the last rank
    holds no expert and nothing of the routers)."""
    model = tm.build(tm.mesh_of((world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tm.train_step(model, opt, 1)
    engine = moc.Checkpointer(model, opt, root, policy=moc.PECPolicy.full())
    engine.save(1)
    engine.close()
    return tm.full_state(model, opt), tuple(model.layers[0].experts.w1.to_local().shape)


def test_ranks_holding_an_empty_piece_save_and_restore_on_any_layout(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_ranks(_uneven, 3, root)
    assert [shape[0] for _, shape in results] == [2, 2, 0]
    want = results[0][0]
    for world, mesh in ((3, (3,)), (1, None)):
        report, got = run_ranks(_restore, world, "sync", root, mesh)[0]
        assert report.step == 1 and not _same(got, want), (world, _same(got, want))
