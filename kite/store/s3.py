"""S3-compatible object storage: the shared, large tier (boto3). One object per state,
``<prefix>/<id>.upc`` in a bucket that exists already. Credentials come from boto3's usual chain
(environment, ~/.aws); ``endpoint_url`` points at any S3-compatible server (MinIO, moto, Ceph)."""

from __future__ import annotations

import copy

from kite.errors import BadInput
from kite.store.tier import ObjectStat, Tier, TierError, TierURL, register_tier


@register_tier
class S3Tier(Tier):
    """``s3://bucket/prefix?endpoint_url=http://127.0.0.1:9000&region=us-east-1&max=1TB``."""

    scheme = "s3"
    params = ("endpoint_url", "region", "timeout")

    def __init__(self, bucket: str, prefix: str = "", name: str = "s3", write: str = "through",
                 max_bytes: int | None = None, endpoint_url: str | None = None, region: str = "us-east-1",
                 timeout_s: float = 10.0):
        super().__init__(name, write, max_bytes)
        try:
            import boto3
            from botocore.config import Config
            from botocore.exceptions import BotoCoreError, ClientError
        except ImportError:
            raise BadInput("s3:// store tiers need boto3: pip install 'kite[store]'") from None
        self._errors = (BotoCoreError, ClientError)
        self._client_error = ClientError
        self.bucket, self.prefix, self.endpoint_url = bucket, prefix.strip("/"), endpoint_url
        cfg = Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 2, "mode": "standard"})
        self.client = boto3.client("s3", endpoint_url=endpoint_url, region_name=region, config=cfg)

    @classmethod
    def from_url(cls, name: str, url: TierURL, write: str, max_bytes: int | None) -> "S3Tier":
        if not url.netloc:
            raise BadInput(f"store URL {url.text!r}: s3:// needs a bucket (s3://bucket/prefix)")
        p = url.params
        try:
            timeout = float(p.get("timeout", "10"))
        except ValueError:
            raise BadInput(f"store URL {url.text!r}: timeout={p['timeout']!r} is not a number of seconds") from None
        return cls(url.netloc, url.path, name, write, max_bytes, p.get("endpoint_url"), p.get("region", "us-east-1"),
                   timeout)

    def _key(self, state_id: str) -> str:
        return f"{self.prefix}/{state_id}.upc" if self.prefix else f"{state_id}.upc"

    def _missing(self, exc) -> bool:
        code = exc.response.get("Error", {}).get("Code", "") if isinstance(exc, self._client_error) else ""
        return code in ("NoSuchKey", "404", "NotFound")

    def _fail(self, op: str, exc) -> TierError:
        return TierError(self.name, op, f"{type(exc).__name__}: {str(exc)[:160]}")

    def get(self, state_id: str) -> bytes | None:
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(state_id))
            return obj["Body"].read()
        except self._errors as exc:
            if self._missing(exc):
                return None
            raise self._fail("get", exc) from None

    def put(self, state_id: str, data: bytes) -> bool:
        if self.max_bytes is not None and len(data) > self.max_bytes:
            return False
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(state_id), Body=bytes(data))
        except self._errors as exc:
            raise self._fail("put", exc) from None
        if self.max_bytes is not None:
            self.evict()
        return True

    def delete(self, state_id: str) -> bool:
        held = self.stat(state_id) is not None
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(state_id))
        except self._errors as exc:
            raise self._fail("delete", exc) from None
        return held

    def _objects(self) -> list[dict]:
        start = f"{self.prefix}/" if self.prefix else ""
        out = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
                out.extend(page.get("Contents", []))
        except self._errors as exc:
            raise self._fail("list", exc) from None
        return [o for o in out if o["Key"].endswith(".upc") and "/" not in o["Key"][len(start):]]

    def ids(self) -> list[str]:
        start = len(f"{self.prefix}/" if self.prefix else "")
        return sorted(o["Key"][start:-4] for o in self._objects())

    def stat(self, state_id: str) -> ObjectStat | None:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(state_id))
        except self._errors as exc:
            if self._missing(exc):
                return None
            raise self._fail("stat", exc) from None
        return ObjectStat(state_id, int(head["ContentLength"]), head["LastModified"].timestamp())

    def tenant_part(self, tag: str) -> "S3Tier":
        """The tenant's objects under ``<prefix>/tenants/<tag>/`` of the same bucket, on the same client."""
        part = copy.copy(self)
        part.prefix = f"{self.prefix}/tenants/{tag}" if self.prefix else f"tenants/{tag}"
        part.tenant = tag
        return part

    def usage(self) -> tuple[int, int]:
        objs = self._objects()
        return len(objs), sum(int(o["Size"]) for o in objs)

    def describe(self) -> str:
        where = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        return where + (f"?endpoint_url={self.endpoint_url}" if self.endpoint_url else "")
