"""What moc needs of torch. Importing this module refuses a torch older than MIN_TORCH in
one line, saying what was found and what is needed; `moc/__init__.py` imports it before
anything else, so that the line comes before an ImportError from deep inside moc.

pyproject.toml declares the same minimum (tests/test_compat.py keeps the two equal), and
`make test-compat` (scripts/test_compat.sh) runs `moc train` and the tests that lean on
torch hardest on exactly that release. What sets it (issue 39, each release tried in a
venv of its own): torch 2.7 lacks the DTensor layout function moc's pieces are computed
with (`torch.distributed.tensor._utils._compute_local_shape_and_global_offset`, used by
moc.checkpoint.shards), so moc cannot even be imported there; on 2.8 `moc train`, both
engines and the unit tests pass. Two things of newer releases are used where they exist and
said where they do not:

- torchrun's `--shutdown-timeout` (torch 2.12): moc.cli passes it only where torchrun
  has it, and says in one line when torchrun's fixed 30 s cuts `--grace-s` short;
- DCP's `DefaultStager` (torch 2.9), which the `dcp-async` baseline needs: `moc train`
  refuses that mode without it, and its tests are skipped.
"""

from __future__ import annotations

import importlib
import re

import torch

MIN_TORCH = (2, 8)
"""The oldest torch release (major, minor) moc supports: the one `make test-compat`
installs and passes on."""


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.8.0+cu128" is (2, 8), and so is a
    pre-release or a source build of 2.8 ("2.8.0a0+git1234")."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(found[1]), int(found[2])


def check_torch(version: str = torch.__version__) -> None:
    """ImportError, in one line, when `version` is older than MIN_TORCH."""
    if torch_release(version) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(f"moc needs torch {need} or newer, found torch {version} (in "
                          f"{torch.__path__[0]}); upgrade it: pip install 'torch>={need}'")


def torch_has(module: str, name: str) -> bool:
    """Whether this torch's `module` defines `name`: a feature asked of torch itself, not
    read off its version (a backport or another branch's build answers for itself)."""
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def has_dcp_async_staging() -> bool:
    """Whether this torch has DCP's `DefaultStager` (torch 2.9+), which `--ckpt-mode
    dcp-async` needs. Imports DCP's staging module: asked only when that mode is chosen
    (a moc run loads nothing of DCP)."""
    return torch_has("torch.distributed.checkpoint.staging", "DefaultStager")

check_torch()
