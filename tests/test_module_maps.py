"""The module maps in the packages' docstrings are complete: every module and subpackage
of moc.checkpoint is named in its package's map (issue 31: the maps had missed ten
modules). docs/ builds its code layout page from the same sources (docs/hooks)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "moc" / "checkpoint"
MAPPED = [PACKAGE, *(p.parent for p in sorted(PACKAGE.rglob("*/__init__.py")))]


def unmapped(package: Path) -> list[str]:
    """The modules and subpackages of `package` its docstring's map does not name."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", doc))
    children = [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
    children += [p.name for p in package.iterdir()
                 if p.is_dir() and (p / "__init__.py").is_file()]
    return sorted(c for c in children if c not in named)


@pytest.mark.parametrize("package", MAPPED,
                         ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_every_module_is_in_its_package_map(package):
    missing = unmapped(package)
    assert not missing, (f"{package.relative_to(PACKAGE.parents[1])}/__init__.py does not "
                         f"name {', '.join(missing)} in its module map")


def test_the_check_can_fail(tmp_path):
    (tmp_path / "__init__.py").write_text('"""Map:\n\n    a   the first\n"""\n')
    (tmp_path / "a.py").write_text("")
    (tmp_path / "b.py").write_text("")
    assert unmapped(tmp_path) == ["b"]
