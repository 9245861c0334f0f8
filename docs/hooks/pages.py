"""Pages of the documentation site that are built from the repository, so they cannot drift.

An mkdocs hook (mkdocs.yml, `hooks:`):

    index.md                 the site's home page: README.md, its `docs/...` links made
                             relative to the docs directory
    guarantees.md            `<!-- moc:readme-guarantees -->` becomes README.md's
                             "Guarantees" section (the README is where it is kept)
    reference/layout.md      `<!-- moc:module-map -->` becomes a list of every module of
                             moc/ with the first sentence of its docstring, read with `ast`

`python docs/hooks/pages.py` prints the module map without building the site.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "moc"
README = ROOT / "README.md"

MODULE_MAP = "<!-- moc:module-map -->"
GUARANTEES = "<!-- moc:readme-guarantees -->"

# A sentence ends at a full stop followed by a space or the end, but not after these.
_ABBREVIATIONS = ("e.g.", "i.e.", "vs.", "sec.", "etc.", "cf.")


def first_sentence(docstring: str | None) -> str:
    """The first sentence of a docstring's first paragraph, on one line."""
    if not docstring:
        return ""
    lines: list[str] = []
    for line in docstring.strip().splitlines():
        if not line.strip() or line.startswith("    "):  # a blank line or a code block
            break
        lines.append(line.strip())
    text = " ".join(lines)
    for match in re.finditer(r"\.(?=\s|$)", text):
        end = match.end()
        if not text[:end].endswith(_ABBREVIATIONS):
            return text[:end]
    return text


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_map() -> str:
    """Markdown: one section per package of moc/, one table row per module."""
    packages = sorted(p.parent for p in PACKAGE.rglob("__init__.py"))
    out: list[str] = []
    for package in packages:
        init = package / "__init__.py"
        name = module_name(init)
        out += [f"## `{name}`", "", _cell(_summary(init)), ""]
        modules = sorted(p for p in package.glob("*.py") if p.name != "__init__.py")
        subpackages = sorted(p for p in packages if p.parent == package)
        if not modules and not subpackages:
            continue
        out += ["| module | what it is |", "| --- | --- |"]
        out += [f"| `{p.stem}` | {_cell(_summary(p))} |" for p in modules]
        out += [f"| `{p.name}/` | {_cell(_summary(p / '__init__.py'))} |" for p in subpackages]
        out.append("")
    return "\n".join(out)


def _summary(path: Path) -> str:
    docstring = ast.get_docstring(ast.parse(path.read_text(), str(path)))
    return first_sentence(docstring) or "(no docstring)"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def readme_for_site(text: str) -> str:
    """README.md as a page of docs/: its links into docs/ made relative to docs/."""
    return re.sub(r"\]\(docs/", "](", text)


def readme_section(text: str, title: str) -> str:
    """The body of README.md's `## {title}` section (without its heading)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if match is None:
        raise ValueError(f"README.md has no '## {title}' section")
    return match.group(1).strip()


# -- mkdocs hook events ----------------------------------------------------------------------


def on_files(files, config):
    from mkdocs.structure.files import File

    if files.get_file_from_path("index.md") is None:
        files.append(File.generated(config, "index.md",
                                    content=readme_for_site(README.read_text())))
    return files


def on_page_markdown(markdown, page, config, files):
    if MODULE_MAP in markdown:
        markdown = markdown.replace(MODULE_MAP, module_map())
    if GUARANTEES in markdown:
        section = readme_section(README.read_text(), "Guarantees")
        markdown = markdown.replace(GUARANTEES, readme_for_site(section))
    return markdown


def on_serve(server, config, builder):
    server.watch(str(README))
    server.watch(str(PACKAGE))
    return server


if __name__ == "__main__":
    print(module_map())
