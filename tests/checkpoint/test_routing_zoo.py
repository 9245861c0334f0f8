"""`watch_routing` on every MoE family transformers ships (tests/checkpoint/hf_moe_zoo.py):
it counts exactly the expert assignments each forward made, or refuses when it is built,
in one line naming the module and what to pass instead. Never an error in the first
forward, never a silently wrong count.

The truth each count is checked against is read beside the recorder, by hooks of the
test's own: the expert ids each layer's experts were called with (what the block
dispatched); for Llama 4, whose experts run on every token weighted by the router's
scores, the top-k of the router's own logits (Llama4Router's own call)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from moc.checkpoint.routing import ROUTER_NAMES, RoutingRecorder, layer_containers
from moc.checkpoint.spec import ExpertSpec

transformers = pytest.importorskip("transformers")
from tests.checkpoint.hf_moe_zoo import build, families, forward_loss  # noqa: E402

N_EXPERTS = 4  # every tiny config's

REFUSED = {
    "dbrx": ("spec", "its experts' weights are (E*F, D) tensors in a child of `experts`"),
    "doge": ("spec", "its experts are rows of embedding tables, no module named `experts`"),
    "jetmoe": ("spec", "its attention `experts` hold a bias of their own, weights in children"),
    "longcat_flash": ("spec", "gate_up_proj holds the zero-computation experts too"),
    "nllb_moe": ("spec", "its experts are an nn.ModuleDict of expert_<i>"),
    "switch_transformers": ("spec", "its experts are an nn.ModuleDict of expert_<i>"),
    "vitpose_backbone": ("router", "experts picked per sample by a dataset index"),
}
"""transformers 5.24 families refused when watched, and why: an `ExpertSpec` cannot be
inferred ("spec": moc cannot slice its experts one by one), or no router ("router"). A
new family refused belongs here once that is checked."""

TRUTH_FROM_LOGITS = {"llama4"}
"""Families whose experts are not called with the ids (Llama 4 runs every expert on
every token, weighted by scores that are zero off the router's top-k)."""


def _built(family: str) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notices about kernels not installed
        try:
            return build(family)
        except Exception as e:  # a config key this generic shrink does not know
            pytest.skip(f"{family} does not build tiny here: {type(e).__name__}: {e}")


def _runs(family: str, model: nn.Module) -> None:
    """Skip a family whose tiny build does not run a forward unwatched: a failure there is
    the generic shrink's, never moc's."""
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            forward_loss(model, 0)
    except Exception as e:
        pytest.skip(f"{family} does not run tiny here: {type(e).__name__}: {e}")


class ExpertCalls:
    """The ids each MoE layer's experts were called with, by the test's own hooks."""

    def __init__(self, model: nn.Module, spec: ExpertSpec) -> None:
        named = dict(model.named_modules())
        self.ids: dict[int, list[torch.Tensor]] = {}
        self.logits: dict[int, list[tuple[torch.Tensor, int]]] = {}
        for layer, containers in enumerate(layer_containers(spec)):
            (container,) = containers
            block = named[container.rpartition(".")[0]]
            router = next(getattr(block, n) for n in ROUTER_NAMES if hasattr(block, n))
            named[container].register_forward_pre_hook(self._called(layer), with_kwargs=True)
            router.register_forward_hook(self._routed(layer))

    def _called(self, layer: int) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            ints = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                    and not a.dtype.is_floating_point]
            if ints:
                self.ids.setdefault(layer, []).append(ints[0].detach().clone())
        return hook

    def _routed(self, layer: int) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            floats = [t for t in (output if isinstance(output, tuple) else (output,))
                      if isinstance(t, torch.Tensor) and t.dtype.is_floating_point]
            k = getattr(module, "top_k", 0)
            self.logits.setdefault(layer, []).append((floats[-1].detach(), k))
        return hook

    def counts(self, n_layers: int, from_logits: bool) -> torch.Tensor:
        rows = []
        for layer in range(n_layers):
            ids = ([lg.topk(k, dim=-1).indices for lg, k in self.logits.get(layer, [])]
                   if from_logits else self.ids.get(layer, []))
            rows.append(torch.bincount(torch.cat([t.flatten() for t in ids]),
                                       minlength=N_EXPERTS) if ids
                        else torch.zeros(N_EXPERTS, dtype=torch.int64))
        return torch.stack(rows)


def _refused(model: nn.Module) -> bool:
    """Whether moc refuses to watch `model`. A family refused in one transformers release
    may be rewritten into a shape moc slices in the next (LongCat-Flash's experts lost
    their zero-computation rows in 5.25): it is then held to an exact count like any other."""
    try:
        RoutingRecorder(model).remove()
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("family", families())
def test_each_transformers_moe_is_counted_exactly_or_refused_when_watched(family):
    model = _built(family)
    if family in REFUSED and _refused(model):
        if REFUSED[family][0] == "spec":  # never a spec that is silently wrong
            with pytest.raises(ValueError, match=r"build the spec|by hand"):
                ExpertSpec.infer(model)
        with pytest.raises(ValueError) as refused:
            RoutingRecorder(model)
        message = str(refused.value)
        assert "\n" not in message, message
        assert type(model).__name__ in message or any(
            f"'{name}'" in message or f" {name}," in message
            for name, _ in model.named_modules() if name), message
        assert "ExpertSpec" in message or "routers=" in message, message
        return
    _runs(family, model)
    spec = ExpertSpec.infer(model)
    assert spec.n_experts == N_EXPERTS, f"{family}: the spec found {spec.n_experts} experts"
    truth = ExpertCalls(model, spec)
    recorder = RoutingRecorder(model, spec)
    for step in range(2):
        forward_loss(model, step).backward()
    assert (family in TRUTH_FROM_LOGITS) == (len(truth.ids) == 0), sorted(truth.ids)
    want = truth.counts(spec.n_moe_layers, family in TRUTH_FROM_LOGITS)
    # Every token chose k experts in each layer it went through (steps x tokens x k); a
    # layer it did not (Ernie 4.5 VL's vision experts, for text) routed none.
    per_layer = want.sum(dim=1)
    k = int(per_layer.max()) // (2 * 2 * 8)
    assert k >= 1 and all(int(n) in (0, 2 * 2 * 8 * k) for n in per_layer), per_layer
    assert torch.equal(recorder.take(), want)


# -- the hooks change nothing, and count each forward once under recomputation -------------

SHAPES = ("gpt_oss", "granitemoe", "jamba", "gemma4", "llama4", "zaya", "mixtral")
"""One family per way of routing: the block returns (y, scores) (GPT-OSS), a child
`router` (Granite, Jamba), the block is the decoder layer (Gemma 4), a router returning
only floats (Llama 4), a 4-tuple with a skip expert (Zaya), a child `gate` (Mixtral)."""


@pytest.mark.parametrize("family", SHAPES)
def test_loss_and_gradients_with_the_recorder_are_bitwise_those_without(family):
    results = []
    for watch in (False, True):
        model = _built(family)
        recorder = RoutingRecorder(model) if watch else None
        loss = forward_loss(model, 0)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
        if recorder is not None:
            assert recorder.take().any()
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all((a is None and b is None) or torch.equal(a, b)
               for a, b in zip(grads_a, grads_b, strict=True))


@pytest.mark.parametrize("family", ("gpt_oss", "gemma4"))
@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_counts_each_forward_once(family, reentrant):
    counts = []
    for recompute in (False, True):
        model = _built(family)
        if recompute:  # transformers 5.x renamed gradient_checkpointing_enable
            enable = getattr(model, "activation_checkpointing_enable", None)
            (enable or model.gradient_checkpointing_enable)({"use_reentrant": reentrant})
        recorder = RoutingRecorder(model)
        forward_loss(model, 0).backward()
        counts.append(recorder.take())
    assert counts[0].sum() > 0
    assert torch.equal(counts[0], counts[1])
