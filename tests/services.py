"""pytest fixtures over kite.testing.services (registered in tests/conftest.py): ``redis_service``
(one per test), ``s3_service`` (one per module; each test takes its own bucket via
``s3_service.bucket(...)``), ``aws_env``. Tests using them are marked ``@pytest.mark.services``."""

from __future__ import annotations

import pytest

from kite.testing.services import RedisService, S3Service, fake_aws_credentials


@pytest.fixture()
def redis_service(tmp_path):
    """A redis-server of this test (appendonly on, its data under tmp_path/redis), stopped after."""
    service = RedisService(tmp_path / "redis").start()
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def s3_service():
    """One moto_server per test module (take a bucket of your own with .bucket()); stopped after.
    Credentials: use the ``aws_env`` fixture in the test."""
    with pytest.MonkeyPatch.context() as mp:
        fake_aws_credentials(mp)
        service = S3Service().start()
        try:
            yield service
        finally:
            service.stop()


@pytest.fixture()
def aws_env(monkeypatch):
    """Fake AWS credentials for boto3 in this test (moto takes any)."""
    fake_aws_credentials(monkeypatch)
