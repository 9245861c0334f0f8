"""The real S3 API server of tests/s3.py, for the object storage tests here."""

from tests.s3 import s3_endpoint, s3_url  # noqa: F401  (fixtures)
