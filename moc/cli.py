"""`moc` command line: train (launches torchrun itself), demo (the main job), inspect,
verify and export (checkpoint directories), bench (measurements), simulate (the overhead
model)."""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from moc.checkpoint.errors import CheckpointError
from moc.cliparse import OneLineParser
from moc.compat import has_dcp_async_staging
from moc.progress import progress
from moc.train.agent import TORCHRUN_SHUTDOWN_S, torchrun_accepts
from moc.train.cli_args import (
    add_launcher_args,
    add_train_args,
    config_from_args,
    worker_argv,
)
from moc.train.config import TrainConfig

DEMO_DIR = Path("runs/demo")


class RunComplete(Exception):
    """`moc train` of a run whose checkpoint directory is already at --steps: nothing to
    do, and nothing wrong (a scheduler that starts a finished job again)."""


def check_launch(nproc: int, nodes: int, spare_nodes: int, machine_restart_s: float | None,
                 in_job: bool, recovery: str = " and --recovery in-job") -> None:
    """Where the ranks run (`moc train`'s and `moc run`'s launcher options), checked
    before anything starts: ValueError with the one line to show."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {nodes}")
    if spare_nodes < 0:
        raise ValueError(f"--spare-nodes must be >= 0, got {spare_nodes}")
    if spare_nodes and (nodes < 2 or not in_job):
        raise ValueError(f"--spare-nodes {spare_nodes} stands machines by for in-job "
                         f"recovery across machines: it needs --nodes 2 or more{recovery}")
    if machine_restart_s is not None and (nodes < 2 or not in_job
                                          or not machine_restart_s >= 0):
        raise ValueError(f"--machine-restart-s {machine_restart_s:g} starts a lost machine "
                         "again for in-job recovery across machines: it needs --nodes 2 or "
                         f"more{recovery} and a number of seconds >= 0")


def check_train_config(cfg: TrainConfig, nproc: int, nodes: int = 1,
                       spare_nodes: int = 0, machine_restart_s: float | None = None) -> None:
    """Everything that can be checked before starting processes, so that bad input gets
    one clear line instead of a traceback from every rank. `nproc` ranks on each of
    `nodes` (simulated) nodes."""
    from moc.checkpoint.store.manifest import Manifest
    from moc.checkpoint.store.steps import complete_steps
    from moc.topology import ParallelLayout
    from moc.train.data import Corpus

    world = nodes * nproc
    check_launch(nproc, nodes, spare_nodes, machine_restart_s,
                 in_job=cfg.resolve_recovery(max(world, 1)) == "in-job")
    ParallelLayout(world, cfg.resolve_ep(world), cfg.model.n_experts)
    if cfg.fault_kind == "machine" and not spare_nodes and machine_restart_s is None:
        raise ValueError("--fault-kind machine loses a machine for good: give "
                         "--spare-nodes 1 for one to take its place, or "
                         "--machine-restart-s S to start it again")
    faults = cfg.fault_at is not None or cfg.fault_every is not None
    if faults and cfg.fault_node is None and cfg.fault_rank >= world:
        ranks = f"--nproc {nproc}" + (f" x --nodes {nodes}" if nodes > 1 else "")
        raise ValueError(f"--fault-rank {cfg.fault_rank} does not exist with {ranks}")
    if cfg.fault_node is not None and cfg.fault_node >= nodes:
        raise ValueError(f"--fault-node {cfg.fault_node} does not exist with --nodes {nodes}"
                         f" (nodes are numbered 0..{nodes - 1})")
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here (torch."
                             "cuda.is_available() is False); use --device cpu")
        if torch.cuda.device_count() < world:
            raise ValueError(f"--device cuda: {world} ranks need a GPU each, this machine "
                             f"has {torch.cuda.device_count()}; use fewer ranks or "
                             "--device cpu")
    Corpus.load(cfg.data, cfg.model.seq_len)
    if cfg.ckpt_mode != "none":
        from moc.checkpoint.policy.selection import PECPolicy

        # The options every worker would reject, rejected once here.
        PECPolicy(k=cfg.k_persist, selection=cfg.selection, apply_to=cfg.pec_apply,
                  dynamic_k=cfg.dynamic_k, plt_threshold=cfg.plt_threshold)
        if cfg.k_persist is not None and cfg.k_persist > cfg.model.n_experts:
            raise ValueError(f"--k-persist {cfg.k_persist} is more than the "
                             f"{cfg.model.n_experts} experts per MoE layer of --config "
                             f"{cfg.preset}; use at most {cfg.model.n_experts}, or 'all'")
        if isinstance(cfg.k_snapshot, int) and cfg.k_snapshot > cfg.model.n_experts:
            raise ValueError(f"--k-snapshot {cfg.k_snapshot} is more than the "
                             f"{cfg.model.n_experts} experts per MoE layer of --config "
                             f"{cfg.preset}; use at most {cfg.model.n_experts}, 'all' or "
                             "'auto'")
    if cfg.ckpt_mode == "dcp-async" and not has_dcp_async_staging():
        import torch

        raise ValueError(f"--ckpt-mode dcp-async needs DCP's DefaultStager, which torch "
                         f"{torch.__version__} lacks (torch 2.9 added it); use --ckpt-mode "
                         "dcp-sync, or upgrade torch to 2.9+")
    if cfg.ckpt_dir is not None:
        from moc.baselines.dcp import DCP_MODES, complete_dcp_steps
        from moc.checkpoint.store.storage import open_storage

        storage = open_storage(cfg.ckpt_dir)  # a URL: an object store (ValueError if unknown)
        root = storage.root
        if storage.local is None and cfg.ckpt_mode in DCP_MODES:
            raise ValueError(f"--ckpt-mode {cfg.ckpt_mode} (a DCP baseline) writes a local "
                             f"directory; --ckpt-dir {root} is an object store: use "
                             "--ckpt-mode moc, pec or blocking there")
        if cfg.ckpt_mode != "none":
            from moc.checkpoint.store.lock import DirectoryLock

            DirectoryLock.acquire(root).release()  # another job's: one line, no workers
        steps = complete_steps(root)
        dcp_steps = [] if storage.local is None else complete_dcp_steps(storage.local)
        dcp = cfg.ckpt_mode in DCP_MODES
        # Each kind of checkpointer sees only its own steps: given the other kind's, a
        # run would silently start over.
        if cfg.ckpt_mode != "none" and (steps if dcp else dcp_steps):
            raise ValueError(f"--ckpt-dir {root} holds {'moc' if dcp else 'DCP'} checkpoints, "
                             f"which --ckpt-mode {cfg.ckpt_mode} cannot resume; use another "
                             "--ckpt-dir")
        # A DCP step's model is not checked here: reading it means unpickling its
        # `.metadata`, which moc's own code never does (see moc.baselines.dcp); the
        # restore reports a different model on every rank instead.
        if cfg.resume_step is not None and cfg.resume_step not in steps:
            from moc.checkpoint.recovery import describe_steps

            raise ValueError(f"--resume-step {cfg.resume_step}: {root} holds no complete "
                             f"checkpoint of that step (complete steps: "
                             f"{describe_steps(steps)})")
        if steps and not dcp:
            Manifest.load(root, steps[-1]).check_model(
                cfg.model.to_dict(), f"checkpoint {cfg.ckpt_dir}/step-{steps[-1]:08d}")
            resumes_at = steps[-1] if cfg.resume_step is None else cfg.resume_step
            if resumes_at > cfg.steps:
                raise ValueError(
                    f"the run in {cfg.ckpt_dir} is already at step {resumes_at}, past "
                    f"--steps {cfg.steps}: nothing to train; raise --steps to go on, "
                    "--resume-step S to roll back to step S, or use another --ckpt-dir")
            if resumes_at == cfg.steps:
                _check_final_step(cfg, root, resumes_at)


def _check_final_step(cfg: TrainConfig, root: Any, step: int) -> None:
    """A run whose final step is on storage is complete only when that step verifies
    (every byte it reads: `moc verify` of that step): RunComplete then. A damaged final
    step is said in one line and the run trains again, from the newest intact step (the
    restore skips the damaged one). Before, a truncated final shard was "already
    complete", exit 0, while `moc verify` and `moc export` refused it (issue 47)."""
    from moc.checkpoint.tools import verify_checkpoints

    report = verify_checkpoints(root, only=[step])
    if step not in report.damaged_steps and report.ok:
        raise RunComplete(f"the run in {cfg.ckpt_dir} is already complete at step {step} "
                          f"(--steps {cfg.steps}): nothing to train")
    path, reasons = next(iter(report.bad_files.items()), ("?", ["it does not verify"]))
    print(f"moc train: the final step {step} in {cfg.ckpt_dir} is damaged ({path}: "
          f"{reasons[0]}): training again from the newest intact step",
          file=sys.stderr, flush=True)


def launch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Start `args.nproc` workers under torchrun (restarting them on faults); with
    `--nodes N` > 1, N torchrun agents, one per simulated node (moc.train.nodes)."""
    from moc.train.agent import run_agent

    ranks = args.nodes * args.nproc
    cfg = config_from_args(args).for_world(ranks)
    try:
        check_train_config(cfg, args.nproc, args.nodes, args.spare_nodes,
                           args.machine_restart_s)
    except RunComplete as e:
        print(f"moc train: {e}", file=sys.stderr)
        return 0
    # Every worker trains where, and recovers how, the launcher decided.
    args.device, args.recovery, args.spares = cfg.device, cfg.recovery, cfg.spares
    # Each rank gets its share of the cores; also silences torchrun's warning.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    # c10d's C++ warnings (a store or peer connection lost: a warning and a 20-frame C++
    # trace from each process that still talked to it) repeat what moc says of each
    # fault in one line. Errors still show; TORCH_CPP_LOG_LEVEL set by the user wins.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    shutdown_s = torchrun_shutdown_s(cfg.grace_s)
    if args.nodes > 1:
        from moc.train.nodes import run_nodes

        return run_nodes(args.nodes, args.nproc, args.max_restarts, worker_argv(args, parser),
                         module=worker_module(cfg), spare_nodes=args.spare_nodes,
                         machine_restart_s=args.machine_restart_s,
                         gpus=args.nproc if cfg.device == "cuda" else 0,
                         shutdown_s=shutdown_s, memory_key=_memory_key(cfg))
    # The workers get a signal too (torchrun forwards it) and say, on rank 0, where they
    # stopped; the agent only reports the signal in its status (moc.train.agent).
    return run_agent(single_node_argv(args.nproc, args.max_restarts, shutdown_s,
                                      worker_module(cfg), worker_argv(args, parser)))


def run_script(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`moc run`: the user's script on `--nproc` ranks per node, each under a rank host
    (`moc.train.host --script`), under torchrun; with `--nodes N` > 1, N torchrun
    agents, one per simulated machine, as `moc train --nodes` runs them."""
    from moc.train.agent import run_agent

    try:
        check_launch(args.nproc, args.nodes, args.spare_nodes, args.machine_restart_s,
                     in_job=True, recovery="")
    except ValueError as e:
        parser.error(str(e))
    if args.hang_timeout is not None and args.hang_timeout <= 0:
        parser.error(f"--hang-timeout must be > 0, got {args.hang_timeout}")
    if not os.path.isfile(args.script):
        parser.error(f"{args.script}: no such file; give the path of your training script")
    ranks = args.nodes * args.nproc
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    host = ["--script", args.script, "--spares", str(args.spares), "--max-replacements",
            str(args.max_replacements)]
    if args.hang_timeout is not None:
        host += ["--hang-timeout", str(args.hang_timeout)]
    worker = [*host, "--", *args.args]
    if args.nodes > 1:
        from moc.train.nodes import run_nodes

        return run_nodes(args.nodes, args.nproc, args.max_restarts, worker,
                         module="moc.train.host", spare_nodes=args.spare_nodes,
                         machine_restart_s=args.machine_restart_s,
                         shutdown_s=torchrun_shutdown_s(0.0), command="moc run")
    return run_agent(single_node_argv(args.nproc, args.max_restarts, torchrun_shutdown_s(0.0),
                                      "moc.train.host", worker), command="moc run")


def _memory_key(cfg: TrainConfig) -> str | None:
    """What names the simulated nodes' memory of a run (`nodes.sim_root`): its
    checkpoint directory's job id, so that the run started again finds it."""
    if cfg.ckpt_dir is None or cfg.ckpt_mode != "moc":
        return None
    from moc.checkpoint.twolevel.memory.jobdir import default_job_id

    return default_job_id(cfg.ckpt_dir)


def single_node_argv(nproc: int, max_restarts: int, shutdown_s: int | None, module: str,
                     worker: list[str]) -> list[str]:
    """torchrun's command line for `nproc` workers on this host. `shutdown_s`: its
    `--shutdown-timeout` (None: this torchrun has none, see `torchrun_shutdown_s`)."""
    # On SIGTERM/SIGINT torchrun forwards the signal to the workers and kills them after
    # the shutdown timeout: first they stop at a step boundary and take a final
    # checkpoint, within --grace-s (moc.Preemption).
    shutdown = [] if shutdown_s is None else ["--shutdown-timeout", str(shutdown_s)]
    return ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts",
            str(max_restarts), *shutdown, "--module", module, *worker]


def worker_module(cfg: TrainConfig) -> str:
    """What torchrun starts per rank: the training process, or under `--recovery in-job`
    its host, which starts it and replaces it on a fault (moc.train.host)."""
    return "moc.train.host" if cfg.recovery == "in-job" else "moc.train"


SHUTDOWN_MARGIN_S = 15
"""Beyond --grace-s, how long torchrun waits for workers after forwarding a signal: a
worker whose grace period ran out exits at once (os._exit), this only covers that."""


def shutdown_timeout(grace_s: float) -> int:
    """torchrun's `--shutdown-timeout` (whole seconds) for workers given `grace_s`."""
    return int(grace_s + 0.999) + SHUTDOWN_MARGIN_S


def torchrun_shutdown_s(grace_s: float) -> int | None:
    """torchrun's `--shutdown-timeout` for workers given `grace_s`, or None where this
    torchrun has no such option (torch before 2.12). It then kills its workers
    TORCHRUN_SHUTDOWN_S after forwarding a signal, whatever --grace-s says: one line on
    stderr tells when that cuts the grace period short."""
    wanted = shutdown_timeout(grace_s)
    if torchrun_accepts("--shutdown-timeout"):
        return wanted
    if wanted > TORCHRUN_SHUTDOWN_S:
        import torch

        print(f"moc train: warning: torchrun of torch {torch.__version__} has no "
              f"--shutdown-timeout (torch 2.12 added it): on SIGTERM or Ctrl-C it kills "
              f"the workers {TORCHRUN_SHUTDOWN_S} s after forwarding the signal, before "
              f"--grace-s {grace_s:g} plus {SHUTDOWN_MARGIN_S} s to exit is up, so a final "
              f"checkpoint still being written then is lost (the run resumes from the one "
              f"before); upgrade torch to 2.12+, or use --grace-s "
              f"{TORCHRUN_SHUTDOWN_S - SHUTDOWN_MARGIN_S} or less", file=sys.stderr)
    return None


def demo() -> int:
    """The main job: 2 ranks, ep=2, tiny, 200 steps with two-level checkpoints (a complete
    snapshot in shared memory, 1 of 4 experts per layer persisted), a SIGKILL at step
    130, recovery from memory, and what the recovery lost (nothing). Its output,
    runs/demo/, is written (afresh) under the current directory."""
    from moc.checkpoint.policy.tokens import format_plt  # torch: the launcher has it by now
    from moc.train.metrics import read_events, table

    if DEMO_DIR.exists():
        shutil.rmtree(DEMO_DIR)
    metrics = DEMO_DIR / "metrics.jsonl"
    argv = ["train", "--nproc", "2", "--ep", "2", "--config", "tiny", "--steps", "200",
            "--ckpt-dir", str(DEMO_DIR / "ckpt"), "--ckpt-interval", "25",
            "--ckpt-mode", "moc", "--k-persist", "1", "--dynamic-k", "--keep-last", "2",
            "--fault-at", "130", "--fault-rank", "1", "--max-restarts", "1",
            "--metrics", str(metrics)]
    print("moc demo: moc " + " ".join(argv), flush=True)
    rc = main(argv)
    if rc:
        return rc
    budget = build_parser()[1]["train"].get_default("plt_threshold")  # the demo keeps it
    events = read_events(metrics)
    ckpts = [e for e in events if e["event"] == "checkpoint"]
    recoveries = [e for e in events if e["event"] == "recovery"]
    summary = [e for e in events if e["event"] == "summary"][-1]
    first, second = ckpts[0], ckpts[1]

    def median(field: str) -> float:
        return statistics.median(e[field] or 0.0 for e in ckpts)

    rows = [("checkpoints", f"{len(ckpts)} x {first['mode']}: snapshot of all experts in "
                            f"memory; persisted first {first['bytes'] / 1e6:.2f} MB (all "
                            f"experts), then K={second['k']}: {second['bytes'] / 1e6:.2f} MB"),
            ("median stall", f"{median('stall_s'):.4f}s (snapshot {median('snapshot_s'):.4f}s"
                             f", persist {median('persist_s'):.4f}s in the background)")]
    for r in recoveries:
        rows.append(("fault + recovery",
                     f"rank 1 killed at step 130; last step logged {r['step']}, resumed "
                     f"from {r['resumed_from']} ({r['source']}) in {r['recovery_s']:.2f}s"))
        rows.append(("lost tokens", f"{r['lost_tokens']} expert assignments, "
                                    f"{format_plt(r['plt'], budget)}"))
    for e in events:
        if e["event"] == "dynamic_k":
            rows.append(("Dynamic-K", f"PLT over budget: K {e['k_before']} -> {e['k']} "
                                      "experts per layer from then on"))
    rows += [("final train loss", f"{summary['final_loss']:.4f}"),
             ("validation loss", f"{summary['val_loss']:.4f}"),
             ("metrics", str(metrics)),
             ("look inside", f"{moc_command()} inspect {DEMO_DIR / 'ckpt'}; "
                             f"{moc_command()} verify {DEMO_DIR / 'ckpt'}")]
    print("\n" + table(rows, "moc demo: what happened"))
    return 0


def moc_command() -> str:
    """How to run moc from here, for the lines that tell a user what to type next: `moc`
    when that is on PATH and is this installation, else this interpreter's own `moc`
    script (e.g. `.venv/bin/moc`, which `make demo` does not put on PATH), else
    `python -m moc`."""
    here = Path(sys.executable).parent / "moc"
    found = shutil.which("moc")
    if found is not None and (not here.exists() or Path(found).resolve() == here.resolve()):
        return "moc"
    if here.exists():
        try:
            return str(here.relative_to(Path.cwd()))
        except ValueError:
            return str(here)
    return f"{sys.executable} -m moc"


SIGPIPE_EXIT = 141
"""The status of a process killed by SIGPIPE (128 + 13), as `moc inspect | head` gets:
what a shell reports for any tool whose reader went away."""


def _print(text: str) -> int | None:
    """Print `text`; SIGPIPE_EXIT if the reader of stdout is gone (`| head`), else None.

    Python ignores SIGPIPE, so a closed pipe is a BrokenPipeError here, and again when
    the interpreter flushes stdout at exit: stdout is pointed at /dev/null so that the
    second one does not print a traceback either."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return SIGPIPE_EXIT
    return None


SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10,
              "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """`--shard-size`: bytes, or a number with kB, MB, GB (powers of 10) or KiB, MiB, GiB."""
    num = text.strip().rstrip("bBiIkKmMgG")
    unit = text.strip()[len(num):].lower()
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in SIZE_UNITS or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a size such as 500MB or 2000000, got "
                                         f"{text!r}")
    return int(value * SIZE_UNITS[unit])


BENCHMARKS = ("size", "overhead", "accuracy", "persist", "profile", "outage", "dtensor",
              "trainer", "loop", "injob")
"""`moc bench WHAT`: each is the module moc.bench.WHAT, with its own options."""


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `moc` command line and its subcommands by name (tests/test_cli_help.py walks
    them: every one answers --help). The subcommands' parsers are `OneLineParser`s too."""
    parser = OneLineParser(prog="moc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train the reference MoE model under torchrun",
        usage="%(prog)s [options]",
        description="Train moc's reference MoE model on --nproc ranks per node under "
        "torchrun, checkpointing to --ckpt-dir and recovering from faults. Options by "
        "group; --help-all adds the testing ones (fault injection, benchmark baselines).")
    add_train_args(train, launcher=True)
    run = sub.add_parser(
        "run", help="run your own training script with in-job recovery: a rank that "
        "dies or hangs is replaced, the others keep their processes (moc.run)",
        description="Run SCRIPT on --nproc ranks per node (--nodes simulated machines on "
        "this host, default 1) under rank hosts: a "
        "rank that dies or hangs is replaced by a new process, and the others, inside "
        "moc.run(train), rejoin it and enter train again in the same process "
        "(docs/guide/recovery.md, 'Your own loop').")
    add_launcher_args(run)
    run.add_argument("--spares", type=int, choices=(0, 1), default=0,
                     help="a training process per rank started ahead, imported and "
                          "waiting, to take a lost one's place (default 0)")
    run.add_argument("--hang-timeout", type=float,
                     help="seconds without a step (or a heartbeat) before a rank is "
                          "taken for hung (default: 10 times its median step, at least "
                          "5 s)")
    run.add_argument("--max-replacements", type=int, default=100,
                     help="replacements per rank before the job gives up (default 100)")
    run.add_argument("script", help="your training script (it calls moc.run(train))")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    sub.add_parser("demo", help=f"the main job: train with a fault and recover (writes "
                                f"{DEMO_DIR}/ under the current directory)",
                   description=demo.__doc__)
    inspect = sub.add_parser("inspect", help="list a checkpoint directory's steps, the "
                             "experts each saved and how old every expert's copy is, from the "
                             "manifests and file sizes; exit 1 if a step is CORRUPT or "
                             "DAMAGED (then run verify, which reads every byte)")
    inspect.add_argument("dir", help="checkpoint directory (--ckpt-dir) or an object "
                         "store URL (s3://bucket/prefix)")
    inspect.add_argument("--json", action="store_true", help="one JSON document instead")
    verify = sub.add_parser("verify", help="re-check every checksum and file size; exit 1 "
                            "if anything is corrupt or missing")
    verify.add_argument("dir", help="checkpoint directory (--ckpt-dir) or an object "
                        "store URL (s3://bucket/prefix)")
    export = sub.add_parser(
        "export", help="write one step as the model's own state dict (experts gathered "
        "from every rank and step) for inference or transformers' from_pretrained; "
        "reads DIR without changing it",
        description="Write the model state of one checkpoint step into OUT under the "
        "model's own parameter names. DIR is only read. Formats: hf (sharded "
        "model-0000i-of-0000n.safetensors + model.safetensors.index.json), safetensors "
        "(model.safetensors), torch (pytorch_model.bin); each with config.json when the "
        "checkpoint stored the model's config.")
    export.add_argument("dir", help="checkpoint directory (--ckpt-dir) or an object "
                        "store URL (s3://bucket/prefix)")
    export.add_argument("out", type=Path, help="output directory (created; must be empty "
                        "or missing unless --force)")
    export.add_argument("--step", type=int, help="step to export (default: the newest)")
    export.add_argument("--format", choices=["hf", "safetensors", "torch"], default="hf",
                        help="output format (default hf)")
    export.add_argument("--allow-partial", action="store_true",
                        help="export a step whose experts are not all saved at it (a "
                             "partial checkpoint), printing each expert's age")
    export.add_argument("--shard-size", type=parse_size, default=None,
                        help="hf: largest shard, bytes or with kB/MB/GB (default 5GB)")
    export.add_argument("--force", action="store_true",
                        help="replace OUT when it is not empty")
    bench = sub.add_parser("bench", add_help=False,
                           help=f"benchmarks: `moc bench {{{','.join(BENCHMARKS)}}} --help`")
    bench.add_argument("what", choices=BENCHMARKS, help="the benchmark to run")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    simulate = sub.add_parser("simulate", add_help=False,
                              help="effective training time and the best checkpoint "
                                   "interval from measured costs: `moc simulate --help`")
    simulate.add_argument("rest", nargs=argparse.REMAINDER)
    return parser, dict(sub.choices)


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1] in ("-h", "--help")):
        print(f"usage: moc bench {{{','.join(BENCHMARKS)}}} "
              "[options]\n\n"
              "  size      checkpoint size per strategy (blocking, PEC K, sharding)\n"
              "  overhead  stall and throughput of every checkpoint mode, side by side\n"
              "  accuracy  validation loss and PLT under recurring faults\n"
              "  persist   persist time to an S3 server vs local disk, K=1 and K=N\n"
              "  outage    step times while the S3 server is stopped mid-run\n"
              "  profile   where one checkpoint's wall and CPU time goes, phase by phase\n"
              "  dtensor   host memory and bytes of a save on FSDP2 + DTensor EP\n"
              "  trainer   transformers.Trainer: moc vs its own save_steps, step times\n"
              "  loop      a checkpoint every step, phase by phase on the training thread\n"
              "  injob     downtime per fault: your own loop under moc run vs moc train\n\n"
              "`moc bench WHAT --help` lists the options of each.")
        return 0 if len(argv) > 1 else 2
    if argv[:1] == ["simulate"]:
        # A leading REMAINDER positional would swallow nothing that starts with "--".
        argv = ["simulate", "--", *argv[1:]]
    # Unknown options are reported by the subcommand's own parser, with its usage: the
    # top-level usage (`moc [-h] {train,...}`) says nothing about what `moc train` takes.
    first = next((a for a in argv if a not in ("-h", "--help")), None)
    if first is not None and first.startswith("-"):  # before any command: not one of ours
        parser.error(f"unknown option {first}: a command comes first "
                     f"({', '.join(commands)}), its options after it")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if args.command in ("bench", "simulate"):
            what = "simulate" if args.command == "simulate" else args.what
            return importlib.import_module(f"moc.bench.{what}").main(args.rest)
        if args.command == "train":
            return launch(args, commands["train"])
        if args.command == "run":
            return run_script(args, commands["run"])
        if args.command == "demo":
            return demo()
        if args.command == "inspect":
            from moc.checkpoint.tools import format_inspect, inspect_checkpoints

            info = inspect_checkpoints(args.dir)
            corrupt = any(s["corrupt"] or s["damaged"] for s in info["steps"])
            return _print(format_inspect(info, as_json=args.json)) or (1 if corrupt else 0)
        if args.command == "export":
            from moc.checkpoint.export import DEFAULT_SHARD_BYTES, export, format_export

            with progress(None, "moc export", unit="MB") as bar:
                def advance(nbytes: int, total: int) -> None:
                    bar.set_total(total / 1e6)
                    bar.update(nbytes / 1e6)

                report = export(args.dir, args.out, step=args.step, format=args.format,
                                allow_partial=args.allow_partial, force=args.force,
                                shard_size=args.shard_size or DEFAULT_SHARD_BYTES,
                                progress=advance)
            return _print(format_export(report)) or 0
        if args.command == "verify":
            from moc.checkpoint.tools import format_verify, verify_checkpoints

            report = verify_checkpoints(args.dir)
            return _print(format_verify(report)) or (0 if report.ok else 1)
    except (ValueError, CheckpointError) as e:
        print(f"moc {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0
