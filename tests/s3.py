"""A real S3 API server for tests: moto in server mode, a subprocess on 127.0.0.1.

    def test_x(s3_url):             # "s3://<fresh bucket>/run", env pointing at the server
        Checkpointer(model, opt, s3_url)

The server is one per test session (it starts in about a second); every test gets a
bucket of its own. The endpoint and credentials are set in the environment the standard
way (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION), so
that processes the test starts (ranks, the persist process, `moc train`) reach the
server exactly as a user's job would reach theirs.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator

import pytest

from moc.bench.persist import start_moto as moc_start_moto


def s3_env(endpoint: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def start_moto() -> tuple[subprocess.Popen, str]:
    """Start a moto S3 server on 127.0.0.1 (the benchmark's own starter); (process,
    endpoint URL) once it answers."""
    pytest.importorskip("moto.server", reason="the object storage tests need moto[server]")
    return moc_start_moto()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    proc, endpoint = start_moto()
    try:
        yield endpoint
    finally:
        proc.kill()
        proc.wait()


def make_bucket(name: str) -> None:
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(name)


@pytest.fixture
def s3_url(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """s3://<a new bucket>/run on the session's server, the environment set for it."""
    for k, v in s3_env(s3_endpoint).items():
        monkeypatch.setenv(k, v)
    bucket = f"moc-{secrets.token_hex(6)}"
    make_bucket(bucket)
    assert os.environ["AWS_ENDPOINT_URL"] == s3_endpoint
    return f"s3://{bucket}/run"
