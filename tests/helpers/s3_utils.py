"""A real S3-compatible endpoint on loopback for tests: moto's standalone server (no boto3 mocks)."""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from typing import Iterator

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def moto_endpoint() -> Iterator[str]:
    """Start moto's server on a free loopback port; yield its URL; stop it afterwards.

    The fake credentials are put in ``os.environ`` (and restored), so boto3 clients in this
    process and in server subprocesses started from it can sign requests.
    """
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in FAKE_CREDENTIALS}
    os.environ.update(FAKE_CREDENTIALS)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_bucket(endpoint_url: str, bucket: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1").create_bucket(Bucket=bucket)
