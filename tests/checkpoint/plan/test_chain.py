"""ChainState: what the next checkpoint of a chain writes (pure, no process group)."""

from __future__ import annotations

import torch

from moc.checkpoint.plan.chain import ChainState
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.policy.tokens import TokenLedger
from moc.checkpoint.spec import ExpertParam, ExpertSpec, expert_key
from moc.checkpoint.store.manifest import Entry, Manifest

N, LAYERS = 4, 2
SPEC = ExpertSpec(N, LAYERS, tuple(
    ExpertParam(f"l{m}.experts.w", f"l{m}.experts.w", m, 0, tuple(range(N)))
    for m in range(LAYERS)))


def _manifest(chain: ChainState, step: int, written: list[list[int]], ledger: TokenLedger,
              prev: dict[str, Entry]) -> Manifest:
    """What an engine commits: the chain's template and entries pointing at `step` for
    every key written, at the older copy for the others."""
    wanted = chain.wanted(written, step)
    entries = dict(prev)
    keys = [expert_key(kind, f"l{m}.experts.w", e, state)
            for m in range(LAYERS) for e in range(N)
            for kind, state in (("param", None), ("optim", "exp_avg"))]
    for key in [*keys, "param/embed.weight"]:
        if wanted(key):
            entries[key] = Entry(step, "rank-00000.safetensors", "F32", (2,), 0)
    template = chain.template(step, mode="pec", layout={"world_size": 1, "ep": 1},
                              model_meta={}, extra={"step": step}, written=written,
                              ledger=ledger)
    return Manifest(entries=entries, files={}, **template)


def _run(policy: PECPolicy, steps: list[int]) -> tuple[ChainState, list[Manifest]]:
    chain = ChainState(SPEC, policy, ep=1)
    ledger = TokenLedger(LAYERS, N, policy.initial_k(N))
    manifests: list[Manifest] = []
    for step in steps:
        ledger.add_synced(torch.ones(LAYERS, N, dtype=torch.int64))
        selected = chain.select(step, ledger)
        written = chain.written(selected, step)
        m = _manifest(chain, step, written, ledger, chain.entries)
        chain.advance(m)
        ledger.committed(m.tokens)
        manifests.append(m)
    return chain, manifests


def test_a_chain_starts_full_then_saves_k_and_advances_on_commit():
    chain, (first, second, third) = _run(PECPolicy(k=1), [10, 20, 30])
    assert first.experts_saved == {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]}
    # The full one is checkpoint c = 0; then layer m saves expert (m + c) mod N.
    assert second.experts_saved == {"0": [1], "1": [2]}
    assert third.experts_saved == {"0": [2], "1": [3]}
    assert (first.policy["index"], second.policy["index"], chain.index) == (0, 1, 3)
    assert chain.manifest is third
    # Each expert's newest copy: where its tracked (weight) tensor was last written.
    assert chain.saved_at.tolist() == [[10, 20, 30, 10], [10, 10, 20, 30]]


def test_only_selected_partial_keys_and_keys_without_a_copy_are_wanted():
    chain, _ = _run(PECPolicy(k=1, apply_to="weights"), [10])
    wanted = chain.wanted([[2], [3]], 20)
    assert wanted("param/embed.weight")                        # non-expert: always
    assert wanted(expert_key("param", "l0.experts.w", 2))       # selected
    assert not wanted(expert_key("param", "l0.experts.w", 1))   # partial, not selected
    assert wanted(expert_key("optim", "l0.experts.w", 1, "exp_avg"))  # W: optim is full
    assert wanted(expert_key("param", "l9.experts.w", 0)) is True  # no copy yet


def test_saving_a_step_again_rewrites_what_lives_in_its_directory():
    chain, _ = _run(PECPolicy(k=1), [10, 20])
    # Step 20 saved expert 1 of layer 0 and 2 of layer 1; saved again, they are
    # rewritten (their only copies are in the directory being replaced) besides the
    # new choice.
    assert chain.written([[3], [3]], 20) == [[1, 3], [2, 3]]
    assert chain.written([[3], [3]], 30) == [[3], [3]]


def test_the_template_is_the_manifest_but_its_entries():
    _, (first,) = _run(PECPolicy(k=2, dynamic_k=True), [10])
    assert first.step == 10 and first.mode == "pec" and first.extra == {"step": 10}
    assert first.experts == {"n_experts": N, "n_moe_layers": LAYERS,
                             "stems": {"l0.experts.w": 0, "l1.experts.w": 1},
                             "params": {"l0.experts.w": {"dim": 0}, "l1.experts.w": {"dim": 0}}}
    assert first.policy["k"] == 2 and first.policy["lost_base"] == [0, 0]
    assert first.tokens["at_save"] == first.tokens["cumulative"]  # every expert saved


def test_reset_starts_a_new_full_chain():
    chain, _ = _run(PECPolicy(k=1), [10, 20])
    chain.reset()
    assert chain.manifest is None and chain.index == 0
    assert chain.select(30, TokenLedger(LAYERS, N, 1)) == [list(range(N))] * LAYERS
