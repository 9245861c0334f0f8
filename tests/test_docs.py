"""The documentation: the site builds with no warning, and the README stays a front page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_MAX_LINES = 200

# [text](target): the target up to a space (a title) or the closing parenthesis.
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def test_the_site_builds_with_no_warning(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, a page missing from the nav's
    files, a docstring mkdocstrings cannot render or a failing hook fails the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "reference" / "layout" / "index.html").is_file()


def test_the_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move the detail "
        "into a page of docs/ and link to it")


def test_every_relative_link_of_the_readme_exists():
    targets = _LINK.findall(README.read_text())
    assert targets, "no links found: has the README's link syntax changed?"
    missing = []
    for target in targets:
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor of the README itself
        path = target.split("#", 1)[0]
        if not (REPO / path).exists():
            missing.append(target)
    assert not missing, f"README.md links to files that do not exist: {missing}"
