"""The reference training loop: one process per rank, started by torchrun.

    build model (same seed everywhere) -> keep this rank's experts -> sharded AdamW
    -> restore the newest checkpoint if there is one
    -> for each step: batch, forward, backward, reduce gradients, clip, step, checkpoint
    -> validation loss, summary
"""

from __future__ import annotations

import functools
import os
import resource
import signal
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from moc.checkpoint.api import CheckpointEngine
from moc.checkpoint.policy.tokens import PLTOverBudgetWarning, format_plt
from moc.checkpoint.preemption import Preemption
from moc.checkpoint.store.steps import complete_steps
from moc.checkpoint.store.storage import open_storage
from moc.checkpoint.twolevel.persist.prestart import prestart
from moc.injob.loop import generations
from moc.injob.machines import lose_machine
from moc.injob.membership import Membership, first_line, prestarts
from moc.injob.membership import enabled as in_job
from moc.parallel import (
    ParallelGroups,
    ShardedAdamW,
    clip_grad_norm_,
    rebind_experts,
    sync_gradients,
)
from moc.topology import init_distributed as init
from moc.topology import node_rank, restart_count
from moc.train.config import TrainConfig
from moc.train.data import BatchSampler, Corpus, rank_slice, windows
from moc.train.engines import agree_on_placement, initial_model, make_engine
from moc.train.evaluate import mean_over_ranks, validation_loss
from moc.train.metrics import MetricsWriter, RecoveryLog, StepProgress, read_events
from moc.train.report import RunResult, report_checkpoint, summary


def init_distributed(device: str = "cpu", membership: Membership | None = None,
                     stopping: Callable[[], None] | None = None) -> None:
    """Join the torchrun job: NCCL on cuda (each rank on GPU LOCAL_RANK), gloo on the
    CPU; `moc.init_distributed` does the restart-safe part, `membership` (in-job
    recovery) the generation's (`stopping`: called while it waits for its ranks)."""
    backend = "nccl" if device == "cuda" else "gloo"
    if membership is None:
        init(backend=backend)
        return
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    membership.join(backend, stopping)


def maybe_inject_fault(cfg: TrainConfig, step: int, rank: int, metrics: MetricsWriter,
                       checkpointer: Any = None, attempt: int | None = None,
                       progress: StepProgress | None = None) -> None:
    """SIGKILL this process on `--fault-rank` at `--fault-at` on the first attempt only
    (a restarted job must get past the step that killed it), or with `--fault-every F` at
    step (r + 1) F on attempt r: each restart resumes before its attempt's fault step and
    meets the next one F steps later. A node fault also wipes the node's shared-memory
    snapshots, as losing the machine would. A persist fault SIGKILLs rank 0's persist
    process instead (the training ranks live on), at every multiple of F with
    `--fault-every`: more often than it may be restarted. `attempt`: the job's attempt
    (`Trainer.attempt`, the same on every node), by default this agent's restart count.

    `--fault-node J` loses node J instead (`lose_node`): all its ranks at once.

    The rank that injects a fault says so first, in one line on stderr (`progress`:
    rank 0's, above its bar), so that what follows (a survivor's "lost a peer",
    torchrun's "failed (exitcode: -9)") reads as the fault asked for, not a bug."""
    attempt = restart_count() if attempt is None else attempt
    if cfg.fault_every is not None and cfg.fault_kind == "persist":
        due = step % cfg.fault_every == 0
    elif cfg.fault_every is not None:
        due = step == (attempt + 1) * cfg.fault_every
    else:
        due = cfg.fault_at == step and attempt == 0
    if not due:
        return
    # Logged by rank 0 (the only metrics writer) whichever rank the fault kills.
    if cfg.fault_node is not None:
        metrics.emit("fault", step=step, node=cfg.fault_node, kind=cfg.fault_kind)
        # Between checkpoints, as in a real run, whose interval outlasts a persist: the
        # checkpoint in flight is finished first (collective: every rank meets the fault
        # at this step). On a loaded test machine a persist can outlast two steps, and
        # what storage holds would then depend on the load.
        if checkpointer is not None:
            checkpointer.flush()
        if node_rank() == cfg.fault_node:
            if os.environ.get("LOCAL_RANK", "0") == "0":
                _announce_fault(cfg, step, rank, (
                    f"losing machine {cfg.fault_node} (every process of it SIGKILLed, its "
                    "agent and hosts too, its memory wiped)" if cfg.fault_kind == "machine"
                    else f"losing node {cfg.fault_node} (its persist process and ranks "
                    "SIGKILLed, its shared memory wiped)"), progress)
            lose_node(cfg, metrics, checkpointer)
        return
    metrics.emit("fault", step=step, rank=cfg.fault_rank, kind=cfg.fault_kind)
    if cfg.fault_kind == "persist":
        for pid in checkpointer.background_pids() if checkpointer is not None else []:
            _announce_fault(cfg, step, rank, f"SIGKILL of the persist process (pid {pid})",
                            progress)
            os.kill(pid, signal.SIGKILL)  # rank 0 owns the process
        return
    if cfg.fault_rank == rank:
        what = {"hang": "SIGSTOP of this process (pid {}): it hangs",
                "node": "its node's snapshots wiped, then SIGKILL of this process (pid {})"
                }.get(cfg.fault_kind, "SIGKILL of this process (pid {})")
        _announce_fault(cfg, step, rank, what.format(os.getpid()), progress)
        metrics.close()
        if cfg.fault_kind == "node" and checkpointer is not None:
            checkpointer.drop_node_memory()  # this job's node-local snapshots
        # hang: every thread stops, sockets stay open; only a watchdog sees it.
        os.kill(os.getpid(), signal.SIGSTOP if cfg.fault_kind == "hang" else signal.SIGKILL)


def _announce_fault(cfg: TrainConfig, step: int, rank: int, what: str,
                    progress: StepProgress | None) -> None:
    """The line that says a fault is injected on purpose, and which (flushed: a SIGKILL
    follows)."""
    flag = (f"--fault-every {cfg.fault_every}" if cfg.fault_every is not None
            else f"--fault-at {cfg.fault_at}")
    line = f"moc train: rank {rank}: injecting a fault at step {step} ({flag}): {what}"
    if progress is not None and progress.enabled:
        progress.message(line)
    else:
        print(line, file=sys.stderr)
    sys.stderr.flush()


def lose_node(cfg: TrainConfig, metrics: MetricsWriter, checkpointer: Any) -> None:
    """This rank's part of losing its machine: the rank holding the node's persist process
    (its local rank 0) SIGKILLs it first, then every rank wipes its node-local job
    directory (under its own MOC_SHM_ROOT) and SIGKILLs itself.

    The node is lost between checkpoints, as `--fault-at` means: after its ranks' peer
    replica rounds in flight are over (in a real run the interval is far longer than a
    round; on a loaded test machine a round can outlast a step). The crash sweep loses
    nodes at random moments instead, mid-round included."""
    if checkpointer is not None:
        checkpointer.wait_for_replicas()
        for pid in checkpointer.background_pids():
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid)  # gone before the memory it reads from is
    metrics.close()
    if checkpointer is not None:
        checkpointer.drop_node_memory()
    if cfg.fault_kind == "machine":  # the whole simulated machine, its memory with it
        lose_machine()
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    """Until `pid` (a child SIGKILLed) has exited; reaped when it is this process's."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:  # not our child: poll for its exit
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.01)


def leave_if_stopped(preemption: Preemption | None, ckpt_dir: str | None) -> None:
    """A stop request (SIGTERM, SIGINT) while the job re-forms after a fault (called by
    `Membership.join` as it waits): no final checkpoint can be taken without every rank,
    so this process ends at once and says, truthfully, which step storage holds."""
    if preemption is None or preemption.received is None:
        return
    try:
        steps = complete_steps(open_storage(ckpt_dir).root) if ckpt_dir else []
    except (OSError, ValueError):  # an object store out of reach: say what is known
        steps = []
    durable = f"step {steps[-1]} is durable" if steps else "no step is durable yet"
    preemption.leave_now(f"{preemption.received.name} while the job re-formed after a "
                         f"fault: stopping without a final checkpoint; {durable} in "
                         f"{ckpt_dir}")


class NothingToTrain(ValueError):
    """The checkpoint directory's run is already past the steps asked for (raised on every
    rank, after the restore: the engine is still to be closed)."""


class Trainer:
    def __init__(self, cfg: TrainConfig, preemption: Preemption | None = None,
                 corpus: Corpus | None = None) -> None:
        """`preemption`: SIGTERM and SIGINT caught (made before this, so that a signal
        while the job starts is a request to stop, not a traceback); None: not caught.
        `corpus`: the data, already loaded (a spare loads it while it waits)."""
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here; use --device cpu")
        if cfg.device == "cuda":
            # cuBLAS is deterministic only with a fixed workspace (set before its first
            # use); deterministic algorithms are what make a resumed run bitwise exact.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self.step = 0
        self.cfg = cfg
        self.preemption = preemption
        self.membership = (Membership(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                                      lambda: self.step) if in_job() else None)
        """In-job recovery: this process's generation of the job (None: restarts)."""
        self._stopping = functools.partial(leave_if_stopped, preemption, cfg.ckpt_dir)
        init_distributed(cfg.device, self.membership, self._stopping)
        torch.use_deterministic_algorithms(True)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.groups = ParallelGroups.from_world(cfg.resolve_ep(world), cfg.model.n_experts)
        self.groups_gen = self.membership.gen if self.membership is not None else 0
        """The generation `groups` were made in (in-job recovery: `_enter`)."""
        self.rank = self.groups.rank
        self.is_main = self.rank == 0
        faults = cfg.fault_at is not None or cfg.fault_every is not None
        if faults and cfg.fault_node is None and cfg.fault_rank >= world:
            raise ValueError(f"--fault-rank {cfg.fault_rank} does not exist with {world} ranks")
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
        if cfg.fault_node is not None and cfg.fault_node >= nodes:
            raise ValueError(f"--fault-node {cfg.fault_node} does not exist with {nodes} "
                             "nodes")
        # cuda:LOCAL_RANK once NCCL is up (init_distributed set it), else the CPU.
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if cfg.device == "cuda" else torch.device("cpu"))

        self.model = initial_model(cfg, self.groups, self.device)
        self.optimizer = ShardedAdamW(self.model, self.groups, lr=cfg.lr,
                                      weight_decay=cfg.weight_decay)
        self.corpus = corpus or Corpus.load(cfg.data, cfg.model.seq_len)
        self.sampler = self._first_batch()
        self.metrics = MetricsWriter(cfg.metrics if self.is_main else None)
        self.attempt = self._agree_on_placement()
        """The job's attempt (0 first), the same on every rank of every node."""
        self.checkpointer = self.make_checkpointer()
        # PLT and Dynamic-K count routed tokens by hooks (DCP saves every expert: none).
        self.routing = self.checkpointer and self.checkpointer.watch_routing(self.model)
        self.recovery: RecoveryLog | None = None

    def _agree_on_placement(self) -> int:
        """The job's attempt, agreed by every rank (`train.engines.agree_on_placement`).
        Collective, once per attempt and generation."""
        gen = self.membership.gen if self.membership is not None else 0
        attempt, self.pids = agree_on_placement(self.groups, self.metrics, self.cfg.device,
                                                gen)
        return attempt

    def make_checkpointer(self) -> CheckpointEngine | None:
        """The engine of `--ckpt-mode`; the loop drives every one through the contract."""
        return make_engine(self.cfg, self.model, self.optimizer, self.groups)

    def extra_state(self) -> dict[str, Any]:
        """The loop's own state; parameters, optimizer and RNG are saved as tensors."""
        return {"step": self.step, "sampler": self.sampler.state_dict(),
                "schedule": {"lr": self.cfg.lr, "warmup_steps": self.cfg.warmup_steps,
                             "steps": self.cfg.steps, "min_lr_ratio": self.cfg.min_lr_ratio},
                "seed": self.cfg.seed}

    def restore(self, progress: StepProgress) -> int | None:
        last = None  # the last step before the fault, as rank 0 logged it
        if self.is_main and self.cfg.metrics:
            steps = [e for e in read_events(self.cfg.metrics) if e["event"] == "step"]
            last = max(steps, key=lambda e: e["step"]) if steps else None
        # A rollback is the first attempt's: a restart after a fault continues the
        # rolled-back run from its newest step, not from the rollback's step again.
        rollback = self.cfg.resume_step if self.attempt == 0 else None
        with warnings.catch_warnings():  # the "resumed from" line below says it once
            warnings.simplefilter("ignore", PLTOverBudgetWarning)
            result = self.checkpointer.restore(rollback) if self.checkpointer else None
        if result is None:
            if self.membership is not None and self.membership.gen:
                self._start_over()
                progress.message("nothing to restore: every rank starts over from step 0")
                self.recovery = self._recovery(last, {
                    "resumed_from": 0, "source": "start", "sources": {}, "recovery_s": 0.0,
                    "plt": None, "lost_tokens": None, "lost_per_layer": None})
            return None
        if rollback is not None:
            progress.message(f"rolled back to step {result.step} (--resume-step); the newer "
                             "steps are set aside as step-N.rolledback")
        self.step = result.extra["step"]
        self.sampler.load_state_dict(result.extra["sampler"])
        # result.skipped: rank 0 has logged each ("step N is not usable (...); trying
        # an older one"); saying it again here printed every fallback twice (issue 50).
        lost = ("unknown expert tokens lost (no routing recorded)" if result.plt is None
                else f"{result.lost_tokens} expert tokens lost, "
                     f"{format_plt(result.plt, self.cfg.plt_threshold)}")
        progress.message(f"resumed from checkpoint step {result.step} "
                         f"({result.source}, {result.recovery_s:.2f}s, {lost})")
        if result.passed_over is not None:
            progress.message(f"took the exact step {result.step}: {result.passed_over} "
                             "(--restore-prefer newest takes the newer one)")
        self.recovery = self._recovery(last, {
            "resumed_from": result.step, "source": result.source, "sources": result.sources,
            "recovery_s": result.recovery_s, "plt": result.plt,
            "lost_tokens": result.lost_tokens, "lost_per_layer": result.lost_per_layer})
        if result.k != result.k_before:
            progress.message(f"Dynamic-K: {format_plt(result.plt, self.cfg.plt_threshold)}"
                             f", K {result.k_before} -> {result.k}")
            self.metrics.emit("dynamic_k", step=result.step, k=result.k, plt=result.plt,
                              k_before=result.k_before)
        return result.step

    def train_step(self) -> tuple[float, int]:
        cfg, groups = self.cfg, self.groups
        starts = rank_slice(self.sampler.next(), self.rank, groups.world_size)
        x_BT, y_BT = windows(self.corpus.train, starts, cfg.model.seq_len)
        x_BT, y_BT = x_BT.to(self.device), y_BT.to(self.device)
        out = self.model(x_BT, y_BT)
        out.loss.backward()
        sync_gradients(self.model, groups)
        clip_grad_norm_(self.model, groups, cfg.grad_clip)
        if self.checkpointer is not None:
            self.checkpointer.wait_for_snapshot()
        self.optimizer.set_lr(cfg.lr_at(self.step))
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        return mean_over_ranks(out.loss, groups), x_BT.numel() * groups.world_size

    def run(self) -> RunResult:
        """Train to the last step, then `close` (collective: every rank gets there). In-job
        recovery: the generation loop `moc.run` drives a script's `train` with
        (`moc.injob.generations`); when a peer is lost, even while the engine closes,
        this process leaves, rejoins the job's next generation (`_regroup`) and goes on
        from the newest checkpoint, as many times as faults come."""
        if self.membership is None:
            result = self._run()
            self.close()
            return result
        return generations(self.membership, "nccl" if self.cfg.device == "cuda" else "gloo",
                           self._enter, self._leave, self._stopping, joined=True)

    def _enter(self, gen: int) -> RunResult:
        """One generation: regrouped first when it is not the one this process's groups
        were made in (a survivor's rejoin; a newcomer was built in its own)."""
        if gen != self.groups_gen:
            self._regroup(gen)
        result = self._run()
        self.close()
        return result

    def _leave(self, error: BaseException) -> None:
        """A peer was lost and the process groups are dropped (`generations`): let the
        engine go without a collective (its snapshots stay in memory). `run` then
        rejoins, and restores every rank from where its newest state is: this one from
        its own node's memory."""
        if self.is_main:
            print(f"moc train: rank {self.rank}: lost a peer at step {self.step} "
                  f"({first_line(error)}); rejoining", file=sys.stderr, flush=True)
        if self.routing is not None:
            self.routing.remove()
            self.routing = None
        if self.checkpointer is not None:
            self.checkpointer.abandon()
            self.checkpointer = None

    def _regroup(self, gen: int) -> None:
        """The new generation's groups, the same model and optimizer rebound to them, a
        new engine on them."""
        self.groups = ParallelGroups.from_world(self.groups.layout.ep, self.cfg.model.n_experts)
        self.groups_gen = gen
        rebind_experts(self.model, self.groups)
        self.optimizer.rebind(self.groups)
        self.model.zero_grad(set_to_none=True)  # a half step's gradients
        if self.preemption is not None:
            self.preemption.regroup()
        self.attempt = self._agree_on_placement()
        self.checkpointer = self.make_checkpointer()
        self.routing = self.checkpointer and self.checkpointer.watch_routing(self.model)

    def _recovery(self, last: dict | None, fields: dict[str, Any]) -> RecoveryLog:
        """The recovery event of this restore, written after the first step."""
        membership = self.membership
        in_job = membership is not None and membership.gen > 0
        replaced = (membership.replaced() if membership is not None and in_job
                    and self.is_main else list(range(self.groups.world_size)))
        return RecoveryLog(last["time"] if last else None, {
            "step": last["step"] if last else fields["resumed_from"], **fields,
            "restart": self.attempt, "kind": "in-job" if in_job else "restart",
            "replaced": replaced, "pids": self.pids})

    def _first_batch(self) -> BatchSampler:
        world, cfg = self.groups.world_size, self.cfg
        return BatchSampler(len(self.corpus.train), cfg.model.seq_len,
                            cfg.batch_size * world, cfg.seed)

    def _start_over(self) -> None:
        """In-job recovery with nothing to restore (the fault came before a checkpoint
        every rank holds): every rank goes back to where a new process starts, the
        initial weights (and torch's RNG after them) from the seed, no optimizer state,
        the first batch. Agreed: every rank restored nothing in the same generation."""
        self.model.load_state_dict(initial_model(self.cfg, self.groups, self.device)
                                   .state_dict())
        self.optimizer.reset()
        self.sampler, self.step = self._first_batch(), 0

    def _run(self) -> RunResult:
        cfg = self.cfg
        t0 = time.perf_counter()
        if self.membership is not None:
            self.membership.phase = "restore"
        progress = StepProgress(cfg.steps, enabled=self.is_main, bar=False)  # messages
        resumed_from = self.restore(progress)
        result = RunResult(cfg.steps, float("nan"), float("nan"), 0.0, resumed_from=resumed_from)
        if self.step > cfg.steps:
            raise NothingToTrain(
                f"the run in {cfg.ckpt_dir} is already at step {self.step}, past --steps "
                f"{cfg.steps}: nothing to train; raise --steps to go on, --resume-step S to "
                "roll back to step S, or use another --ckpt-dir")
        if self.step == cfg.steps and resumed_from is not None:
            progress.message(f"the run in {cfg.ckpt_dir} is already complete at step "
                             f"{self.step} (--steps {cfg.steps}): nothing to train")
            result.final_loss = result.val_loss = float("nan")
            return result
        progress = StepProgress(cfg.steps, start=self.step, enabled=self.is_main,
                                bar=cfg.progress)
        loss = float("nan")
        self.model.train()
        if self.membership is not None:
            self.membership.phase = "train"
        while self.step < cfg.steps:
            self.step += 1
            maybe_inject_fault(cfg, self.step, self.rank, self.metrics, self.checkpointer,
                               self.attempt, progress)
            t_step = time.perf_counter()
            loss, tokens = self.train_step()
            if self.membership is not None:
                self.membership.check()  # NCCL: a loss freed by an abort is no loss
            # Every rank, every step: whether a SIGTERM or SIGINT reached any rank. The
            # answer is agreed, so every rank stops at this same step.
            stop = self.preemption is not None and self.preemption.should_stop()
            # Nothing checkpoint-related is built on steps that do not checkpoint.
            ckpt = self.checkpointer
            final = self.step == cfg.steps or stop  # the run's last checkpoint is complete
            if ckpt is not None and (cfg.checkpoints_at(self.step) or final):
                ckpt.save(self.step, self.extra_state(), final=final)
            # The whole iteration, checkpoint work included: what throughput is made of.
            step_time = time.perf_counter() - t_step
            if self.is_main:  # the only rank that writes metrics
                self.metrics.emit("step", step=self.step, loss=loss, step_time_s=step_time,
                                  tokens=tokens, lr=cfg.lr_at(self.step),
                                  cpu_s=time.process_time())
            if self.recovery is not None:  # the first step after a recovery
                downtime = self.recovery.emit(self.metrics)
                if downtime is not None:
                    progress.message(f"back to training {downtime:.2f}s after the last "
                                     "step before the fault")
                self.recovery = None
            if (self.membership is not None and self.membership.stepped(step_time)
                    and prestarts()):
                prestart()  # training is back: the next engine's persist process
            note = ""
            if ckpt is not None and ckpt.pending:
                for res in ckpt.drain_completed():
                    note = report_checkpoint(self.metrics, progress, result, res, self.step)
            progress.update(self.step, loss, note)
            if stop:
                result.preempted = self.step
                break
        progress.close()  # a run resumed at its last step never reached an update
        if self.membership is not None:
            self.membership.phase = "finish"
        if self.checkpointer is not None:
            self.checkpointer.flush()
            for res in self.checkpointer.drain_completed():
                report_checkpoint(self.metrics, progress, result, res, self.step)
        result.final_loss = loss
        if result.preempted is None:  # a preempted job has seconds left, not a validation
            self.model.eval()
            result.val_loss = validation_loss(self.model, self.corpus, self.cfg, self.groups,
                                              self.device)
            if self.membership is not None:
                self.membership.check()
        result.wall_s = time.perf_counter() - t0
        memory: dict[str, Any] = {
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if self.checkpointer is not None:
            memory.update(self.checkpointer.host_memory())
        if result.preempted is not None:
            agreed = self.preemption.agreed if self.preemption is not None else None
            self.metrics.emit("preempted", step=result.preempted,
                              signal=agreed.name if agreed is not None else None)
        self.metrics.emit("summary", steps=self.step, final_loss=result.final_loss,
                          val_loss=result.val_loss, wall_s=result.wall_s, **memory)
        if self.is_main and result.preempted is None:
            progress.message(summary(self.cfg, self.groups, self.model, result))
        return result

    def close(self) -> None:
        """Collective: close the engine (the final checkpoint durable, its shared memory
        removed), finish the last preemption round (on a group about to go), then the
        process groups. Signals are still caught until the process exits (`main`)."""
        if self.routing is not None:
            self.routing.remove()
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.metrics.close()
        if self.preemption is not None:
            self.preemption.settle()
        if dist.is_initialized():
            dist.destroy_process_group()

