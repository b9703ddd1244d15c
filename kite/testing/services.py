"""Real services for tests and benchmarks that need them, on free 127.0.0.1 ports, stopped at the end.

    RedisService   Debian's redis-server with a temp dir, appendonly on (restart keeps the data):
                   .url, .stop(), .start() (same port and dir), .kill() (SIGKILL, no final save)
    S3Service      moto's server mode (`moto_server`) as an S3-compatible endpoint: .endpoint,
                   .bucket(name) creates a bucket, .stop()

A missing redis-server or moto_server is an error that names it (ServiceMissing; make install
installs both), never a skip. The test fixtures over them are in tests/services.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from kite.ports import free_port


class ServiceMissing(RuntimeError):
    """The program a service runs is not installed."""


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen | None, sig=signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class RedisService:
    def __init__(self, folder: Path):
        exe = shutil.which("redis-server")
        if exe is None:
            raise ServiceMissing("redis-server is not installed (make install installs it: apt-get install redis-server)")
        self.exe, self.folder, self.port = exe, Path(folder), free_port()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisService":
        args = [self.exe, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.folder),
                "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "yes",
                "--daemonize", "no", "--logfile", str(self.folder / "redis.log")]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, self.proc, "redis-server")
        return self

    def stop(self) -> None:
        """A clean shutdown (SIGTERM: redis writes its append-only file and exits)."""
        _stop(self.proc)

    def kill(self) -> None:
        """SIGKILL: what a crash leaves (appendfsync always: every acknowledged write is on disk)."""
        _stop(self.proc, signal.SIGKILL)


class S3Service:
    def __init__(self):
        # this interpreter's own (the venv's), before any other on PATH (a pyenv shim may lack moto)
        exe = str(Path(sys.executable).parent / "moto_server")
        if not os.path.exists(exe):
            exe = shutil.which("moto_server") or exe
        if not os.path.exists(exe):
            raise ServiceMissing("moto_server is not installed (pip install 'moto[server]'; make install does)")
        self.exe, self.port, self.proc = exe, free_port(), None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "S3Service":
        self.proc = subprocess.Popen([self.exe, "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, self.proc, "moto_server")
        return self

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def bucket(self, name: str | None = None) -> str:
        """A new, empty bucket (a fresh name unless given)."""
        name = name or f"kite-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        _stop(self.proc)


def fake_aws_credentials(monkeypatch) -> None:
    """moto takes any credentials; boto3 needs some (never the user's real ones in a test)."""
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
