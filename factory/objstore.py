"""Reaching an object store from Factory's settings: which URIs name one (`s3://`, `s3a://`, `gs://`), the pyarrow
filesystem for such a URI, and the same S3 settings as pyiceberg FileIO properties.

S3 (and S3-compatible stores: MinIO, Ceph, R2) is configured by the standard AWS variables, mapped here onto both
pyarrow's S3FileSystem and pyiceberg's `s3.*` properties so that the lake and the checkpoint store reach the same
endpoint with the same keys: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_REGION or AWS_DEFAULT_REGION. Unset keys fall through to the AWS SDK's own chain (instance
profile, ~/.aws). GCS uses Google's default credentials (pyarrow's GcsFileSystem). Tested against moto's S3 server
on 127.0.0.1; real AWS S3 and GCS are not exercised by the tests.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import pyarrow.fs as pafs

S3_SCHEMES = frozenset({"s3", "s3a"})
GCS_SCHEMES = frozenset({"gs"})
REMOTE_SCHEMES = S3_SCHEMES | GCS_SCHEMES
# An S3-compatible server ignores the region but the SDK needs one; asking AWS to resolve a bucket's region
# would go to the internet, which a private endpoint's network may not reach.
_DEFAULT_ENDPOINT_REGION = "us-east-1"


def is_remote(uri: str | os.PathLike[str]) -> bool:
    """Whether `uri` names an object-store location (s3://, s3a://, gs://) rather than a local path."""
    return isinstance(uri, str) and urlsplit(uri).scheme in REMOTE_SCHEMES


def check_uri(uri: str, setting: str) -> str:
    """`uri` without a trailing slash, if it is `s3://bucket[/prefix]` or `gs://bucket[/prefix]`; else a ValueError
    naming `setting` and what was expected."""
    parts = urlsplit(uri)
    if parts.scheme not in REMOTE_SCHEMES or not parts.netloc:
        raise ValueError(f"{setting}={uri!r}: expected an object-store URI s3://<bucket>[/<prefix>] or "
                         f"gs://<bucket>[/<prefix>]")
    if parts.query or parts.fragment:
        raise ValueError(f"{setting}={uri!r}: expected no ?query or #fragment (the S3 endpoint and keys come from "
                         "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)")
    return uri.rstrip("/")


def s3_settings() -> dict[str, str]:
    """The S3 settings in the environment: endpoint, access_key, secret_key, session_token, region (those set)."""
    env = os.environ
    found = {
        "endpoint": env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"),
        "access_key": env.get("AWS_ACCESS_KEY_ID"),
        "secret_key": env.get("AWS_SECRET_ACCESS_KEY"),
        "session_token": env.get("AWS_SESSION_TOKEN"),
        "region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
    }
    if found["endpoint"] and not found["region"]:
        found["region"] = _DEFAULT_ENDPOINT_REGION
    return {k: v for k, v in found.items() if v}


def iceberg_io_properties() -> dict[str, str]:
    """pyiceberg catalog properties for the lake's files: pyarrow's FileIO (native S3/GCS, no s3fs), and the S3
    settings from the environment under pyiceberg 0.12's names (pyiceberg.io: s3.endpoint, s3.access-key-id, ...)."""
    names = {"endpoint": "s3.endpoint", "access_key": "s3.access-key-id", "secret_key": "s3.secret-access-key",
             "session_token": "s3.session-token", "region": "s3.region"}
    props = {"py-io-impl": "pyiceberg.io.pyarrow.PyArrowFileIO"}
    props.update({names[k]: v for k, v in s3_settings().items()})
    return props


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem for an object-store URI and the path inside it (`bucket/key`, no trailing slash).
    S3 is built from `s3_settings()` rather than `FileSystem.from_uri`, which would take the endpoint only from
    the URI's query string."""
    parts = urlsplit(uri)
    path = f"{parts.netloc}{parts.path}".rstrip("/")
    if parts.scheme in S3_SCHEMES:
        s = s3_settings()
        return pafs.S3FileSystem(endpoint_override=s.get("endpoint"), access_key=s.get("access_key"),
                                 secret_key=s.get("secret_key"), session_token=s.get("session_token"),
                                 region=s.get("region")), path
    if parts.scheme in GCS_SCHEMES:
        fs, _ = pafs.FileSystem.from_uri(uri)
        return fs, path
    raise ValueError(f"not an object-store URI: {uri!r} (expected s3:// or gs://)")
