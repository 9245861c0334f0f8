"""Fixtures of the training tests: the real S3 API server of tests/s3.py, and the runs
without faults that the in-job recovery tests compare against."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.s3 import s3_endpoint, s3_url  # noqa: F401  (fixtures)


class References:
    """The run without faults of each layout in `injob_runs.LAYOUTS`, made the first
    time a test asks for it and shared by every test of the session after: test_injob
    and test_injob_faults each made their own of the same layout."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[str, dict[int, float]] = {}

    def __getitem__(self, layout: str) -> dict[int, float]:
        from tests.train.injob_runs import LAYOUTS, last_losses, train

        if layout not in self.runs:
            root = self.root / layout
            root.mkdir()
            train(root, *LAYOUTS[layout])
            self.runs[layout] = last_losses(root)
        return self.runs[layout]


@pytest.fixture(scope="session")
def injob_reference(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(tmp_path_factory.mktemp("injob-reference"))
