"""The documentation: the site builds with no warning, the README stays a front page, and
its example runs as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_MAX_LINES = 200

# The README's loop, run as written: `model`, `optimizer`, `batch`, `sampler`, `steps` and
# `log` are the names it leaves to the reader, bound here to moc's own small MoE.
_RUN_README_LOOP = """
import json, sys
import torch
from moc.model import ModelConfig, Transformer

text = open(sys.argv[1]).read()
start = text.index("```python\\n", text.index("\\n## A training loop\\n")) + len("```python\\n")
code = text[start:text.index("```", start)]
code = "\\n" * text[:start].count("\\n") + code  # a traceback names the README's own line

class LM(Transformer):  # model(batch): the batch is (inputs, targets)
    def forward(self, batch):
        return super().forward(*batch)

torch.manual_seed(0)
cfg = ModelConfig(vocab_size=64, seq_len=16, d_model=16, n_layers=2, n_heads=2, d_ffn=32,
                  n_experts=4)
model = LM(cfg)
tokens = torch.randint(64, (4, 17))

class Sampler:
    def state_dict(self):
        return {"position": 7}

logged = []
names = dict(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
             batch=(tokens[:, :-1], tokens[:, 1:]), sampler=Sampler(),
             steps=int(sys.argv[2]), log=logged.append)
exec(compile(code, "README.md", "exec"), names)
report = names["report"]
print(json.dumps({"resumed": report.step if report else None,
                  "extra": report.extra if report else None,
                  "saved": sorted(r.step for r in logged + names["results"] if r.ok)}))
"""

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


@pytest.mark.integration  # the two-level engine starts its persist process
def test_the_readme_loop_runs_and_resumes_as_written(tmp_path):
    """The README's example is today's API: a fresh run saves, a second run resumes from
    its last step with the loop state it saved."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run(steps: int) -> dict:
        done = subprocess.run([sys.executable, "-c", _RUN_README_LOOP, str(README), str(steps)],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-5000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = run(12)
    assert first["resumed"] is None and first["saved"] == [10, 12]  # interval 10, final 12
    second = run(24)
    assert second["resumed"] == 12 and second["extra"] == {"data": {"position": 7}}
    assert second["saved"] == [20, 24]


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


# ------------------------------------------------------------------------- transcripts

TRANSCRIPT = re.compile(r"<!-- transcript: (?P<command>[^>]+?) -->\n+```[a-z]*\n"
                        r"(?P<lines>.*?)```", re.S)
"""A block the docs quote from a command's output, marked by the comment before it:

    <!-- transcript: moc demo -->
    ```
    moc train: rank 1: injecting a fault at step 130 ...
    ```
"""


def transcripts() -> dict[str, list[tuple[str, str]]]:
    """{command: [(page, quoted line), ...]} of every marked block under docs/ and in
    the README."""
    found: dict[str, list[tuple[str, str]]] = {}
    for page in [README, *sorted((REPO / "docs").rglob("*.md"))]:
        for m in TRANSCRIPT.finditer(page.read_text()):
            found.setdefault(m["command"], []).extend(
                (str(page.relative_to(REPO)), line)
                for line in m["lines"].splitlines() if line.strip())
    return found


def quoted(line: str) -> re.Pattern[str]:
    """The lines of output a quoted line stands for: its words as written, any number
    (a pid, a time, a step, a loss) where it has one, and anything where it has `...`
    (a path, a shortened line)."""
    pattern = ""
    for piece in re.split(r"(\.\.\.|\d+(?:\.\d+)?)", line.strip()):
        if piece == "...":
            pattern += ".*?"
        elif re.fullmatch(r"\d+(?:\.\d+)?", piece):
            pattern += r"\d+(?:\.\d+)?"
        else:
            pattern += re.escape(piece)
    return re.compile(pattern)


def missing_lines(quotes: list[tuple[str, str]], output: str) -> list[str]:
    lines = [line.strip() for line in output.splitlines()]
    return [f"{page}: {line}" for page, line in quotes
            if not any(quoted(line).fullmatch(out) for out in lines)]


def test_a_quoted_line_stands_for_its_words_not_its_numbers():
    pattern = quoted("resumed from checkpoint step 125 (memory, 0.02s, ...)")
    assert pattern.fullmatch("resumed from checkpoint step 75 (memory, 1.5s, 0 lost)")
    assert not pattern.fullmatch("resumed from step 75 (memory, 1.5s, 0 lost)")
    assert missing_lines([("p.md", "rank 1: died")], "x\n  rank 1: died\n") == []
    assert missing_lines([("p.md", "rank 1: died")], "rank 1: died (SIGKILL)") == \
        ["p.md: rank 1: died"]


@pytest.mark.integration  # the demo: 2 ranks, 200 steps, a SIGKILL
def test_the_docs_quote_what_the_demo_prints(tmp_path):
    """Issue 50: getting-started quoted a fault transcript two releases old (torchrun's
    restart of both ranks) while the demo had long replaced the lost rank in-job. Every
    line of a block marked `<!-- transcript: moc demo -->` must be a line the demo
    prints today; the same lines with one word changed must not be (the check can
    fail)."""
    quotes = transcripts().get("moc demo")
    assert quotes and len(quotes) >= 5, "the marked demo transcripts are gone"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "moc", "demo"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert missing_lines(quotes, output) == [], output[-8000:]
    changed = [(page, re.sub(r"[a-z]{4,}", lambda w: w[0][::-1], line, count=1))
               for page, line in quotes]
    assert len(missing_lines(changed, output)) == len(changed)
