"""torchtitan's own `Trainer` on CPU ranks, checkpointed by moc's `MocCheckpointManager`,
started by torchrun from tests/integrations/test_torchtitan_trainer.py.

The job config is built in Python, as a torchtitan config registry function builds one:
its Qwen3 MoE (debugmodel_moe shrunk: examples/torchtitan_model.py), its parallelisation
(EP and FSDP2), AdamW, LR schedulers and loss, and `checkpoint=MocCheckpointManager
.Config(...)`. `Trainer.train()` runs as it is. What a torchtitan user plugs in of their
own, here:

- a tokenizer: a word-level `tokenizer.json` built with `tokenizers` (no download);
- a dataloader (`SyntheticTextLoader`, a `BaseDataLoader` with its own `Config`): text
  made up from a fixed cycle of words, tokenized by the Trainer's tokenizer, stateful,
  so a restored run reads the very batches it would have read;
- a metrics processor (`LossRecorder`) that writes each step's loss, as `float.hex`, to
  --out (`metrics.log_freq` 1: the Trainer computes the loss only on steps it logs).

With --kill-at S, rank 1 of torchrun's first attempt SIGKILLs itself once step S is
checkpointed (every rank's snapshot and persist of S finished first, so that what the
restart finds does not depend on timing); torchrun's restart restores. Each rank writes,
per attempt, `losses-R-A.json` (step: loss) and `record-R-A.json` (the step restored,
where from, the step trained to).

What torchtitan 0.3.0 cannot do on a CPU without help, and the help given here:

- it picks its device at import, "cuda" when no accelerator is present, and calls
  `torch.cuda`-like functions on it (set_device, memory_stats, ...): `use_cpu()` points
  it at the CPU (no configuration option exists for this);
- `torchtitan.trainer` imports tensorboard (metrics) and `datasets` (its text dataloader,
  through its validator) at import time, whether used or not; neither is installed
  here, so each gets a stand-in module whose names refuse to be called
  (`stub_missing_imports()`); tensorboard, wandb and validation stay off;
- FSDP2 reduce-scatters its gradients with PREMUL_SUM once torchtitan sets the gradient
  divide factor to 1, and gloo has no PREMUL_SUM: the model spec's `parallelize_fn` is
  wrapped to force a plain SUM (`parallelize_for_gloo`), the same result here;
- it calls `torch.distributed.set_timeout` after the first step, which torch 2.13 lacks
  (`add_set_timeout()` names torch's `_set_pg_timeout` so);
- the process group is joined with `moc.init_distributed("gloo")` before the Trainer is
  built (torchtitan's own `init_distributed` then leaves it as it is). torchtitan's
  `init_process_group` over torchrun's one store meets the keys its dead predecessors
  wrote there: tried without this, torchrun's restarted attempt hung in
  `init_distributed` (no output in 4.5 minutes); moc's namespaces the store by restart.
"""

from __future__ import annotations

import faulthandler
import os

# A hung rank says where, then exits: torchrun and the test see a failure, not a hang.
faulthandler.dump_traceback_later(float(os.environ.get("TITAN_DUMP_S", "600")), exit=True)

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def refuse(what: str) -> Any:
    """A class (capitalised names) or function that raises when called."""
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{what} is not installed here (a stand-in module: "
                           "tests/integrations/titan_trainer.py, stub_missing_imports)")
    if what.rpartition(".")[2][:1].isupper():
        return type(what.rpartition(".")[2], (), {"__init__": refused})
    return refused


def stub_missing_imports() -> None:
    """Two packages torchtitan's trainer module imports at import time, for features
    this job leaves off, and that moc's test environment does not install: tensorboard
    (`torchtitan.components.metrics`: `SummaryWriter`, used only with
    `metrics.enable_tensorboard`) and Hugging Face `datasets` (`torchtitan.components
    .validate` imports `torchtitan.hf_datasets.text_datasets`, used only by torchtitan's
    own text dataloader and validator; `datasets` pins conflict with moc's). Each missing
    one gets a stand-in module whose names refuse to be called: the job never calls them,
    and one that did would fail in one line."""
    stubs = {"torch.utils.tensorboard": ["SummaryWriter"],
             "datasets": ["Dataset", "load_dataset"],
             "datasets.distributed": ["split_dataset_by_node"]}
    for name, names in stubs.items():
        try:
            __import__(name)
        except ImportError:
            stub = types.ModuleType(name)
            for n in names:
                setattr(stub, n, refuse(f"{name}.{n}"))
            sys.modules[name] = stub


stub_missing_imports()

import torchtitan.components.metrics as tt_metrics  # noqa: E402
import torchtitan.distributed.parallel_dims as tt_parallel_dims  # noqa: E402
import torchtitan.distributed.utils as tt_dist_utils  # noqa: E402
import torchtitan.models.common.token_dispatcher as tt_token_dispatcher  # noqa: E402
import torchtitan.tools.profiler as tt_profiler  # noqa: E402
import torchtitan.tools.utils as tt_tools_utils  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.config.configs import CommConfig, DebugConfig  # noqa: E402
from torchtitan.models.qwen3 import model_registry, parallelize_qwen3  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402
from torchtitan_model import SEQ_LEN, VOCAB, model_config  # noqa: E402

import moc  # noqa: E402
from moc.integrations.torchtitan import MocCheckpointManager  # noqa: E402

BATCH = 2
SPECIAL = ["<|bos|>", "<|eos|>"]


# -- the CPU as torchtitan's device ---------------------------------------------------


def _total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


CPU_DEVICE = types.SimpleNamespace(
    # What torchtitan calls on its `device_module` (torch.cuda on a GPU): the Trainer
    # (set_device), get_local_device (device_count), set_pg_timeouts (current_device,
    # synchronize) and the metrics' memory monitor (the rest; no statistics on the CPU).
    set_device=lambda device: None,
    current_device=lambda: 0,
    device_count=lambda: 1,
    synchronize=lambda device=None: None,
    is_available=lambda: True,
    get_device_name=lambda device=None: "cpu",
    get_device_properties=lambda device=None: types.SimpleNamespace(
        total_memory=_total_memory()),
    memory_stats=lambda device=None: {},
    reset_peak_memory_stats=lambda device=None: None,
    empty_cache=lambda: None,
)


def use_cpu() -> None:
    """torchtitan picks its device once, at import (`torchtitan.tools.utils.device_type`,
    "cuda" when no accelerator is present) and copies it into the modules that read it;
    no config option or environment variable changes it. Point every copy at the CPU:
    the Trainer then puts the model on the CPU and builds its DeviceMesh on it."""
    for module in (tt_tools_utils, tt_dist_utils, tt_parallel_dims, tt_metrics,
                   tt_token_dispatcher, tt_profiler):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = CPU_DEVICE


def add_set_timeout() -> None:
    """torchtitan 0.3.0's Trainer, after its first step, shortens every process group's
    timeout with `torch.distributed.set_timeout`, which torch 2.13 does not have; it has
    the same function as `distributed_c10d._set_pg_timeout(timeout, group)`."""
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]


def parallelize_for_gloo(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """The model spec's own `parallelize_qwen3`, then FSDP's gradient reduction as a
    plain SUM: torchtitan sets FSDP's divide factor to 1, which FSDP2 reduce-scatters with
    PREMUL_SUM, and gloo has none. With a factor of 1 a SUM is the same reduction."""
    model = parallelize_qwen3(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


# -- the tokenizer ----------------------------------------------------------------------


def word(i: int) -> str:
    return SPECIAL[i] if i < len(SPECIAL) else f"w{i}"


def build_tokenizer(folder: Path) -> Path:
    """A word-level Hugging Face tokenizer of VOCAB tokens (the model's vocabulary):
    `tokenizer.json` and a `tokenizer_config.json` naming BOS and EOS, the files
    torchtitan's `HuggingFaceTokenizer` reads from `hf_assets_path`."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {word(i): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL[1]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIAL[0], "eos_token": SPECIAL[1],
        "add_bos_token": False, "add_eos_token": False}))
    return folder


# -- the data ---------------------------------------------------------------------------


class SyntheticText(IterableDataset, Stateful):
    """Endless documents of words, sample `k` of data-parallel rank `r` a pure function
    of `(seed, r, k)`, tokenized by the Trainer's tokenizer: each walks a fixed cycle
    through an eighth of the words from a random start (learnable, so the loss falls).
    The state is one integer: a restored loader replays the same batches."""

    def __init__(self, tokenizer: BaseTokenizer, seed: int, dp_rank: int,
                 seq_len: int) -> None:
        self.tokenizer, self.seed, self.dp_rank, self.seq_len = tokenizer, seed, dp_rank, seq_len
        ids = np.random.default_rng([seed]).permutation(np.arange(len(SPECIAL), VOCAB))
        used = ids[: VOCAB // 8].tolist()
        self.used = used
        self.next = dict(zip(used, used[1:] + used[:1], strict=True))
        self.sample_idx = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            rng = np.random.default_rng([self.seed, self.dp_rank, self.sample_idx])
            walk = [self.used[int(rng.integers(len(self.used)))]]
            for _ in range(self.seq_len):
                walk.append(self.next[walk[-1]])
            text = " ".join(word(i) for i in walk)
            tokens = torch.tensor(self.tokenizer.encode(text, add_bos=False, add_eos=False),
                                  dtype=torch.long)
            assert tokens.tolist() == walk, "the tokenizer does not round-trip the words"
            self.sample_idx += 1
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sample_idx = int(state_dict["sample_idx"])


class SyntheticTextLoader(ParallelAwareDataloader):
    """A torchtitan dataloader of one's own: `config.dataloader.build(...)` with the
    keywords the Trainer passes (trainer.py), a `ParallelAwareDataloader` (torchdata's
    `StatefulDataLoader`: its state, the dataset's included, is what the checkpoint
    keeps) over `SyntheticText`."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        seed: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int,
                 tokenizer: BaseTokenizer, seq_len: int, local_batch_size: int,
                 **_: Any) -> None:
        super().__init__(SyntheticText(tokenizer, config.seed, dp_rank, seq_len),
                         dp_rank=dp_rank, dp_world_size=dp_world_size,
                         batch_size=local_batch_size)


# -- the losses -------------------------------------------------------------------------


class LossRecorder(MetricsProcessor):
    """torchtitan's metrics processor (console only), which also writes each logged
    step's `global_avg_loss` (the same float on every rank), as `float.hex`, to
    `record_file`, rewritten at every step: a killed rank leaves what it logged."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        record_file: str = ""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.record_file = Path(config.record_file)
        self.losses: dict[int, str] = {}

    def log(self, step: int, global_avg_loss: float, global_max_loss: float,
            grad_norm: float, extra_metrics: dict[str, Any] | None = None) -> None:
        self.losses[step] = float(global_avg_loss).hex()
        self.record_file.write_text(json.dumps(self.losses))
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)


# -- the fault --------------------------------------------------------------------------


class KillAfterCheckpoint(Trainer):
    """torchtitan's Trainer, `train()` as it is. Its loop asks `should_continue_training`
    right after `checkpointer.save(step)`; there, once step `kill_at` is checkpointed on
    the first attempt, every rank finishes that checkpoint (snapshot and persist) and
    rank 1 SIGKILLs itself."""

    kill_at = 0
    signal = signal.SIGKILL
    """SIGSTOP (--stop): a hang, which only `moc run`'s heartbeat watch can end."""

    def should_continue_training(self) -> bool:
        if self.step == self.kill_at and attempt() == 0:
            self.checkpointer.maybe_wait_for_saving()  # torchtitan's own call
            if dist.get_rank() == 1:
                os.kill(os.getpid(), self.signal)
        return super().should_continue_training()


# -- the job ----------------------------------------------------------------------------


GENERATION: int | None = None
"""Under `moc run` (--in-job): the generation being trained (`moc.Generation.number`)."""


def attempt() -> int:
    """torchrun's restart count, or under `moc run` the generation: each is a new start
    of `train()`, the first one 0."""
    if GENERATION is not None:
        return GENERATION
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def job_config(a: argparse.Namespace, hf_assets: Path, losses_file: Path) -> Trainer.Config:
    """The Trainer's config, as a torchtitan config registry function writes one
    (cf. torchtitan/models/qwen3/config_registry.py, `qwen3_moe_debug`)."""
    spec = model_registry("debugmodel_moe")
    spec = replace(spec, model=model_config(layers=2, dim=64, experts=8, top_k=2, ep=a.ep),
                   parallelize_fn=parallelize_for_gloo)
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=str(hf_assets),
        dump_folder=a.dump,
        metrics=LossRecorder.Config(log_freq=1, record_file=str(losses_file),
                                    disable_color_printing=True),
        dataloader=SyntheticTextLoader.Config(seed=0),
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB),
        optimizer=default_adamw(lr=3e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(local_batch_size=BATCH, seq_len=SEQ_LEN, steps=a.steps,
                                mixed_precision_param="float32", disable_cuda_graphs=True),
        # partial_dtensor: DTensors on the model-parallel axes (EP), FSDP2 on top; the
        # default spmd_types backend fails inside torchtitan's FSDP call on torch 2.13.
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor",
                                      expert_parallel_degree=a.ep),
        activation_checkpoint=None,
        compile=CompileConfig(),
        debug=DebugConfig(seed=0),  # None: rank 0 draws one, a different run each time
        # The Trainer shortens its collectives' timeout to this after its first step
        # (default 100 s); a loaded test machine may need longer.
        comm=CommConfig(train_timeout_seconds=600),
        # persist_policy "wait": every checkpoint reaches storage. With "skip" (the
        # default) a checkpoint taken while the previous one still persists stays in
        # memory only, and on a busy machine step KILL_AT was never on storage for the
        # storage job to load (seen: "the persist of step 2 is still running").
        checkpoint=MocCheckpointManager.Config(
            enable=True, interval=a.interval, k=None if a.k == "all" else int(a.k),
            load_step=a.load_step, persist_policy="wait"),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True, help="the Trainer's dump_folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--k", default="1", help="experts per checkpoint: an int, or all")
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--load-step", type=int, default=-1)
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--stop", action="store_true",
                    help="with --kill-at: SIGSTOP rank 1 instead of SIGKILL (a hang)")
    ap.add_argument("--in-job", action="store_true",
                    help="under `moc run`: moc.integrations.torchtitan.run builds the "
                         "Trainer in each generation; a lost rank is replaced and the "
                         "others keep their processes")
    a = ap.parse_args()

    init_logger()  # as torchtitan/train.py does
    use_cpu()
    add_set_timeout()
    out = Path(a.out)
    if a.in_job:
        in_job(a, out)
        return
    moc.init_distributed("gloo")
    rank = dist.get_rank()
    hf_assets = Path(a.dump) / "tokenizer"
    if rank == 0:
        build_tokenizer(hf_assets)
    dist.barrier()
    trainer = make_trainer(a, hf_assets, out / f"losses-{rank}-{attempt()}.json")
    try:
        trainer.train()
    finally:
        trainer.close()
    write_record(trainer, out, rank, dist.get_world_size())
    dist.destroy_process_group()


def make_trainer(a: argparse.Namespace, hf_assets: Path, losses_file: Path) -> Trainer:
    config = job_config(a, hf_assets, losses_file)
    if a.kill_at:
        KillAfterCheckpoint.kill_at = a.kill_at
        KillAfterCheckpoint.signal = signal.SIGSTOP if a.stop else signal.SIGKILL
        return KillAfterCheckpoint(config)
    return config.build()


def write_record(trainer: Trainer, out: Path, rank: int, world: int) -> None:
    """What `rank` restored and trained in this attempt, and which process did."""
    assert isinstance(trainer.checkpointer, MocCheckpointManager)
    report = trainer.checkpointer.ckpt.report
    (out / f"record-{rank}-{attempt()}.json").write_text(json.dumps({
        "attempt": attempt(), "world": world, "pid": os.getpid(),
        "start": report.step if report else 0,
        "source": report.source if report else None,
        "sources": report.sources if report else None,
        "lost_tokens": report.lost_tokens if report else None,
        "end": trainer.step}))


def in_job(a: argparse.Namespace, out: Path) -> None:
    """torchtitan's Trainer under `moc run`: built in each generation by
    `moc.integrations.torchtitan.run`, on the process group moc formed for it. Each rank
    makes its own copy of the tokenizer (a replacement process joins later, alone). A
    generation a fault cut short leaves its losses file; the last one's record is
    written once the job is done."""
    from moc.integrations.torchtitan import run

    gens: list[moc.Generation] = []

    def build(gen: moc.Generation) -> Trainer:
        global GENERATION
        GENERATION = gen.number
        gens.append(gen)
        (out / f"pid-{gen.rank}-{gen.number}").write_text(str(os.getpid()))
        hf_assets = build_tokenizer(Path(a.dump) / f"tokenizer-{gen.rank}")
        return make_trainer(a, hf_assets, out / f"losses-{gen.rank}-{gen.number}.json")

    trainer = run(build)
    write_record(trainer, out, gens[-1].rank, gens[-1].world_size)


if __name__ == "__main__":
    main()
