"""Where KITE keeps things: `KITE_HOME` (default ~/.kite) and `KITE_CACHE` (default ~/.cache/kite)."""

from __future__ import annotations

import os
from pathlib import Path


def kite_home() -> Path:
    """The user's KITE folder: config, health store, results."""
    return Path(os.environ.get("KITE_HOME") or Path.home() / ".kite").expanduser()


def config_path() -> Path:
    """The config file: `$KITE_HOME/config.yaml`."""
    return kite_home() / "config.yaml"


def cache_dir() -> Path:
    """Rebuildable caches (converted GGUF models, fingerprints): `KITE_CACHE`."""
    return Path(os.environ.get("KITE_CACHE") or Path.home() / ".cache" / "kite").expanduser()


def repo_root() -> Path | None:
    """The source checkout this package runs from, if it runs from one (editable install)."""
    here = Path(__file__).resolve().parent.parent
    return here if (here / "pyproject.toml").exists() else None
