"""Fixtures for tests/lake: the S3 server (tests/s3_server.py) for the object-store warehouse."""

from tests.s3_server import moto_endpoint, s3_server  # noqa: F401
