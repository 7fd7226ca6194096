"""The ``s3`` KV storage backend: entries as objects in one bucket under a prefix.

Settings (``--hicache-storage-backend-extra-config``), the batch storage's ``s3`` names:
``bucket`` (required), ``prefix`` (default ``llmkit/kv/``), ``endpoint_url`` (MinIO, moto,
R2, ...), ``region``, and ``timeout`` (seconds a connect or read may take, default 5: a slow
endpoint costs a request at most ``--hicache-prefetch-timeout``, never the engine step).
Credentials come from boto3's usual chain. A PUT is atomic in S3, so an entry is never torn.
Needs ``pip install 'llmkit[s3]'``. Expire old entries with a bucket lifecycle rule.
"""

from __future__ import annotations

from llmkit.core.kvcache.kv_storage import KVStorage

_MISSING = ("NoSuchKey", "404", "NotFound")


class S3KVStorage(KVStorage):
    def __init__(
        self,
        *,
        path: str | None = None,
        bucket: str = "",
        prefix: str = "llmkit/kv/",
        endpoint_url: str | None = None,
        region: str | None = None,
        timeout: float = 5.0,
    ) -> None:
        try:
            import boto3
            from botocore.config import Config
            from botocore.exceptions import ClientError
        except ImportError as exc:
            raise ValueError("the s3 KV storage needs boto3: pip install 'llmkit[s3]'") from exc
        if not bucket:
            raise ValueError(
                'the s3 KV storage needs a bucket: --hicache-storage-backend-extra-config \'{"bucket": "B"}\''
            )
        self.bucket = bucket
        self.prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        self._client_error = ClientError
        config = Config(connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": 2})
        # (boto3 clients are thread-safe: the tier's reader and writer share this one)
        self._s3 = boto3.client("s3", endpoint_url=endpoint_url or None, region_name=region or None, config=config)

    def _missing(self, exc) -> bool:
        return exc.response.get("Error", {}).get("Code") in _MISSING

    def get(self, key: str) -> bytes | None:
        try:
            return self._s3.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()
        except self._client_error as exc:
            if self._missing(exc):
                return None
            raise

    def put(self, key: str, data: bytes) -> None:
        self._s3.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def exists(self, key: str) -> bool:
        try:
            self._s3.head_object(Bucket=self.bucket, Key=self.prefix + key)
            return True
        except self._client_error as exc:
            if self._missing(exc):
                return False
            raise
