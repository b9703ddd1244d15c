from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from tests.tiny_models import CORPUS, make_tiny_model


@pytest.fixture(autouse=True, scope="session")
def no_verification_records():
    """KITE_CACHE stays shared (the converted embedded model), so states the tests write, in
    fixtures of any scope, are not recorded as verified there (tests of those records set their
    own KITE_CACHE and this variable)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KITE_VERIFY_RECORD", "0")
        yield


@pytest.fixture(autouse=True, scope="session")
def command_trees_built_once():
    """typer's test runner builds click's command tree from a Typer app on every invoke (0.2 s for
    `kite`'s, most of a CLI test's time): build each app's once. The tree holds the commands'
    functions and parameters as declared; nothing a test changes at run time is read there."""
    import typer.main
    import typer.testing

    built: dict[int, tuple] = {}

    def command_of(app):
        hit = built.get(id(app))
        if hit is None or hit[0] is not app:
            hit = built[id(app)] = (app, typer.main.get_command(app))
        return hit[1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(typer.testing, "_get_command", command_of)
        yield


@pytest.fixture()
def one_thread():
    """Torch on one intra-op thread for the test (modules of many small ops: extra threads only add
    contention, 10x slower on a busy 2-core box); restored after."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def kite_home(tmp_path, monkeypatch):
    """Every test gets its own KITE_HOME; no test reads or writes the user's ~/.kite."""
    home = tmp_path / "kite-home"
    monkeypatch.setenv("KITE_HOME", str(home))
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


@pytest.fixture()
def rule_compiles(monkeypatch) -> list[str]:
    """The source of every rule set compiled during the test, in order (every load, reload and
    check goes through `kite.yoco.rules.ruleset.parse_rules`)."""
    from kite.yoco.rules import ruleset

    seen: list[str] = []
    compile_set = ruleset.parse_rules

    def counting(data, source="<rules>", *args, **kwargs):
        seen.append(source)
        return compile_set(data, source, *args, **kwargs)

    monkeypatch.setattr(ruleset, "parse_rules", counting)
    return seen


@pytest.fixture
def capture_batches(monkeypatch) -> list[int]:
    """The documents in each prefill batch kite.upcycle.capture makes while the test runs, in order."""
    from kite.upcycle import capture as capture_mod

    batches: list[int] = []
    real = capture_mod._prefill

    def counting(lm, docs, *args):
        batches.append(len(docs))
        return real(lm, docs, *args)

    monkeypatch.setattr(capture_mod, "_prefill", counting)
    return batches


def parse_json(output: str):
    """The JSON document a `--json` command printed (ignores any lines before it)."""
    start = output.index("{") if "{" in output else output.index("[")
    return json.loads(output[start:])


@pytest.fixture(scope="session")
def tiny_contract_state(tiny_models, tmp_path_factory):
    """(lm, tagger, path): the tiny Llama, the default tagger and an exact `.upc` of the tiny
    corpus cut into paragraphs (3 clusters of 8-24-token spans), made once per session."""
    from kite.model import load_model
    from kite.upcycle import codec
    from kite.upcycle.compress import CompressSettings, compress_document
    from kite.upcycle.settings import load_upcycle_config
    from kite.upcycle import build_tagger

    lm = load_model(str(tiny_models["llama"]), device="cpu")
    tagger = build_tagger(lm, *load_upcycle_config(None))
    out = tmp_path_factory.mktemp("state") / "contract.upc"
    compress_document(lm, CORPUS.replace(". ", ".\n\n", 3), out,
                      CompressSettings(codec=codec.settings_for("exact"), n_clusters=3, min_span_tokens=8,
                                       max_span_tokens=24), tagger=tagger)
    return lm, tagger, out


def pytest_addoption(parser):
    parser.addoption("--record-golden", action="store_true", default=False,
                     help="write tests/data/golden/ (the reference of tests/test_golden_state.py) instead of checking it")


# Real Redis and S3-compatible (moto) servers for @pytest.mark.services tests (tests/services.py).
from tests.services import aws_env, redis_service, s3_service  # noqa: E402,F401


# -- running in parallel (pytest-xdist; `make test` runs `-n 2`) -----------------------------------
# Each test file runs whole on one worker (its module fixtures built once), except that the files
# whose tests start a Ray cluster or the Redis / S3 servers (marked ray / services) run on one worker,
# one after another: two local Ray heads or Serve instances on one machine compete for ports and
# CPUs. (xdist's own --dist loadgroup does not group under pytest 9: its node-id suffix is lost.) A
# worker's torch gets its share of the cores (threads beyond them spin against each other), and its
# child processes the same through OMP_NUM_THREADS.

_CLUSTER_MARKS = ("pytest.mark.ray", "pytest.mark.services")


@functools.cache
def _starts_a_cluster(path: str) -> bool:
    """Whether the test file at `path` (from the repository's root) marks tests ray or services."""
    try:
        text = (Path(__file__).resolve().parents[1] / path).read_text()
    except OSError:
        return False
    return any(m in text for m in _CLUSTER_MARKS)


@pytest.hookimpl(optionalhook=True)    # a plain `pytest` without xdist: no such hook
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "cluster" if _starts_a_cluster(path) else path

    return ByFile(config, log)


def pytest_configure(config):
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        # xdist hands its workers the controller's terminal size as COLUMNS / LINES, which KITE's
        # commands read as a width asked for; a test process of its own has none
        for var in ("COLUMNS", "LINES"):
            os.environ.pop(var, None)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        share = max(1, (os.cpu_count() or 1) // workers)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, str(share))
        import torch

        torch.set_num_threads(share)
