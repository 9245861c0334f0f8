"""The package's shape in numbers (issue 31): the biggest classes and functions by line
count, `isinstance(..., ObjectPath)` outside the store layer, and moc modules by size.

    python scripts/structure.py [--top 10]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moc"


def definitions(top: int) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    classes, functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(ast.parse(path.read_text())):
            n = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.ClassDef):
                classes.append((n, f"{where}:{node.lineno} {node.name}"))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((n, f"{where}:{node.lineno} {node.name}"))
    return sorted(classes, reverse=True)[:top], sorted(functions, reverse=True)[:top]


def object_path_checks() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE.parent)
        if where.parts[:3] == ("moc", "checkpoint", "store"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance"
                    and "ObjectPath" in ast.unparse(node.args[1])):
                out.append(f"{where}:{node.lineno}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10, help="how many of each to list")
    args = parser.parse_args()
    classes, functions = definitions(args.top)
    print(f"{args.top} biggest classes:")
    for n, what in classes:
        print(f"  {n:4d}  {what}")
    print(f"{args.top} biggest functions:")
    for n, what in functions:
        print(f"  {n:4d}  {what}")
    checks = object_path_checks()
    print(f"isinstance(..., ObjectPath) outside moc/checkpoint/store: {len(checks)}")
    for where in checks:
        print(f"  {where}")


if __name__ == "__main__":
    main()
