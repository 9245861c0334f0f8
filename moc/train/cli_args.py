"""Command-line options of `moc train`, shared by the launcher and the worker."""

from __future__ import annotations

import argparse

from moc.train.config import CKPT_MODES, PRESETS, TrainConfig

# Options only the launcher understands; the workers never see them.
LAUNCHER_OPTIONS = ("nodes", "nproc", "max_restarts", "spare_nodes", "machine_restart_s")

TESTING = "testing: fault injection and benchmark baselines"
"""The group `--help` leaves out and `--help-all` shows (issue 50: `moc train --help` was
161 lines, the flags that kill ranks beside the ones a run is configured with)."""


class _HelpAll(argparse.Action):
    """`--help-all`: the help with the testing group, whose options `--help` hides."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        for action in parser._actions:
            action.help = getattr(action, "hidden_help", action.help)
        parser.print_help()
        parser.exit()


def _hidden(group: argparse._ArgumentGroup, *flags: str, help: str, **kw: object) -> None:
    """An option of the testing group: parsed as any other, shown by --help-all only."""
    action = group.add_argument(*flags, help=argparse.SUPPRESS, **kw)
    action.hidden_help = help  # type: ignore[attr-defined]


def _preset(key: str) -> str:
    """The default of an option each preset sets: the values, preset by preset."""
    values = ", ".join(f"{name} {cfg[key]}" for name, cfg in PRESETS.items())
    return f"(default: --config's: {values})"


def add_launcher_args(p: argparse.ArgumentParser) -> None:
    """Where the ranks run (LAUNCHER_OPTIONS): `moc train`'s and `moc run`'s, the same."""
    g = p.add_argument_group("ranks and nodes")
    g.add_argument("--nodes", type=int, default=1,
                   help="simulated machines on this host (default 1): one torchrun "
                        "agent each, with its own node-local memory; --nproc ranks "
                        "per node")
    g.add_argument("--nproc", type=int, default=2,
                   help="ranks to start per node via torchrun (default 2)")
    g.add_argument("--max-restarts", type=int, default=0,
                   help="times torchrun restarts the job after a fault (default 0)")
    g.add_argument("--spare-nodes", type=int, default=0,
                   help="in-job, with --nodes: standby machines (a torchrun agent "
                        "each, its hosts holding a training process ready) that take "
                        "over every rank of a machine lost (default 0)")
    g.add_argument("--machine-restart-s", type=float, metavar="S",
                   help="in-job, with --nodes: a lost machine (its agent SIGKILLed) is "
                        "started again S seconds later, as a scheduler would, and its "
                        "hosts adopt its ranks without restarting the survivors, after "
                        "the spare nodes, if any, are used up (default: not started "
                        "again)")


def add_train_args(p: argparse.ArgumentParser, launcher: bool) -> None:
    """`moc train`'s options in the groups a reader looks for: the model and data, the
    checkpoints, recovery, the ranks, and (behind --help-all) testing. Every option
    states its default."""
    p.add_argument("--help-all", action=_HelpAll, dest=argparse.SUPPRESS,
                   help="show this help with the testing options too (fault injection, "
                        "benchmark baselines)")
    if launcher:
        add_launcher_args(p)
    model = p.add_argument_group("model and data")
    model.add_argument("--config", default="tiny", choices=sorted(PRESETS),
                       help="model and schedule preset (default tiny)")
    model.add_argument("--steps", type=int, help=f"total optimizer steps {_preset('steps')}")
    model.add_argument("--ep", type=int, help="expert-parallel degree (default: the largest "
                                              "dividing both ranks and experts)")
    model.add_argument("--seed", type=int, default=0,
                       help="seed of the initial weights and of the data order (default 0)")
    model.add_argument("--device", choices=["cuda", "cpu"],
                       help="where the model trains: cuda (NCCL, GPU LOCAL_RANK) or cpu "
                            "(gloo) (default: cuda when there is a GPU for every rank)")
    model.add_argument("--batch-size", type=int,
                       help=f"sequences per rank per step {_preset('batch_size')}")
    model.add_argument("--lr", type=float, help=f"peak learning rate {_preset('lr')}")
    model.add_argument("--data", help="text file or directory (default: Python stdlib "
                                      "sources)")
    model.add_argument("--metrics", help="append JSON-lines events to this file, rank 0 "
                                         "(default: none)")
    model.add_argument("--no-progress", action="store_true",
                       help="no progress bar on a terminal: a plain line every 10%% of the "
                            "steps, as in a log (the default when stderr is not a terminal "
                            "or CI is set)")

    ckpt = p.add_argument_group("checkpointing")
    ckpt.add_argument("--ckpt-dir", help="checkpoint directory, or an object store URL "
                                         "(s3://bucket/prefix; endpoint and credentials from "
                                         "AWS_* variables); resumes from it when it holds "
                                         "one (default: no checkpoints)")
    ckpt.add_argument("--ckpt-interval", type=int,
                      help=f"steps between checkpoints {_preset('ckpt_interval')}")
    ckpt.add_argument("--ckpt-mode", choices=CKPT_MODES, default="moc",
                      help="moc (default): PEC + sharding + two levels; pec: synchronous "
                           "PEC; blocking: the Megatron-DeepSpeed baseline; dcp-sync, "
                           "dcp-async: the PyTorch DCP baselines (dcp.save; dcp.async_save "
                           "with a checkpoint process); none")
    ckpt.add_argument("--k-persist",
                      help="experts saved to storage per MoE layer per checkpoint, an "
                           "integer or 'all' (default 1)")
    ckpt.add_argument("--k-snapshot", default="all",
                      help="moc: experts per MoE layer in the memory snapshot: an integer, "
                           "'all' (default: exact recovery from a process crash) or 'auto'")
    ckpt.add_argument("--selection", choices=["sequential", "load-aware"],
                      default="sequential",
                      help="which experts a checkpoint saves (default sequential)")
    ckpt.add_argument("--pec-apply", choices=["weights", "optimizer", "both"],
                      default="both",
                      help="which expert state is partial, the paper's W, O, WO (default "
                           "both)")
    ckpt.add_argument("--dynamic-k", action="store_true",
                      help="double K after a recovery whose PLT exceeds --plt-threshold "
                           "(default off)")
    ckpt.add_argument("--plt-threshold", type=float, default=0.0375,
                      help="the PLT (portion of lost tokens) budget: --dynamic-k doubles K "
                           "above it, and a restore past it warns (default 0.0375, the "
                           "paper's accuracy budget)")
    ckpt.add_argument("--persist-policy", choices=["skip", "wait"], default="skip",
                      help="moc: a checkpoint during a running persist skips persisting "
                           "(default) or waits for it")
    ckpt.add_argument("--keep-last", type=int,
                      help="keep the newest N checkpoints and the older steps they "
                           "reference (default: keep every one)")
    ckpt.add_argument("--k-replica", default="all",
                      help="moc across nodes: experts per MoE layer in the peer replica "
                           "each rank sends to another node's memory: 'all' (default: a "
                           "lost node loses nothing), an integer, or 'none' (no replicas)")
    ckpt.add_argument("--replica-jump", type=int, default=1,
                      help="moc across nodes: node i keeps the replicas of node i - jump "
                           "(default 1)")
    ckpt.add_argument("--replica-rate", type=float,
                      help="moc across nodes: bytes/s each rank may send to its peer "
                           "(default unlimited)")

    rec = p.add_argument_group("recovery")
    rec.add_argument("--recovery", choices=["auto", "restart", "in-job"], default="auto",
                     help="in-job: only the lost or hung rank's process is replaced, the "
                          "others keep their processes and memory; restart: torchrun "
                          "restarts every worker after a fault (--max-restarts); auto "
                          "(default): in-job for more than one rank, restart for one")
    rec.add_argument("--restore-prefer", choices=["exact", "newest"], default="exact",
                     help="moc: when some rank has only a partial copy of the newest step "
                          "and every rank an exact copy of an older one: restore the "
                          "older, exact one (default; the newer steps are set aside) or "
                          "the newest, counting the tokens it loses")
    rec.add_argument("--resume-step", type=int, metavar="S",
                     help="roll back: resume from complete step S on storage instead of "
                          "the newest, and set the newer steps aside (step-N.rolledback); "
                          "the first attempt only (default: the newest)")
    rec.add_argument("--spares", type=int,
                     help="in-job: a standby process per rank, imported and waiting, "
                          "that takes a lost rank's place, 0 or 1 (default 1 on cuda, "
                          "where it costs host memory only, 0 on cpu)")
    rec.add_argument("--hang-timeout", type=float, metavar="S",
                     help="in-job: a rank with no heartbeat, or no step while not waiting "
                          "for a peer, for S seconds is killed and replaced (default: 10x "
                          "the median step time, at least 5 s)")
    rec.add_argument("--max-replacements", type=int, default=100,
                     help="in-job: processes each rank's host replaces before it gives up "
                          "and leaves the job to torchrun's restarts (default 100)")
    rec.add_argument("--grace-s", type=float, default=30.0,
                     help="on SIGTERM or SIGINT (preemption, Ctrl-C) every rank stops at "
                          "the next step boundary and takes a final complete checkpoint; "
                          "after this many seconds the job exits anyway, and a second "
                          "signal exits at once (default 30)")

    test = p.add_argument_group(TESTING)
    _hidden(test, "--fault-at", type=int,
            help="SIGKILL --fault-rank at this step, the first attempt only (default: "
                 "no fault)")
    _hidden(test, "--fault-every", type=int,
            help="SIGKILL --fault-rank at every multiple of this many steps (under "
                 "--recovery restart, give --max-restarts of at least steps / F) "
                 "(default: no fault)")
    _hidden(test, "--fault-rank", type=int, default=0,
            help="the rank --fault-at / --fault-every kill (default 0)")
    _hidden(test, "--fault-kind", choices=["process", "node", "machine", "persist", "hang"],
            default="process",
            help="process (default): SIGKILL the rank; node: also wipe the node's "
                 "shared-memory snapshots (a node loss); machine (with --fault-node, and "
                 "--spare-nodes or --machine-restart-s): SIGKILL every process of the "
                 "simulated machine, its agent and hosts too, and wipe its memory; "
                 "persist: SIGKILL rank 0's persist process instead (--ckpt-mode moc); "
                 "hang: SIGSTOP the rank (--recovery in-job)")
    _hidden(test, "--fault-node", type=int,
            help="with --fault-kind node or machine: lose node J (torchrun's GROUP_RANK) "
                 "instead of --fault-rank's: its persist process and every rank are "
                 "SIGKILLed and its node-local memory wiped (default: --fault-rank's)")
    _hidden(test, "--ckpt-blocks", type=int, default=0, metavar="B",
            help="benchmarks: checkpoint only in every other block of B steps (B..2B-1, "
                 "3B..4B-1, ...), so one run measures steps with and without checkpoints "
                 "side by side (default 0: every interval)")
    _hidden(test, "--no-shard", action="store_true",
            help="the baseline placement (rank 0 + EP group 0 write) instead of every "
                 "rank writing an equal share (default off)")


def parse_k(value: str | None) -> int | None:
    """'all' -> None (every expert); otherwise a positive integer."""
    if value is None:
        return 1
    if value == "all":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--k-persist must be an integer or 'all', got {value!r}") from None


def _int_or(value: str, flag: str, words: tuple[str, ...]) -> int | str:
    """`value` as an integer, or one of `words` as it is (--k-snapshot, --k-replica)."""
    if value in words:
        return value
    try:
        return int(value)
    except ValueError:
        allowed = ", ".join(f"'{w}'" for w in words)
        raise ValueError(f"{flag} must be an integer or one of {allowed}, got {value!r}"
                         ) from None


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig.from_preset(
        args.config, steps=args.steps, ep=args.ep, seed=args.seed, batch_size=args.batch_size,
        lr=args.lr, data=args.data, ckpt_dir=args.ckpt_dir, ckpt_interval=args.ckpt_interval,
        ckpt_blocks=args.ckpt_blocks,
        ckpt_mode=args.ckpt_mode, metrics=args.metrics, fault_at=args.fault_at,
        fault_every=args.fault_every, fault_rank=args.fault_rank, k_persist=parse_k(args.k_persist),
        selection=args.selection, pec_apply=args.pec_apply, dynamic_k=args.dynamic_k,
        plt_threshold=args.plt_threshold, keep_last=args.keep_last, shard=not args.no_shard,
        persist_policy=args.persist_policy, fault_kind=args.fault_kind,
        k_snapshot=_int_or(args.k_snapshot, "--k-snapshot", ("all", "auto")),
        progress=not args.no_progress,
        k_replica=_int_or(args.k_replica, "--k-replica", ("all", "none")),
        replica_jump=args.replica_jump, restore_prefer=args.restore_prefer,
        replica_rate=args.replica_rate, fault_node=args.fault_node,
        grace_s=args.grace_s, resume_step=args.resume_step, recovery=args.recovery,
        spares=args.spares, hang_timeout=args.hang_timeout,
        max_replacements=args.max_replacements,
        device=args.device or default_device(_ranks_here(args)))


def _ranks_here(args: argparse.Namespace) -> int:
    """Ranks this host runs: the launcher's nodes x nproc, a worker's LOCAL_WORLD_SIZE."""
    import os

    if hasattr(args, "nproc"):
        return args.nodes * args.nproc
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def default_device(ranks: int) -> str:
    """`--device` not given: cuda when torch sees a GPU for each of this host's `ranks`
    (NCCL ranks cannot share one), else cpu, so that `moc train --nproc 2` still runs
    on a machine with one GPU."""
    import torch

    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= ranks \
        else "cpu"


def worker_argv(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """Re-serialise the parsed options for `python -m moc.train` under torchrun."""
    argv = []
    for action in parser._actions:
        dest = action.dest
        if dest in ("help", argparse.SUPPRESS, *LAUNCHER_OPTIONS) \
                or not action.option_strings:
            continue
        value = getattr(args, dest)
        if value is None or value is False:
            continue
        if value is True:  # a store_true flag
            argv.append(action.option_strings[0])
            continue
        argv += [action.option_strings[0], str(value)]
    return argv
