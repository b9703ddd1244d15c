from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_model


@pytest.fixture(autouse=True)
def kite_home(tmp_path, monkeypatch):
    """Every test gets its own KITE_HOME; no test reads or writes the user's ~/.kite. KITE_CACHE
    stays shared (the converted embedded model), so states the tests write are not recorded as
    verified there (tests of those records set their own KITE_CACHE)."""
    home = tmp_path / "kite-home"
    monkeypatch.setenv("KITE_HOME", str(home))
    monkeypatch.setenv("KITE_VERIFY_RECORD", "0")
    for var in ("KITE_DEBUG",):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Llama, Qwen2 and Mistral HF folders (made once per session)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch) for arch in ("llama", "qwen2", "mistral")}


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M, loaded once (fp32, CPU)."""
    from kite.model import load_cached

    return load_cached("smollm2-135m")


def parse_json(output: str):
    """The JSON document a `--json` command printed (ignores any lines before it)."""
    start = output.index("{") if "{" in output else output.index("[")
    return json.loads(output[start:])
