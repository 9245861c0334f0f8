"""The chain of partial checkpoints: what the newest committed one holds, and what the next
one must write.

A partial checkpoint writes all non-expert state and K experts per MoE layer; every other
key of its manifest points at the older step that holds its newest copy. So the next
checkpoint depends on the previous committed manifest: which keys already have a usable
copy (`wanted`), how old each expert's copy is (`saved_at`, for load-aware selection),
where the sequential rotation stands (`index`). `ChainState` keeps exactly that and
changes only when a checkpoint is committed (`advance`) or the chain starts over
(`reset`); everything else here is a pure function of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from moc.checkpoint.policy.selection import PECPolicy, SelectionContext, select_experts
from moc.checkpoint.policy.tokens import TokenLedger
from moc.checkpoint.spec import ExpertSpec, parse_expert_key
from moc.checkpoint.store.manifest import Entry, Manifest

_NONE = 2**62
"""No copy yet (newest_copies); reported as step 0."""


class ChainState:
    """The newest committed checkpoint of a chain, as the next save needs it.

    Owner: whoever plans checkpoints (the caller's thread in the synchronous engine, the
    snapshot thread in the two-level one; its caller only after `wait_for_snapshot`).
    """

    def __init__(self, spec: ExpertSpec, policy: PECPolicy, ep: int,
                 model_config: dict[str, Any] | None = None, pieces: int = 0) -> None:
        self.spec = spec
        self.pieces = pieces
        """The layout's boxes (`RankState.pieces`): a manifest of other boxes starts a
        new chain."""
        self.policy = policy
        self.ep = ep
        self.stems = spec.stems()
        self.names = spec.names()
        """Stem -> how the model names its experts' tensors (`ExpertSpec.names`)."""
        self.model_config = model_config or {}
        """The model's own configuration (a transformers config as JSON), for export."""
        self.manifest: Manifest | None = None
        """The newest committed manifest of this chain (None: the next save starts one)."""
        self.index = 0
        """Checkpoints committed in this chain so far: the sequential rotation's c."""
        self.saved_at = self._zeros()
        """(layers x experts) step of each expert's newest saved copy (0: none)."""

    def _zeros(self) -> torch.Tensor:
        return torch.zeros((self.spec.n_moe_layers, self.spec.n_experts), dtype=torch.int64)

    def layout(self, world_size: int, ep: int) -> dict[str, int]:
        """The parallel layout as manifests and snapshots record it; with DTensors, the
        boxes their pieces are cut into ("pieces", `RankState.pieces`): a chain, and a
        memory snapshot, continue only on the layout that wrote them."""
        out = {"world_size": world_size, "ep": ep}
        if self.pieces:
            out["pieces"] = self.pieces
        return out

    @property
    def entries(self) -> dict[str, Entry]:
        return self.manifest.entries if self.manifest is not None else {}

    @property
    def tracked_kind(self) -> str:
        """The partial part of expert state that staleness and PLT follow: the weights,
        unless only the optimizer state is partial."""
        return "optim" if self.policy.apply_to == "optimizer" else "param"

    # -- changes -----------------------------------------------------------------------------

    def advance(self, manifest: Manifest) -> None:
        """`manifest` is committed (or restored): the chain continues from it, unless
        it cuts DTensors into other pieces than this layout does (`EngineParts.layout`'s
        "pieces"): the next checkpoint then starts a chain, so that no expert is ever
        made of pieces of two steps."""
        if manifest.layout.get("pieces", 0) != self.pieces:
            self.reset()
            return
        self.manifest = manifest
        self.index = int(manifest.policy.get("index", -1)) + 1
        self.saved_at = self.newest_copies(manifest.entries)

    def reset(self) -> None:
        """Start a new chain: the next checkpoint saves every expert."""
        self.manifest, self.index, self.saved_at = None, 0, self._zeros()

    # -- the next checkpoint -----------------------------------------------------------------

    def all_experts(self) -> list[list[int]]:
        return [list(range(self.spec.n_experts)) for _ in range(self.spec.n_moe_layers)]

    def select(self, step: int, ledger: TokenLedger) -> list[list[int]]:
        """Global expert ids per MoE layer that the checkpoint of `step` saves: every one
        at the start of a chain (there is no older copy), else the policy's K."""
        spec = self.spec
        if self.manifest is None:
            return self.all_experts()
        stale = (step - self.saved_at).tolist()
        ctx = SelectionContext(self.index, spec.n_experts, spec.n_moe_layers, ledger.k,
                               unsaved_tokens=tuple(map(tuple, ledger.unsaved().tolist())),
                               staleness=tuple(map(tuple, stale)), ep=self.ep)
        return select_experts(self.policy.selection, ctx)

    def wanted(self, selected: list[list[int]], step: int) -> Callable[[str], bool]:
        """Predicate: is this key written at this checkpoint? Non-expert keys always;
        the partial part of an expert's state when it is selected; any key with no
        usable older copy (none yet, or one in the step directory this save replaces)."""
        prev, apply_to = self.entries, self.policy.apply_to
        chosen = [set(s) for s in selected]

        def wanted(key: str) -> bool:
            parsed = parse_expert_key(key)
            if parsed is None or key not in prev or prev[key].step >= step:
                return True
            kind, stem, gid = parsed
            partial = apply_to == "both" or (apply_to == "weights") == (kind == "param")
            return not partial or gid in chosen[self.stems[stem]]
        return wanted

    def written(self, selected: list[list[int]], step: int) -> list[list[int]]:
        """Experts whose tracked state will have its newest copy at `step`: the selected
        ones, and those whose every copy is in the step directory this save replaces (a
        step saved again)."""
        if self.manifest is None:
            return self.all_experts()
        # One read of the tensor: indexing it per expert was a call each, 5 ms per
        # snapshot at 16 layers x 16 experts, on the snapshot thread.
        saved_at = self.saved_at.tolist()
        return [sorted(set(ids) | {e for e, at in enumerate(saved_at[m]) if at >= step})
                for m, ids in enumerate(selected)]

    def template(self, step: int, *, mode: str, layout: dict[str, int],
                 model_meta: dict[str, Any], extra: dict[str, Any] | None,
                 written: list[list[int]], ledger: TokenLedger,
                 run: dict[str, Any] | None = None) -> dict[str, Any]:
        """Every field of `step`'s manifest but its entries and files: what the
        checkpoint says about itself, the same whichever engine commits it. `run`: the
        run id and the lineage of the line that writes it (`SaveOrder.run`)."""
        return {
            "run": run or {},
            "step": step, "mode": mode, "layout": dict(layout), "model": model_meta,
            "extra": extra or {},
            "experts": {"n_experts": self.spec.n_experts,
                        "n_moe_layers": self.spec.n_moe_layers, "stems": self.stems,
                        "params": self.names},
            "model_config": self.model_config,
            "policy": {**self.policy.to_dict(), **ledger.policy_json(), "index": self.index},
            "experts_saved": {str(m): list(e) for m, e in enumerate(written)},
            "tokens": {**ledger.to_json(), "at_save": ledger.at_save_after(written).tolist()},
        }

    def newest_copies(self, entries: dict[str, Entry]) -> torch.Tensor:
        """(layers x experts) step holding each expert's newest copy (its oldest tensor
        of the tracked kind; 0 when it has none)."""
        # Plain ints, one tensor at the end: indexing a tensor element by element costs
        # microseconds each, and this runs for every key of every checkpoint.
        saved_at = [[_NONE] * self.spec.n_experts for _ in range(self.spec.n_moe_layers)]
        kind = self.tracked_kind
        for key, entry in entries.items():
            parsed = parse_expert_key(key)
            if parsed and parsed[0] == kind:
                row = saved_at[self.stems[parsed[1]]]
                row[parsed[2]] = min(row[parsed[2]], entry.step)
        out = torch.tensor(saved_at, dtype=torch.int64)
        return out.masked_fill(out == _NONE, 0)
