"""The rules that keep the package's shape (docs/DECISIONS.md, "Dependency rules"):

1. `moc.checkpoint` (the product) imports only itself and `moc.topology`: never the
   reference model, trainer, benchmarks, baselines, the trainer's parallelism or the CLI.
2. `moc.topology` imports nothing else of moc: everyone may import it.
3. No module imports another module's `_private` name, nor reaches into one through an
   imported module (`module._name`).
4. Nothing of moc unpickles (docs/THREAT_MODEL.md): no `*_object` collective of
   torch.distributed (they pickle and unpickle), no `pickle.load`/`loads`, no `torch.load`
   without `weights_only=True`. A collective of the trainer's used `all_gather_object`
   (issue 29).

The checks read the source with `ast` (imports inside functions included), so they hold
for code that no test happens to execute.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moc"
PRODUCT_MAY_IMPORT = ("moc.checkpoint", "moc.topology")


@dataclass(frozen=True)
class Violation:
    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module of a `from ... import` (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")[: -node.level]
    return ".".join(base + ([node.module] if node.module else []))


def _inside(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def check_source(module: str, source: str, where: str) -> list[Violation]:
    """Every rule broken by one module's source."""
    tree = ast.parse(source)
    out: list[Violation] = []
    moc_aliases: set[str] = set()  # names bound to a moc module here
    for node in ast.walk(tree):
        imported: list[tuple[str, str | None]] = []  # (module, name imported from it)
        if isinstance(node, ast.Import):
            for alias in node.names:
                imported.append((alias.name, None))
                if alias.name.startswith("moc"):
                    moc_aliases.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            source_module = _resolve(module, node)
            for alias in node.names:
                imported.append((source_module, alias.name))
                if source_module.startswith("moc") and not alias.name.startswith("_"):
                    moc_aliases.add(alias.asname or alias.name)
        for target, name in imported:
            if not _inside(target, ("moc",)):
                continue
            line = f"{where}:{node.lineno}"
            full = f"{target}.{name}" if name else target
            if _inside(module, ("moc.checkpoint",)) and not _inside(target, PRODUCT_MAY_IMPORT):
                out.append(Violation(line, f"the product imports {full}; moc.checkpoint may "
                                           f"import only {', '.join(PRODUCT_MAY_IMPORT)}"))
            if module == "moc.topology":
                out.append(Violation(line, f"moc.topology imports {full}; it must import "
                                           "nothing else of moc"))
            private = [p for p in full.split(".")[1:] if p.startswith("_")
                       and not (p.startswith("__") and p.endswith("__"))]
            if private and target != module:
                out.append(Violation(line, f"imports the private name {full}"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                and node.value.id in moc_aliases):
            out.append(Violation(f"{where}:{node.lineno}",
                                 f"reaches into {node.value.id}.{node.attr}, a private name "
                                 "of another module"))
    return out


UNPICKLING = {"all_gather_object", "broadcast_object_list", "gather_object",
              "scatter_object_list", "send_object_list", "recv_object_list"}
"""Collectives that pickle and unpickle what a peer sends. `pickle.load(s)` and
`torch.load` (allowed with `weights_only=True`) are checked by their owner."""


def check_unpickling(source: str, where: str) -> list[Violation]:
    """Every call of `source` that may unpickle (rule 4)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        owner = func.value.id if (isinstance(func, ast.Attribute)
                                  and isinstance(func.value, ast.Name)) else ""
        safe_load = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
                        and k.value.value is True for k in node.keywords)
        if name in UNPICKLING or (owner == "pickle" and name in ("load", "loads")) or (
                owner == "torch" and name == "load" and not safe_load):
            out.append(Violation(f"{where}:{node.lineno}", f"calls {owner or '?'}.{name}, "
                                 "which unpickles: send data with moc.checkpoint.codec "
                                 "(Dist) and tensors by tensor collectives"))
    return out


def check_package() -> list[Violation]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE.parent))
        source = path.read_text()
        out += check_source(module_name(path), source, where)
        out += check_unpickling(source, where)
    return out


def test_the_package_keeps_its_dependency_rules():
    violations = check_package()
    assert not violations, "dependency rules broken:\n" + "\n".join(map(str, violations))


def test_the_checker_flags_what_it_forbids():
    """The rules above can fail: each forbidden form is caught in a synthetic module."""
    bad = {
        "moc.checkpoint.spec": "from moc.model.transformer import Experts",
        "moc.checkpoint.sync": "import moc.train.loop",
        "moc.checkpoint.twolevel.checkpointer": "def f():\n    from moc.baselines import dcp",
        "moc.checkpoint.state": "from moc.parallel.optim import ShardedAdamW",
        "moc.topology": "from moc.checkpoint.errors import CheckpointError",
        "moc.train.loop": "from moc.checkpoint.sync import _RNG",
        "moc.bench.size": "from moc.checkpoint import sync\nx = sync._RNG",
    }
    for module, source in bad.items():
        assert check_source(module, source, module), (module, source)
    fine = {
        "moc.checkpoint.sync": "from moc.checkpoint.dist import Dist\nfrom moc.topology "
                               "import ParallelGroups\nimport torch\nx = torch._C",
        "moc.train.loop": "from moc.checkpoint.sync import Checkpointer\n"
                          "from moc.model import Transformer",
        "moc.checkpoint.dist": "from __future__ import annotations",
    }
    for module, source in fine.items():
        assert not check_source(module, source, module), (module, source)
    for source in ("dist.all_gather_object(out, mine, group=g)", "pickle.loads(data)",
                   "torch.load(path)", "x = torch.load(path, weights_only=False)"):
        assert check_unpickling(source, "m"), source
    assert not check_unpickling("torch.load(path, map_location='cpu', weights_only=True)",
                                "m")


def test_expert_spec_recognises_a_model_it_never_imported_by_its_structure():
    """No model class is imported by the product: `ExpertSpec.infer` finds moc's own
    experts, and any module shaped like them, by their `expert_offset` and batched
    parameters, whatever the module is called."""
    import torch
    from torch import nn

    from moc.checkpoint.spec import ExpertSpec
    from moc.model import ModelConfig, Transformer

    cfg = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)
    spec = ExpertSpec.infer(Transformer(cfg))
    assert spec.n_moe_layers == 2 and spec.n_experts == 4

    class Batched(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.expert_offset = 2
            self.up = nn.Parameter(torch.zeros(2, 4, 8))

    model = nn.Module()
    model.mixture = Batched()  # not named "experts"
    spec = ExpertSpec.infer(model, n_experts=4)
    assert [p.global_ids for p in spec.params] == [(2, 3)]

    class Block(nn.Module):
        """A block that declares `expert_offset` and holds its gate beside its experts:
        the block is not an expert container, its `experts` are."""

        def __init__(self) -> None:
            super().__init__()
            self.expert_offset = 0
            self.gate = nn.Parameter(torch.zeros(4, 8))
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Block()])
    spec = ExpertSpec.infer(model)
    assert spec.n_moe_layers == 2 and not [p for p in spec.params if "gate" in p.name]
