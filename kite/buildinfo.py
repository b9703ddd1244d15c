"""What `kite version` reports, gathered without importing torch or transformers."""

from __future__ import annotations

import datetime as dt
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from kite import __version__
from kite.paths import config_path, repo_root


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _git(*args: str) -> str | None:
    root = repo_root()
    if root is None or not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                             timeout=2, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _build_date() -> str:
    date = _git("log", "-1", "--format=%cI")
    if date:
        return date
    try:
        dist = metadata.distribution("kite")
        files = dist.files or []
        mtime = Path(dist.locate_file(files[0])).stat().st_mtime if files else None
    except (metadata.PackageNotFoundError, OSError, IndexError):
        mtime = None
    return dt.datetime.fromtimestamp(mtime, dt.timezone.utc).isoformat() if mtime else "unknown"


def device_name() -> str:
    """The first CUDA device's name from NVML, or 'cpu'. NVML is a C library: no torch import."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() == 0:
                return "cpu"
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
            return f"cuda:0 ({name.decode() if isinstance(name, bytes) else name})"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library: a CPU machine
        return "cpu"


def build_info() -> dict[str, str]:
    from kite.kernels.locate import runtime_status

    return {
        "version": __version__,
        "build_date": _build_date(),
        "git_commit": _git("rev-parse", "--short=12", "HEAD") or "unknown",
        "python": platform.python_version(),
        "torch": _dist_version("torch"),
        "transformers": _dist_version("transformers"),
        "device": device_name(),
        "native_runtime": runtime_status(),
        "config_path": str(config_path()),
    }
