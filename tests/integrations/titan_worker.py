"""One rank of a torchtitan MoE run checkpointed by moc, started by torchrun from
tests/integrations/test_torchtitan.py: torchtitan's own model, parallelisation,
OptimizersContainer, LR schedulers and dataloader (examples/torchtitan_model.py) handed to
`TitanCheckpointer` as they are.

It trains to --steps, saving every step; with --kill-at S, rank 1 of the first attempt
SIGKILLs itself once step S is checkpointed, and torchrun's restart restores. It writes
to --out, per attempt: what it restored, every loss, the routed tokens of every step as
torchtitan's own `tokens_per_expert_E` counted them (summed over ranks), and (rank 0)
the whole final state, gathered."""

from __future__ import annotations

import faulthandler
import os

# A hung rank says where, then exits: torchrun and the test see a failure, not a hang.
faulthandler.dump_traceback_later(float(os.environ.get("TITAN_DUMP_S", "600")), exit=True)

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from torchtitan_model import build  # noqa: E402

from moc.checkpoint.policy.selection import PECPolicy  # noqa: E402
from moc.integrations.torchtitan import MocCheckpointManager, TitanCheckpointer  # noqa: E402


class Counter:
    """A loop state of the kind torchtitan's Trainer passes as `train_state`."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def whole_state(run: Any) -> dict[str, Any]:
    """Every parameter, persistent buffer and optimizer state entry whole (collective),
    by name; the LR schedulers' and dataloader's state dicts."""
    model = {n: full_tensor(p.detach()).clone() for n, p in run.model.named_parameters()}
    model.update({n: b.clone() for n, b in run.model.named_buffers()
                  if n.endswith("expert_bias_E")})
    name_of = {id(p): n for n, p in run.model.named_parameters()}
    optim: dict[str, torch.Tensor] = {}
    for opt in run.optimizers.optimizers:
        for p, st in opt.state.items():
            for k, v in st.items():
                optim[f"{name_of[id(p)]}/{k}"] = full_tensor(v).clone()
    groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")}
              for opt in run.optimizers.optimizers for g in opt.param_groups]
    return {"model": model, "optim": optim, "groups": groups,
            "lr_schedulers": run.lr_schedulers.state_dict()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--k", default="1", help="experts per checkpoint: an int, or all")
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--restore-step", type=int, default=None)
    ap.add_argument("--ep", type=int, default=None)
    ap.add_argument("--no-dataloader", action="store_true")
    ap.add_argument("--manager", action="store_true",
                    help="through MocCheckpointManager, as torchtitan's Trainer drives it")
    a = ap.parse_args()
    run = build(seed=0, ep=a.ep)
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    counter = Counter()
    k = None if a.k == "all" else int(a.k)
    dataloader = None if a.no_dataloader else run.dataloader
    manager = None
    if a.manager:  # built and called as torchtitan's Trainer does (trainer.py)
        config = MocCheckpointManager.Config(enable=True, folder=Path(a.ckpt).name,
                                             interval=1, k=k, keep_latest_k=0,
                                             persist_policy="wait")
        manager = config.build(dataloader=dataloader, model_parts=[run.model],
                               optimizers=run.optimizers, lr_schedulers=run.lr_schedulers,
                               states={"train_state": counter}, sd_adapter=None,
                               base_folder=str(Path(a.ckpt).parent))
        ckpt = manager.ckpt
    else:
        ckpt = TitanCheckpointer(
            a.ckpt, model_parts=[run.model], optimizers=run.optimizers,
            lr_schedulers=run.lr_schedulers, dataloader=dataloader,
            states={"train_state": counter}, policy=PECPolicy(k=k), interval=1,
            persist_policy="wait", keep_last=None)
    moes = [m for n, m in run.model.named_modules() if n.endswith(".moe")]
    routed: list[torch.Tensor] = []

    def count(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        # torchtitan's own count of this forward (zeroed at each optimizer step).
        if module.training and torch.is_grad_enabled():
            routed.append(module.tokens_per_expert_E.detach().clone())

    for m in moes:
        m.register_forward_hook(count)
    if manager is not None:
        manager.load(step=-1 if a.restore_step is None else a.restore_step)
        start = counter.step  # the Trainer's step comes back as its train_state
    else:
        start = ckpt.restore(a.restore_step)
    report = ckpt.report
    record: dict[str, Any] = {
        "attempt": attempt, "world": world, "start": start, "counter": counter.step,
        "source": report.source if report else None,
        "lost_tokens": report.lost_tokens if report else None,
        "plt": report.plt if report else None, "losses": {}, "tokens": {}}
    for step in range(start + 1, a.steps + 1):
        routed.clear()
        record["losses"][step] = run.step().hex()
        tokens = torch.stack(routed).long()
        dist.all_reduce(tokens)
        record["tokens"][step] = tokens.tolist()
        counter.step = step
        if manager is not None:
            manager.save(step, last_step=step == a.steps)
        else:
            ckpt.save(step, final=step == a.steps)
        if step == a.kill_at and attempt == 0:
            ckpt.flush()
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
    (manager or ckpt).close()
    state = whole_state(run)
    out = Path(a.out)
    (out / f"record-{rank}-{attempt}.json").write_text(json.dumps(record))
    if rank == 0:
        torch.save(state, out / f"state-{attempt}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
