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
5. No layer imports a higher one (`LAYERS`, lowest first): a module may import modules
   of its own layer or of a lower one, for types too (under `if TYPE_CHECKING:`).
   Issue 31: the codec imported the two-level protocol, and the engine core (`parts`)
   the export tool.
6. No import cycle among moc's modules: every import counts, inside functions and under
   `if TYPE_CHECKING:` too (a type that closes a cycle is a Protocol of the module that
   uses it). Issue 31: codec and dist imported each other; issue 48: the engine and
   its optimizer hooks, and the planner, replicas, sizing and results, each closed
   through a type.

7. The two-level engine's folders import only the folders before them (`FOLDERS`), and
   none imports the engine's own modules at `moc.checkpoint.twolevel`'s root: a change
   to one role stays in its folder (issue 48).

The checks read the source with `ast` (imports inside functions included), so they hold
for code that no test happens to execute.
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moc"
PRODUCT_MAY_IMPORT = ("moc.checkpoint", "moc.topology")

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("moc.topology", "moc.progress")),
    ("checkpoint vocabulary", (
        "moc.checkpoint", "moc.checkpoint.errors", "moc.checkpoint.phases",
        "moc.checkpoint.liveness", "moc.checkpoint.modelconfig", "moc.checkpoint.lineage",
        "moc.checkpoint.shards", "moc.checkpoint.spec", "moc.checkpoint.policy",
        "moc.checkpoint.failures")),
    ("rank state and storage", ("moc.checkpoint.optimizers", "moc.checkpoint.state",
                                "moc.checkpoint.store")),
    ("messages and collectives", ("moc.checkpoint.codec", "moc.checkpoint.dist")),
    ("plans and the contract", ("moc.checkpoint.plan", "moc.checkpoint.api")),
    ("engine core", ("moc.checkpoint.parts", "moc.checkpoint.recovery",
                     "moc.checkpoint.routing")),
    ("engines", ("moc.checkpoint.sync", "moc.checkpoint.twolevel")),
    ("around the engines", ("moc.checkpoint.export", "moc.checkpoint.exportplan",
                            "moc.checkpoint.tools", "moc.checkpoint.preemption")),
    ("in-job recovery", ("moc.injob",)),
    ("front door", ("moc",)),
    ("framework integrations", ("moc.integrations",)),
    ("reference model", ("moc.model",)),
    ("trainer's parallelism", ("moc.parallel",)),
    ("baselines", ("moc.baselines",)),
    ("trainer", ("moc.train",)),
    ("benchmarks", ("moc.bench",)),
    ("command line", ("moc.cli", "moc.__main__")),
)
"""moc's layers, lowest first (docs/DECISIONS.md, "Dependency rules"). A module, or a name
imported from one, belongs to the layer of the most specific prefix listed that it falls
under: a new module of `store/` or `twolevel/` takes its package's layer, a new module
directly in `moc/checkpoint/` the lowest checkpoint layer (list it where it belongs), and
a new top-level module the front door's (`moc/__init__.py`: the product's public names)."""


ENGINE = "moc.checkpoint.twolevel"
FOLDERS = ("memory", "snapshot", "persist", "replicas", "recovery")
"""The two-level engine's folders, in the order they may import each other: each imports
only those before it (memory is the lowest: host memory, slots, the native copy);
the engine's modules at the root compose them all (rule 7)."""


@dataclass(frozen=True)
class Violation:
    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, node: ast.ImportFrom, package: bool = False) -> str:
    """The absolute module of a `from ... import` (relative ones resolved; a package's
    `from . import x` is relative to the package itself)."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") + ([""] if package else [])
    base = parts[: -node.level]
    return ".".join(base + ([node.module] if node.module else []))


def _inside(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layer_of(name: str) -> int | None:
    """The index in `LAYERS` of a moc module or of a name imported from one (the most
    specific prefix listed wins); None outside moc."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if _inside(name, (prefix,)) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), i)
    return None if best is None else best[1]


def check_source(module: str, source: str, where: str,
                 package: bool = False) -> list[Violation]:
    """Every rule broken by one module's source, but the cycles (`check_cycles`)."""
    tree = ast.parse(source)
    out: list[Violation] = []
    moc_aliases: set[str] = set()  # names bound to a moc module here
    program = _program_only(tree)
    for node in ast.walk(tree):
        imported: list[tuple[str, str | None]] = []  # (module, name imported from it)
        if isinstance(node, ast.Import):
            for alias in node.names:
                imported.append((alias.name, None))
                if alias.name.startswith("moc"):
                    moc_aliases.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            source_module = _resolve(module, node, package)
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
            mine, theirs = layer_of(module), layer_of(full)
            upward = mine is not None and theirs is not None and theirs > mine
            if upward and id(node) not in program:
                out.append(Violation(line, f"{module} (layer {LAYERS[mine][0]!r}) imports "
                                           f"{full} of a higher layer ({LAYERS[theirs][0]!r})"
                                           "; move what it needs down, or invert the "
                                           "dependency"))
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


def _program_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under `if __name__ == "__main__":`: they run only when the
    module is the program (`python -m moc.bench.simulate`), never when it is imported,
    so an import there is the program's, not a dependency of the module's importers."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and (
                ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def import_graph(sources: dict[str, str],
                 packages: frozenset[str] = frozenset()) -> dict[str, dict[str, int]]:
    """module -> {moc module it imports: the line of the first such import}, over the
    modules of `sources` (module -> its source; `packages`: those that are a package's
    `__init__`). Every import counts, inside functions and under `if TYPE_CHECKING:`
    too, but the program's own (`__main__`'s). An import names the most specific
    module of `sources` it runs (`from a import b` runs `a.b` when that is a module,
    else `a`). The parent packages an import runs first are not counted:
    moc/__init__.py imports the engines, so every
    module would otherwise be in a cycle with it."""
    def known(name: str) -> str | None:
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, source in sources.items():
        tree = ast.parse(source)
        skip = _program_only(tree)
        edges = graph.setdefault(module, {})
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, node, module in packages)
                targets = [known(f"{base}.{a.name}") for a in node.names]
            else:
                continue
            for target in targets:
                if target is not None and target != module:
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
    return graph


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph`, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _shortest_cycle(graph: dict[str, dict[str, int]], start: str,
                    within: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside `within` (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w in within and w not in parent:
                    parent[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"{start} is in no cycle")


def check_cycles(sources: dict[str, str], wheres: dict[str, str] | None = None,
                 packages: frozenset[str] = frozenset()) -> list[Violation]:
    """One violation per import cycle: for each strongly connected component, the
    shortest cycle through each of its modules, as a path with the line of each import
    (`wheres`: module -> its file, for the messages)."""
    graph = import_graph(sources, packages)
    wheres = wheres or {}
    out: list[Violation] = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        seen: set[tuple[str, ...]] = set()
        for module in component:
            cycle = _shortest_cycle(graph, module, set(component))
            first = cycle.index(min(cycle[:-1]))
            key = tuple(cycle[first:-1] + cycle[:first])
            if key in seen:
                continue
            seen.add(key)
            path = [*key, key[0]]
            steps = " -> ".join(f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(path))
            out.append(Violation(wheres.get(key[0], key[0]),
                                 f"import cycle: {steps} -> {key[0]}"))
    return out


def check_folders(sources: dict[str, str], wheres: dict[str, str] | None = None,
                  packages: frozenset[str] = frozenset()) -> list[Violation]:
    """Rule 7: one violation per import of a later folder, or of the engine's root, by a
    module of one of the engine's folders."""
    def folder(module: str) -> str | None:
        """The folder of `module` within the engine; "" for the root; None outside."""
        if not module.startswith(f"{ENGINE}."):
            return None
        rest = module[len(ENGINE) + 1:].split(".")
        return rest[0] if len(rest) > 1 or rest[0] in FOLDERS else ""

    out = []
    for module, edges in import_graph(sources, packages).items():
        mine = folder(module)
        if not mine:
            continue
        for target, line in edges.items():
            theirs = folder(target)
            if theirs is None or theirs == mine:
                continue
            if theirs == "" or FOLDERS.index(theirs) > FOLDERS.index(mine):
                what = ("the engine's root" if theirs == "" else f"the later folder {theirs}/")
                out.append(Violation(f"{(wheres or {}).get(module, module)}:{line}",
                                     f"{mine}/ imports {target}, of {what}"))
    return out


def check_package() -> list[Violation]:
    out = []
    sources: dict[str, str] = {}
    wheres: dict[str, str] = {}
    packages: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE.parent))
        module = module_name(path)
        source = path.read_text()
        sources[module], wheres[module] = source, where
        if path.name == "__init__.py":
            packages.add(module)
        out += check_source(module, source, where, path.name == "__init__.py")
        out += check_unpickling(source, where)
    return (out + check_cycles(sources, wheres, frozenset(packages))
            + check_folders(sources, wheres, frozenset(packages)))


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


def test_the_folder_rule_flags_a_later_folder_and_the_engine_root():
    """Rule 7 can fail: a folder importing a later folder, or the engine's root (for a
    type too), is caught; an earlier folder, its own, and what lies outside pass."""
    root = f"{ENGINE}.checkpointer"
    sources = {
        f"{ENGINE}.memory.slots": f"from {ENGINE}.snapshot.worker import SnapshotJob",
        f"{ENGINE}.snapshot.hooks": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                    f"    from {root} import TwoLevelCheckpointer",
        f"{ENGINE}.snapshot.worker": f"from {ENGINE}.memory.slots import SnapshotStore\n"
                                    f"from {ENGINE}.snapshot import capture\n"
                                    "from moc.checkpoint.errors import CheckpointError",
        f"{ENGINE}.snapshot.capture": "", root: f"from {ENGINE}.recovery.copies import PREFER",
        f"{ENGINE}.recovery.copies": "", "moc.checkpoint.errors": "",
    }
    found = sorted(v.what for v in check_folders(sources))
    assert found == [f"memory/ imports {ENGINE}.snapshot.worker, of the later folder snapshot/",
                     f"snapshot/ imports {root}, of the engine's root"], found


def test_the_layer_rule_flags_an_import_of_a_higher_layer():
    """Rule 5 can fail: each upward import is caught, a new module of a package takes the
    package's layer, and imports of a module's own layer or lower pass."""
    upward = {
        "moc.checkpoint.codec": "from moc.checkpoint.twolevel.persist.protocol import Hello",
        "moc.checkpoint.parts": "from moc.checkpoint.export import model_config_of",
        "moc.checkpoint.dist": "def f():\n    from moc.checkpoint import recovery",
        "moc.checkpoint.store.storage": "from moc.checkpoint.dist import Dist",
        "moc.checkpoint.twolevel.snapshotter": "from moc.checkpoint.tools import verify",
        "moc.checkpoint.sync": "import moc",
        "moc.checkpoint.a_new_module": "from moc.checkpoint.dist import Dist",
        "moc.checkpoint.store.manifest": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:"
                                         "\n    from moc.checkpoint.sync import Checkpointer",
        "moc.model.transformer": "from moc.parallel import shard_experts",
        "moc.train.loop": "from moc.bench.overhead import main",
        "moc.bench.simulate": "from moc.cli import main",
    }
    for module, source in upward.items():
        found = check_source(module, source, module)
        assert any("of a higher layer" in v.what for v in found), (module, source, found)
    same_or_lower = {
        "moc.checkpoint.twolevel.engine_state": "from moc.checkpoint.api import "
                                                "CheckpointEngine\nfrom moc.checkpoint.sync "
                                                "import Checkpointer",
        "moc.checkpoint.store.storage": "from moc.checkpoint.store.backend import ObjectPath"
                                        "\nfrom moc.checkpoint.errors import CheckpointError",
        "moc.checkpoint.codec": "from moc.checkpoint.store.manifest import Entry",
        "moc.bench.simulate": "if __name__ == '__main__':\n    from moc.cli import main",
        "moc.checkpoint.twolevel.persist.protocol": "from moc.checkpoint import codec",
        "moc.checkpoint.parts": "from moc.checkpoint.modelconfig import model_config_of",
        "moc.checkpoint.export": "from moc.checkpoint.recovery import CheckpointReader",
        "moc.train.loop": "from moc.baselines import dcp\nfrom moc import Checkpointer",
        "moc.cli": "from moc.train import agent",
    }
    for module, source in same_or_lower.items():
        assert not check_source(module, source, module), (module, source)
    assert layer_of("numpy") is None
    assert layer_of("moc.checkpoint.store.storage") == layer_of("moc.checkpoint.store")


def test_every_layer_names_modules_that_exist_once():
    """A prefix of `LAYERS` that names nothing (a module renamed or removed) would
    silently stop assigning its modules; one listed twice would be ambiguous."""
    prefixes = [p for _, ps in LAYERS for p in ps]
    assert len(prefixes) == len(set(prefixes))
    modules = {module_name(path) for path in PACKAGE.rglob("*.py")}
    missing = [p for p in prefixes if not any(_inside(m, (p,)) for m in modules)]
    assert not missing, f"LAYERS lists what is no module of moc: {missing}"


def test_the_cycle_rule_flags_every_cycle_as_a_path():
    """Rule 6 can fail: a cycle is reported as the path of its imports, with their lines,
    imports inside functions and under TYPE_CHECKING count."""
    two = {"moc.checkpoint.codec": "def f():\n    from moc.checkpoint.dist import RankError",
           "moc.checkpoint.dist": "from moc.checkpoint import codec"}
    (cycle,) = check_cycles(two)
    assert cycle.what == ("import cycle: moc.checkpoint.codec (line 2) -> "
                          "moc.checkpoint.dist (line 1) -> moc.checkpoint.codec"), cycle
    three = {"moc.a": "import moc.b", "moc.b": "from moc.c import x",
             "moc.c": "from moc import a", "moc.d": "import moc.a"}
    (cycle,) = check_cycles(three)
    assert "moc.a (line 1) -> moc.b (line 1) -> moc.c (line 1) -> moc.a" in cycle.what
    figure_eight = {"moc.a": "import moc.b\nimport moc.c", "moc.b": "import moc.a",
                    "moc.c": "import moc.a"}
    assert len(check_cycles(figure_eight)) == 2
    type_only = {"moc.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                          "    from moc.b import B",
                 "moc.b": "from moc.a import A"}
    assert check_cycles(type_only)
    through_the_package = {"moc": "from moc.sync import Checkpointer",
                           "moc.sync": "from moc.topology import ParallelGroups",
                           "moc.topology": ""}
    assert not check_cycles(through_the_package)
    relative = {"moc.p": "from . import q", "moc.p.q": "import moc.p"}
    assert check_cycles(relative, packages=frozenset({"moc.p"}))


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
