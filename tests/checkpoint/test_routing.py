"""RoutingRecorder: routed tokens counted by forward hooks, on moc's model and on tiny
transformers Mixtral, Qwen2-MoE and OLMoE models (built from a config: no downloads)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.policy.tokens import RoutingNotRecordedWarning
from moc.checkpoint.routing import RoutingRecorder
from moc.checkpoint.spec import ExpertSpec
from moc.checkpoint.sync import Checkpointer
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.model import ModelConfig, Transformer
from tests.distributed import build_sharded, run_ranks

CFG = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)
HF = ("mixtral", "qwen2_moe", "olmoe")
VOCAB = 128


def _moc_model(seed: int = 0, cfg: ModelConfig = CFG) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg).train()


def _hf_model(kind: str, seed: int = 0) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                  vocab_size=VOCAB, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if kind == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=4, **common)
        cls = transformers.MixtralForCausalLM
    elif kind == "qwen2_moe":  # its shared expert is dense: no router, not in the spec
        config = transformers.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=16,
                                             shared_expert_intermediate_size=16, **common)
        cls = transformers.Qwen2MoeForCausalLM
    else:
        config = transformers.OlmoeConfig(num_experts=4, **common)
        cls = transformers.OlmoeForCausalLM
    torch.manual_seed(seed)
    return cls(config).train()


def _batch(step: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(step))


def _moc_forward(model: nn.Module, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, the counts moc's trainer hands record_routing) of one forward."""
    idx = _batch(step, CFG.vocab_size)
    out = model(idx, idx)
    return out.loss, out.tokens_per_expert


def _hf_forward(model: nn.Module, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, counts by hand: top-k of each layer's router logits, bincount)."""
    idx = _batch(step, VOCAB)
    out = model(idx, labels=idx, output_router_logits=True)
    k = model.config.num_experts_per_tok
    n = out.router_logits[0].shape[-1]
    counts = torch.stack([
        torch.bincount(logits.float().softmax(-1).topk(k, dim=-1).indices.flatten(),
                       minlength=n) for logits in out.router_logits])
    return out.loss, counts


def _model_and_forward(kind: str, seed: int = 0) -> tuple[nn.Module, Callable]:
    if kind == "moc":
        return _moc_model(seed), _moc_forward
    return _hf_model(kind, seed), _hf_forward


# -- (a) the counts -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ("moc", *HF))
def test_hooks_count_what_the_forward_routed(kind):
    model, forward = _model_and_forward(kind)
    recorder = RoutingRecorder(model)
    assert sorted(recorder.routers) == [0, 1]
    total = torch.zeros(2, 4, dtype=torch.int64)
    for step in range(3):
        loss, by_hand = forward(model, step)
        loss.backward()
        total += by_hand
    assert by_hand.sum() == 2 * 8 * 2 * 2  # layers x tokens x top-2: a real forward
    assert torch.equal(recorder.take(), total)
    assert not recorder.take().any()  # take resets


def test_moc_counts_are_those_kept_after_capacity_dropping():
    cfg = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4,
                      capacity_factor=0.5)
    model = _moc_model(0, cfg)
    recorder = RoutingRecorder(model)
    idx = _batch(0, cfg.vocab_size)
    out = model(idx, idx)
    assert out.tokens_per_expert.sum() < 2 * 16 * 2  # some assignments were dropped
    assert torch.equal(recorder.take(), out.tokens_per_expert)


def test_layers_follow_the_spec_order_not_the_model_order():
    model = _moc_model()
    spec = ExpertSpec.from_modules(model, ["layers.1.ffn.experts", "layers.0.ffn.experts"])
    recorder = RoutingRecorder(model, spec)
    assert recorder.routers == {0: model.layers[1].ffn.router, 1: model.layers[0].ffn.router}
    _, counts = _moc_forward(model, 0)
    assert torch.equal(recorder.take(), counts.flip(0))


class V4SparseMoeBlock(nn.Module):
    """The transformers v4 layout (Mixtral 4.x): `gate` is an nn.Linear returning
    logits, the block keeps `top_k`, experts are an nn.ModuleList."""

    def __init__(self, d: int = 16, n_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n_experts))

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits_NE = self.gate(x_ND)
        weights_NK, ids_NK = F.softmax(logits_NE, dim=1, dtype=torch.float).topk(self.top_k)
        out_ND = torch.zeros_like(x_ND)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(ids_NK == e)
            out_ND = out_ND.index_add(0, token, expert(x_ND[token]) * weights_NK[token, slot,
                                                                               None])
        return out_ND, logits_NE


class V4Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"mlp": V4SparseMoeBlock()})
                                    for _ in range(2))

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        logits = []
        for layer in self.layers:
            y, lg = layer["mlp"](x_ND)
            x_ND = x_ND + y
            logits.append(lg)
        return x_ND, logits


def test_transformers_v4_gate_logits_are_counted_as_the_block_routes():
    torch.manual_seed(0)
    model = V4Model().train()
    recorder = RoutingRecorder(model)
    _, logits = model(torch.randn(32, 16))
    by_hand = torch.stack([torch.bincount(F.softmax(lg, dim=1, dtype=torch.float)
                                          .topk(2).indices.flatten(), minlength=4)
                           for lg in logits])
    assert torch.equal(recorder.take(), by_hand)


# -- (b) PLT with the recorder equals PLT hand-fed -----------------------------------------

def _pec_run(root, kind: str, watch: bool, engine: type = Checkpointer) -> tuple:
    """Train 5 steps with K=1 sequential PEC (a checkpoint every step), then restore
    into a fresh model: the losses and the recovery's PLT."""
    model, forward = _model_and_forward(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = engine(model, opt, root, policy=PECPolicy(k=1), interval=1)
    recorder = ckpt.watch_routing(model) if watch else None
    losses = []
    for step in range(1, 6):
        loss, counts = forward(model, step)
        loss.backward()
        ckpt.wait_for_snapshot()
        opt.step()
        opt.zero_grad()
        if recorder is None:
            ckpt.record_routing(counts)
        ckpt.maybe_save(step)
        losses.append(loss.detach())
    ckpt.close()
    fresh, _ = _model_and_forward(kind, seed=1)
    ckpt = engine(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2), root,
                  policy=PECPolicy(k=1), interval=1)
    report = ckpt.restore()
    ckpt.close()
    return torch.stack(losses), report


@pytest.mark.parametrize("kind", ("moc", *HF))
def test_plt_with_the_recorder_equals_plt_hand_fed(tmp_path, kind):
    losses, watched = _pec_run(tmp_path / "watched", kind, watch=True)
    hand_losses, hand = _pec_run(tmp_path / "hand", kind, watch=False)
    assert watched.step == 5 and watched.lost_tokens > 0  # K=1: a lossy recovery
    assert (watched.lost_per_layer, watched.plt) == (hand.lost_per_layer, hand.plt)
    assert torch.equal(losses, hand_losses)


def test_two_level_engine_watches_routing_too(tmp_path):
    _, watched = _pec_run(tmp_path / "watched", "moc", True, TwoLevelCheckpointer)
    _, hand = _pec_run(tmp_path / "hand", "moc", False, TwoLevelCheckpointer)
    assert watched.lost_tokens is not None
    assert (watched.source, watched.lost_per_layer, watched.plt) == (
        hand.source, hand.lost_per_layer, hand.plt)


@pytest.mark.parametrize("end", ["close", "abandon"])
def test_the_recorder_of_an_engine_ends_with_it(tmp_path, end):
    """`moc.run` makes a new engine on the same model at each generation: the recorder
    each one's `watch_routing` made must not outlive it, counting into a ledger nobody
    reads (one more set of hooks per recovery)."""
    model = _moc_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    for i in range(2):
        ckpt = Checkpointer(model, optimizer, tmp_path / f"ckpt{i}", policy=PECPolicy(k=1))
        recorder = ckpt.watch_routing(model)
        assert sum(len(m._forward_hooks) for m in model.modules()) > hooks
        getattr(ckpt, end)()
        assert sum(len(m._forward_hooks) for m in model.modules()) == hooks
        recorder.remove()  # still idempotent


# -- (c) the model's outputs and loss are its own -------------------------------------------

@pytest.mark.parametrize("kind", ("moc", *HF))
def test_loss_and_gradients_with_the_recorder_are_bitwise_those_without(kind):
    results = []
    for watch in (False, True):
        model, forward = _model_and_forward(kind)
        recorder = RoutingRecorder(model) if watch else None
        loss, _ = forward(model, 0)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
        if recorder is not None:
            assert recorder.take().any()
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True)
               if a is not None)


# -- (d) which forwards count ----------------------------------------------------------------

@pytest.mark.parametrize("kind", ("moc", "mixtral"))
def test_eval_and_no_grad_forwards_are_not_counted(kind):
    model, forward = _model_and_forward(kind)
    recorder = RoutingRecorder(model)
    model.eval()
    forward(model, 0)
    model.train()
    with torch.no_grad():
        forward(model, 1)
    with torch.inference_mode():
        forward(model, 2)
    assert not recorder.take().any()
    forward(model, 3)
    assert recorder.take().any()


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_recomputation_counts_each_forward_once(reentrant):
    class Recomputed(nn.Module):
        def __init__(self, block: nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=reentrant)

    plain, checkpointed = _moc_model(), _moc_model()
    checkpointed.layers = nn.ModuleList(Recomputed(b) for b in checkpointed.layers)
    counts = []
    for model in (plain, checkpointed):
        recorder = RoutingRecorder(model)
        for step in range(2):  # two micro-batches, then backward: accumulation
            loss, _ = _moc_forward(model, step)
            loss.backward()
        counts.append(recorder.take())
    assert counts[0].sum() == 2 * 2 * 16 * 2
    assert torch.equal(counts[0], counts[1])


@pytest.mark.parametrize("reentrant", [False, True])
def test_transformers_gradient_checkpointing_counts_each_forward_once(reentrant):
    counts = []
    for recompute in (False, True):
        model = _hf_model("mixtral")
        if recompute:  # transformers 5.x renamed gradient_checkpointing_enable
            enable = getattr(model, "activation_checkpointing_enable", None)
            (enable or model.gradient_checkpointing_enable)({"use_reentrant": reentrant})
        recorder = RoutingRecorder(model)
        loss, _ = _hf_forward(model, 0)
        loss.backward()
        counts.append(recorder.take())
    assert torch.equal(counts[0], counts[1])


# -- (e) routers that cannot be found, and plugging any router ------------------------------

class Chooser(nn.Module):
    """Top-1 routing through a child called `choose` (not `gate` or `router`)."""

    def __init__(self) -> None:
        super().__init__()
        self.choose = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.choose(x).argmax(-1)
        return x + torch.stack([self.experts[int(e)](r) for r, e in zip(x, ids, strict=True)])


def test_a_model_whose_routers_cannot_be_found_is_a_clear_error():
    model = nn.Sequential(Chooser(), Chooser())
    with pytest.raises(ValueError, match=r"found a router for 0 of the 2 MoE layers.*"
                                         r"experts of layer 0 \(block 0, experts 0.experts\)"
                                         r".*routers=\{layer: module"):
        RoutingRecorder(model)


def test_any_router_plugs_in_with_routers_and_indices():
    torch.manual_seed(0)
    model = nn.Sequential(Chooser(), Chooser()).train()
    recorder = RoutingRecorder(model, routers={0: model[0].choose, 1: "1.choose"},
                               indices=lambda module, inputs, output: output.argmax(-1))
    x = torch.randn(6, 8)
    model(x)
    with torch.no_grad():  # not counted
        by_hand = torch.stack([
            torch.bincount(model[0].choose(x).argmax(-1), minlength=4),
            torch.bincount(model[1].choose(model[0](x)).argmax(-1), minlength=4)])
    assert torch.equal(recorder.take(), by_hand)


def test_observe_counts_a_router_that_cannot_be_hooked():
    model = nn.Sequential(Chooser(), Chooser())
    recorder = RoutingRecorder(model, routers={})
    recorder.observe(1, torch.tensor([[0, 3], [3, 3]]))
    with torch.no_grad():
        recorder.observe(1, torch.tensor([2]))  # not a training forward
    assert recorder.take().tolist() == [[0, 0, 0, 0], [1, 0, 0, 3]]
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        recorder.observe(2, torch.tensor([0]))


class Scores(nn.Module):
    """A router returning (logits, probabilities): no ids, no top_k to take them."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x.softmax(-1)


class Logits(nn.Module):
    """A router returning (logits, probabilities) over the 4 experts, and no top_k."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[..., :4], x[..., :4].softmax(-1)


def test_a_router_whose_output_cannot_be_read_says_how_to_plug_it():
    """A router whose output is known only when it runs (`Scores`, not an nn.Linear)
    can only be refused at its first forward; an nn.Linear is refused at the call."""
    model = nn.Sequential(Chooser(), Chooser(), Scores()).train()
    with pytest.raises(ValueError, match=r"^MoE layer 0's router is an nn.Linear returning "
                                         r"logits.*pass watch_routing\(model, top_k=k\)"):
        RoutingRecorder(model, routers={0: model[0].choose, 1: model[2]})
    recorder = RoutingRecorder(model, routers={0: model[0], 1: model[2]},
                               indices=lambda m, i, o: o[..., 0].long().clamp(0, 3))
    recorder.remove()  # with indices= the Linear's k is not needed
    logits = nn.Sequential(Chooser(), Chooser(), Logits()).train()
    recorder = RoutingRecorder(logits, routers={1: logits[2]})
    with pytest.raises(ValueError, match=r"no top_k is known: pass watch_routing\(model, "
                                         r"top_k=k\)"):
        logits(torch.randn(2, 8))
    recorder.remove()
    recorder = RoutingRecorder(model, routers={1: model[2]})
    with pytest.raises(TypeError, match=r"cannot read the experts Scores chose.*indices=fn"):
        model(torch.randn(2, 8))
    recorder.remove()
    model(torch.randn(2, 8))  # the hooks are gone


class RouterBlock(Chooser):
    """A block with a `router` child (as moc's MoE) that returns only its output: its
    router's logits are read, and it picks the top-1 (argmax)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = self.choose


def test_a_block_whose_router_returns_logits_is_counted_with_its_top_k():
    torch.manual_seed(0)
    model = nn.Sequential(RouterBlock(), RouterBlock()).train()
    with pytest.raises(ValueError, match=r"^MoE layer 0's router is an nn.Linear returning "
                                         r"logits, and neither it nor its block RouterBlock "
                                         r"has a top_k: pass watch_routing\(model, top_k=k\)"):
        RoutingRecorder(model)  # at the call, not at the first forward (issue 50)
    recorder = RoutingRecorder(model, top_k=1)
    x = torch.randn(6, 8)
    model(x)
    with torch.no_grad():
        by_hand = torch.stack([
            torch.bincount(model[0].choose(x).argmax(-1), minlength=4),
            torch.bincount(model[1].choose(model[0](x)).argmax(-1), minlength=4)])
    assert torch.equal(recorder.take(), by_hand)


class IdsRouter(nn.Module):
    """Routes every token to expert 0, as (logits, ids)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.zeros(len(x), dtype=torch.int64)


class CountsAndIds(nn.Module):
    """A block that returns (y, counts_E) and whose router returns ids: the block's
    counts win (they are what it kept, as moc's MoE after capacity dropping)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = IdsRouter()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.router(x)
        return self.experts[0](x), torch.tensor([2, 0, 0, 1])


def test_a_block_returning_its_counts_last_is_read_before_its_router():
    model = nn.Sequential(CountsAndIds()).train()
    recorder = RoutingRecorder(model)
    model(torch.randn(3, 8))
    assert recorder.take().tolist() == [[2, 0, 0, 1]]  # not [[3, 0, 0, 0]]: the router's


# -- the engine's side: one source of counts, no false warning ------------------------------

def test_record_routing_while_watching_is_refused_and_remove_ends_watching(tmp_path):
    model, _ = _model_and_forward("moc")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(model, opt, tmp_path, policy=PECPolicy(k=1))
    with ckpt.watch_routing(model):
        with pytest.raises(ValueError, match="count every token twice"):
            ckpt.record_routing(torch.zeros(2, 4, dtype=torch.int64))
        with pytest.raises(ValueError, match="already watches"):
            ckpt.watch_routing(model)
    ckpt.record_routing(torch.zeros(2, 4, dtype=torch.int64))  # removed: by hand again
    with pytest.raises(ValueError, match="after record_routing"):
        ckpt.watch_routing(model)
    ckpt.close()


def test_no_routing_warning_while_a_recorder_watches(tmp_path):
    model, _ = _model_and_forward("moc")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(model, opt, tmp_path, policy=PECPolicy(k=1), interval=1)
    ckpt.watch_routing(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RoutingNotRecordedWarning)
        ckpt.save(1)  # no forward yet: nothing counted, but counts are being taken
    ckpt.close()


# -- (f) DDP and expert parallelism on real ranks --------------------------------------------

def _ranks_watch(rank: int, world: int, root: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(Transformer(CFG).train(), find_unused_parameters=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ckpt = Checkpointer(ddp, opt, f"{root}/ddp", policy=PECPolicy(k=1), interval=1)
    recorder = ckpt.watch_routing(ddp)
    hand = torch.zeros(2, CFG.n_experts, dtype=torch.int64)
    for step in range(1, 4):
        idx = _batch(10 * step + rank, CFG.vocab_size)  # each rank its own tokens
        out = ddp(idx, idx)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        hand += out.tokens_per_expert
        ckpt.save(step)
    cumulative = ckpt.parts.ledger.cumulative.clone()  # summed over ranks at each save
    recorder.remove()
    ckpt.close()

    # Expert parallelism: each rank holds 2 of the 4 experts, routes to all 4.
    groups, model, ep_opt = build_sharded(2)
    ep_ckpt = Checkpointer(model, ep_opt, f"{root}/ep", groups=groups,
                           policy=PECPolicy(k=1), interval=1)
    with ep_ckpt.watch_routing(model):
        out = model(_batch(rank, CFG.vocab_size), _batch(rank, CFG.vocab_size))
        ep_counts = ep_ckpt.parts.ledger.take_pending()
    ep_ckpt.close()
    return {"hand": hand, "cumulative": cumulative, "ep_counts": ep_counts,
            "ep_hand": out.tokens_per_expert}


@pytest.mark.integration
def test_ddp_and_expert_parallel_ranks_count_their_own_tokens_over_global_experts(tmp_path):
    r0, r1 = run_ranks(_ranks_watch, 2, str(tmp_path))
    assert not torch.equal(r0["hand"], r1["hand"])  # the ranks routed different tokens
    assert torch.equal(r0["cumulative"], r0["hand"] + r1["hand"])
    assert torch.equal(r1["cumulative"], r0["cumulative"])
    for r in (r0, r1):
        assert torch.equal(r["ep_counts"], r["ep_hand"])
        assert r["ep_counts"].shape == (2, CFG.n_experts)
