"""The walk of one two-level checkpoint and of one restore through moc's modules (issue 31).

    python scripts/walk.py

Runs a single-process `TwoLevelCheckpointer` on a small model: a save of step 1 flushed
to a committed manifest, then a fresh engine's restore (from memory) and a restore of
step 1 from storage. Every process (the persist process too) records which moc module
each call enters (scripts/walk/sitecustomize.py); printed per phase and thread: the
modules in the order first entered, the moves between modules, and the returns (moves
back into a module the walk had left); and over the calls from one moc module into
another, the crossings, the climbs (into a module that imports the caller's) and the
revisits (into a module entered before). docs/BENCHMARKS.md, "The walk of one save".
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PHASES = ("save", "restore-memory", "restore-storage")

CHILD = r"""
import sys, torch
import moc
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer

from moc.model import ModelConfig, Transformer

model = Transformer(ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32,
                                n_experts=4))
opt = torch.optim.AdamW(model.parameters())
ckpt = TwoLevelCheckpointer(model, opt, sys.argv[1], policy=moc.PECPolicy(k=1),
                            persist_policy="wait", job=sys.argv[2])
ckpt.save(1)
ckpt.flush()
ckpt.drain_completed()
ckpt.close(keep_snapshots=True)
ckpt = TwoLevelCheckpointer(model, opt, sys.argv[1], policy=moc.PECPolicy(k=1), job=sys.argv[2])
report = ckpt.restore()
print("restored from", report.source)
report = ckpt.restore(step=1)
print("restored from", report.source)
ckpt.close()
"""


def walk(lines: list[str], imports: dict[str, set[str]]) -> dict[str, object]:
    """The modules in the order first entered; `moves` and `returns` over the sequence
    of modules that calls entered (a return from a callee shows as a move back); and,
    over the calls from one moc module into another (issue 48's count): `crossings`,
    `climbs` (a call into a module that imports the caller's, directly or not: back up
    the layers, through a callback) and `revisits` (a call into a module the walk had
    entered before)."""
    rows = [line.split("\t") for line in lines]
    modules = [r[1].removeprefix("moc.") for r in rows]
    modules = [m for i, m in enumerate(modules) if i == 0 or m != modules[i - 1]]
    seen, left, returns, first = set(), set(), 0, []
    prev = None
    for m in modules:
        if prev is not None and m != prev:
            left.add(prev)
            if m in left:
                returns += 1
        if m not in seen:
            seen.add(m)
            first.append(m)
        prev = m
    crossings = climbs = revisits = 0
    entered: set[str] = set()
    climbed: set[str] = set()
    for r in rows:
        callee, caller = r[1], (r[3] if len(r) > 3 else "")
        if caller.startswith("moc.") and caller != callee:
            crossings += 1
            if caller in imports.get(callee, set()):
                climbs += 1
                climbed.add(f"{caller} -> {callee}.{r[2]}")
            revisits += callee in entered
        entered.add(callee)
    return {"modules": first, "moves": max(0, len(modules) - 1), "returns": returns,
            "crossings": crossings, "climbs": climbs, "climbed": sorted(climbed),
            "revisits": revisits}


def import_closure() -> dict[str, set[str]]:
    """moc module -> every moc module it imports, directly or not (the source's import
    statements, those under TYPE_CHECKING included), for the moc that PYTHONPATH finds."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("moc")
    assert spec is not None and spec.origin is not None
    root = Path(spec.origin).parent
    direct: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if parts[-1] == "__init__" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                found |= {base} | {f"{base}.{a.name}" for a in node.names}
        direct[name] = {m for m in found if m.startswith("moc")}
    closure: dict[str, set[str]] = {}
    for name in direct:
        todo, reach = list(direct[name]), set()
        while todo:
            m = todo.pop()
            if m in reach or m not in direct:
                continue
            reach.add(m)
            todo.extend(direct[m])
        closure[name] = reach
    return closure


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "walk")
        env = {**os.environ, "PYTHONPATH": f"{HERE / 'walk'}:{os.environ.get('PYTHONPATH', '')}",
               "MOC_WALK_OUT": out}
        job = f"walk-{os.getpid()}"
        subprocess.run([sys.executable, "-c", CHILD, os.path.join(tmp, "ckpt"), job],
                       env=env, check=True, stdout=sys.stderr)
        # The trainer's calls are split into phases by the engine method that starts each
        # (save, the first restore, the second); the persist process's all belong to the
        # save (it only persists).
        results: dict[str, dict[str, object]] = {}
        files = sorted(p for p in os.listdir(tmp) if p.startswith("walk.") and p[5:].isdigit())
        per_pid = {int(p[5:]): Path(tmp, p).read_text().splitlines() for p in files}
        trainer_pid = min(per_pid)  # the first process started
        starts = {"save": "save", "restore": "restore"}
        current, seq = "start", collections.defaultdict(lambda: collections.defaultdict(list))
        n_restore = 0
        for line in per_pid[trainer_pid]:
            thread, module, func = line.split("\t")[:3]
            if module == "moc.checkpoint.twolevel.checkpointer" and func in starts \
                    and thread == "MainThread":
                if func == "restore":
                    n_restore += 1
                    current = "restore-memory" if n_restore == 1 else "restore-storage"
                else:
                    current = "save"
            elif module == "moc.checkpoint.twolevel.checkpointer" and func == "close" \
                    and thread == "MainThread":
                current = "other"
            seq[current][thread].append(line)
        persist = sorted(per_pid)[1]  # the first engine's persist process (the save's)
        lines = per_pid[persist]  # from its entry point: what it runs, not what it imports
        start = next(i for i, line in enumerate(lines) if line.split("\t")[2] == "serve")
        imports = import_closure()
        seq["save"]["persist process"].extend(lines[start:])
        for phase in PHASES:
            results[phase] = {thread: walk(lines, imports)
                              for thread, lines in seq[phase].items()}
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
