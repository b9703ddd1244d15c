"""kite serve with a shared store: two servers, each with its own state folder, one file:// +
mem:// store between them. A state made through server A answers on server B with no
recompression; the store's counters reach /metrics; a corrupt copy is never loaded."""

from __future__ import annotations

import httpx
import pytest

from kite.serve import BackgroundServer, create_app
from tests.test_serve import DOC, _pipeline, _settings
from tests.tiny_models import load_tiny_llama


@pytest.fixture(scope="module")
def lm(tiny_models):
    return load_tiny_llama(tiny_models)


def _server(lm, root, store_url):
    from kite.yoco.health import HealthStore

    settings = _settings(root, fusion=True, store_url=store_url)
    app = create_app(_pipeline(lm), settings, health=HealthStore(root / "health.sqlite"), start_sampler=False)
    server = BackgroundServer(app)
    server.start()
    return server, app, httpx.Client(base_url=server.url, timeout=60)


def _metric(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))   # the exposition sorts labels
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} " if labels else f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_state_made_on_one_server_answers_on_another_without_recompression(lm, tmp_path):
    store = f"mem://?max=64MB,file://{tmp_path}/shared"
    a, app_a, ca = _server(lm, tmp_path / "a", store)
    b, app_b, cb = _server(lm, tmp_path / "b", store)
    try:
        up = ca.post("/v1/states", json={"document": DOC})
        assert up.status_code == 201, up.text
        sid = up.json()["id"]
        assert sid == app_a.state.kite.runner.pipeline.address_of(DOC).id   # its content address
        assert (tmp_path / "shared" / f"{sid}.upc").is_file()
        # B never saw the document: the request names the address, B fetches it from the store
        r = cb.post("/v1/completions", json={"prompt": " Who delivers?", "max_tokens": 2, "kite": {"state": sid}})
        assert r.status_code == 200, r.text
        assert r.json()["kite"]["state"] == sid
        # the same document uploaded to B: found in the store, not upcycled again
        again = cb.post("/v1/states", json={"document": DOC})
        assert again.status_code == 200 and again.json()["id"] == sid
        metrics_b = cb.get("/metrics").text
        assert _metric(metrics_b, "kite_upcycle_states_total") == 0
        assert _metric(metrics_b, "kite_store_hits_total", tier="file") == 1
        assert _metric(ca.get("/metrics").text, "kite_store_puts_total", tier="file") == 1
        # an address no tier holds: 404, counted as a miss
        missing = cb.post("/v1/completions", json={"prompt": " x", "max_tokens": 1, "kite": {"state": "e" * 64}})
        assert missing.status_code == 404
        assert _metric(cb.get("/metrics").text, "kite_store_misses_total") == 1
    finally:
        for c, s in ((ca, a), (cb, b)):
            c.close()
            s.stop()


def test_a_corrupt_copy_in_the_store_is_refused_and_counted(lm, tmp_path):
    store = f"file://{tmp_path}/shared"
    a, app_a, ca = _server(lm, tmp_path / "a", store)
    b, _, cb = _server(lm, tmp_path / "b", store)
    try:
        sid = ca.post("/v1/states", json={"document": DOC}).json()["id"]
        obj = tmp_path / "shared" / f"{sid}.upc"
        data = obj.read_bytes()
        obj.write_bytes(data[: len(data) // 2])                  # torn
        r = cb.post("/v1/completions", json={"prompt": " Who?", "max_tokens": 1, "kite": {"state": sid}})
        assert r.status_code == 404                               # never loaded; the caller may upcycle
        assert not (tmp_path / "b" / "states" / f"{sid}.upc").exists()
        assert _metric(cb.get("/metrics").text, "kite_store_errors_total", tier="file", op="verify") == 1
        # B upcycles the document itself and repairs the store
        assert cb.post("/v1/states", json={"document": DOC}).status_code == 201
        from kite.store import verify_state

        assert verify_state(obj.read_bytes(), sid).id == sid
    finally:
        for c, s in ((ca, a), (cb, b)):
            c.close()
            s.stop()


@pytest.mark.parametrize("url,message", [("ftp://host/x", "scheme 'ftp'"), ("mem://?max=huge", "expected a size")])
def test_kite_serve_refuses_a_bad_store_url_before_loading_the_model(tiny_models, url, message, monkeypatch):
    from typer.testing import CliRunner

    import kite.model
    from kite.cli.main import app as cli

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kite.model, "load_model", no_load)
    res = CliRunner().invoke(cli, ["serve", "--model", str(tiny_models["llama"]), "--store", url])
    assert res.exit_code == 2 and message in res.output, res.output
