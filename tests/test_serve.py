"""`kite serve` over real HTTP: a uvicorn server on a free port serving a tiny random model."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from typer.testing import CliRunner

from kite.cli.main import app as cli
from kite.serve import BackgroundServer, ServeSettings, create_app
from tests.conftest import parse_json
from tests.tiny_models import CORPUS
from tests.waiting import wait_until

TOKEN = "s3cret-token"
DOC = CORPUS.replace(". ", ".\n\n", 3)
RULES_V1 = """version: v1
rules:
  - name: very_vague
    condition: intent_entropy > 100
    action:
      load_all_clusters: true
      precision: int8
  - name: default
    condition: true
    action:
      load_all_clusters: true
"""
RULES_V2 = RULES_V1.replace("version: v1", "version: v2").replace("name: default", "name: default_v2")
RULES_BAD = """rules:
  - name: r1
    condition: intent_entropyy > 3
    action:
      load_all_clusters: true
  - name: r2
    condition: intent_entropy >> 3
    action:
      layers: "12-18"
  - name: default
    condition: true
    action:
      load_all_clusters: true
"""
runner = CliRunner()


def _settings(root, **kw) -> ServeSettings:
    rules = root / "rules"
    rules.mkdir(parents=True, exist_ok=True)
    for name, text in (("yoco_rules.yaml", RULES_V1), ("yoco_rules_v2.yaml", RULES_V2),
                       ("yoco_rules_bad.yaml", RULES_BAD)):
        (rules / name).write_text(text)
    # min_hit_gain -1: every plan loads, whatever the tiny model's measured gains did to health.
    return ServeSettings(state_dir=root / "states", rules_path=rules / "yoco_rules.yaml",
                         min_hit_gain=-1.0, max_body_mb=0.25, default_max_tokens=3, **kw)


def _pipeline(lm):
    from kite.upcycle import Pipeline, UpcycleConfig, compress_settings

    cfg = UpcycleConfig.model_validate({"compression": {"precision": "exact", "cluster_num": 3, "min_span_tokens": 8,
                                                        "max_span_tokens": 24}})
    return Pipeline(lm=lm, tagger=None, settings=compress_settings(cfg), config=cfg, config_path=None)


def _start(lm, settings, tmp):
    from kite.yoco.health import HealthStore

    health = HealthStore(tmp / "health.sqlite")
    app = create_app(_pipeline(lm), settings, health=health)
    server = BackgroundServer(app)
    server.start()
    return server, app, health


@pytest.fixture(scope="module")
def lm(tiny_models):
    import torch

    from kite.model import load_model

    torch.set_num_threads(1)  # a shared 2-core machine
    return load_model(str(tiny_models["llama"]), device="cpu")


@pytest.fixture(scope="module")
def live(lm, tmp_path_factory):
    """The main server: fusion on, an admin token, a 0.25 MB body limit."""
    root = tmp_path_factory.mktemp("serve")
    settings = _settings(root, admin_token=TOKEN, fusion=True)
    server, app, health = _start(lm, settings, root)
    client = httpx.Client(base_url=server.url, timeout=60)
    yield {"url": server.url, "client": client, "root": root, "app": app, "health": health,
           "settings": settings}
    client.close()
    server.stop()


@pytest.fixture(scope="module")
def plain(lm, tmp_path_factory):
    """A second server: fusion off and no admin token configured."""
    root = tmp_path_factory.mktemp("serve-plain")
    server, _, _ = _start(lm, _settings(root, admin_token=None, fusion=False), root)
    client = httpx.Client(base_url=server.url, timeout=60)
    yield {"url": server.url, "client": client}
    client.close()
    server.stop()


def _auth(token=TOKEN):
    return {"Authorization": f"Bearer {token}"}


def _upload(client, text=DOC, **kw) -> str:
    r = client.post("/v1/states", json={"document": text, **kw})
    assert r.status_code in (200, 201), r.text
    return r.json()["id"]


def _ask(client, state_id, prompt=" What is the capital of France?", **kw):
    return client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "kite": {"state": state_id},
                                                **kw})


# -- completions -------------------------------------------------------------------------------

def test_completion_using_an_uploaded_state(live):
    c = live["client"]
    r = c.post("/v1/states", json={"document": DOC, "name": "contract.txt"})
    assert r.status_code in (200, 201), r.text
    up = r.json()
    sid = up["id"]
    assert up["tokens"] > 100 and up["bytes"] > 0 and up["labels"] and up["warnings"] == []
    again = c.post("/v1/states", json={"document": DOC})  # same document: the same state, not redone
    assert again.status_code == 200 and again.json()["id"] == sid and again.json()["created"] is False
    listed = {s["id"]: s for s in c.get("/v1/states").json()["data"]}
    assert set(listed[sid]) >= {"id", "labels", "tokens", "bytes", "created"}

    r = _ask(c, sid)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str)
    assert body["usage"]["completion_tokens"] <= 2
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    k = body["kite"]
    assert k["state"] == sid and k["fusion"] is True and k["loaded"] is True
    assert k["plan"]["matched_rule"] == "default" and k["load"]["tokens"] == up["tokens"]
    assert k["gain"] is not None and "intent_entropy" in k["signals"]
    assert {"signals_and_decision", "model_signals", "decide", "load", "generate"} <= set(k["timings_ms"])
    assert k["rules"]["version"] == "v1"
    # Feedback: the measured gain went into the health store.
    assert {rec.cluster for rec in live["health"].records(sid)} == set(k["load"]["labels"])


def test_the_timings_count_the_models_pass_over_the_query(live, monkeypatch):
    """The pass over the queries that arrived together runs once, before each request's decision:
    each request's model_signals and signals_and_decision count it (a request waited for it)."""
    import time

    import kite.yoco.intent as intent

    real = intent.query_signals

    def slow(*a, **k):
        time.sleep(0.05)
        return real(*a, **k)

    monkeypatch.setattr(intent, "query_signals", slow)
    c = live["client"]
    sid = c.post("/v1/states", json={"document": DOC}).json()["id"]
    t = _ask(c, sid).json()["kite"]["timings_ms"]
    assert t["model_signals"] >= 50 and t["signals_and_decision"] >= t["model_signals"] + t["decide"]


def test_chat_completion_with_a_document_and_without_state(live):
    c = live["client"]
    doc = DOC + "\n\nPayment is due within thirty days."
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Who pays?"}],
                                             "max_tokens": 2, "kite": {"document": doc}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["kite"]["upcycled"]["id"] == body["kite"]["state"] and body["kite"]["loaded"]
    plain = c.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "Hello"}]})
    assert plain.status_code == 200 and plain.json()["kite"]["state"] is None
    assert plain.json()["usage"]["completion_tokens"] <= 3  # the server's default max_tokens


def test_streaming_completion(live):
    c = live["client"]
    sid = _upload(c)
    events = []
    with c.stream("POST", "/v1/completions", json={"prompt": " Payment?", "max_tokens": 3, "stream": True,
                                                   "kite": {"state": sid}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] in ("stop", "length")
    assert last["kite"]["loaded"] is True and last["usage"]["completion_tokens"] <= 3
    with c.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 3, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["kite"]["state"] is None
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
    assert isinstance(text, str)


def test_bad_requests_are_one_clear_error(live):
    c = live["client"]
    r = c.post("/v1/completions", json={"prompt": "x", "kite": {"state": "a", "document": "b"}})
    assert r.status_code == 400 and "exactly one" in r.json()["error"]["message"]
    r = c.post("/v1/completions", json={"prompt": "x", "kite": {"state": "no-such-state"}})
    assert r.status_code == 404 and "no-such-state" in r.json()["error"]["message"]
    r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**6})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    for bad in (b"NaN", b"Infinity"):         # what Python's json writes for them: refused as what they are
        r = c.post("/v1/completions", content=b'{"prompt": "x", "temperature": ' + bad + b"}",
                   headers={"content-type": "application/json"})
        assert r.status_code == 400 and "temperature" in r.text and "finite number" in r.text, r.text


# -- state ids ---------------------------------------------------------------------------------

TRAVERSALS = ["../x", "..", "../../etc/passwd", "/etc/passwd", "a/b", "a\\b", ".hidden", "x" * 129,
              "..%2fx", "%2e%2e%2fx", "a%2Fb", "", "a b", "a\x00b"]


@pytest.mark.parametrize("bad", TRAVERSALS)
def test_state_ids_cannot_leave_the_store(live, bad):
    c = live["client"]
    outside = live["root"] / "outside.upc"
    outside.write_bytes(b"not yours")
    r = _ask(c, bad)
    assert r.status_code == 400, r.text
    r = c.post("/v1/states", json={"document": DOC, "id": bad})
    assert r.status_code == 400, r.text
    for method in ("GET", "DELETE"):  # in the URL: refused, or no route at all; never served
        r = c.request(method, "/v1/states/" + quote(bad, safe="/%\\"))
        assert r.status_code in (400, 404, 405), (method, bad, r.status_code)
    assert outside.read_bytes() == b"not yours"


def test_symlinked_state_leading_out_is_refused(live):
    c = live["client"]
    target = live["root"] / "elsewhere.upc"
    target.write_bytes(b"x")
    (live["settings"].state_dir / "evil.upc").symlink_to(target)
    assert _ask(c, "evil").status_code == 400
    assert c.delete("/v1/states/evil").status_code == 400
    assert target.exists()


def test_delete_state(live):
    c = live["client"]
    sid = _upload(c, DOC + " Termination needs notice.", id="to-delete")
    assert c.get(f"/v1/states/{sid}").status_code == 200
    assert c.delete(f"/v1/states/{sid}").json() == {"id": sid, "deleted": True}
    assert c.delete(f"/v1/states/{sid}").status_code == 404
    assert _ask(c, sid).status_code == 404


def test_a_states_file_is_opened_once_per_version_and_forgotten_when_it_goes(live):
    """Questions about an unchanged state reuse its open file (its header parsed once); a state
    uploaded again under its id (a new file) is opened again and answers from the new one; a deleted
    one is refused (404) and its file no longer kept."""
    c = live["client"]
    kept = live["app"].state.kite.runner.open_states
    sid = _upload(c, DOC + " Payment is due monthly.", id="kept-open")
    assert _ask(c, sid).status_code == 200
    opened, reused = kept.opened, kept.reused
    for _ in range(3):
        assert _ask(c, sid).status_code == 200
    assert (kept.opened, kept.reused) == (opened, reused + 3)
    r = c.post("/v1/states", json={"document": DOC + " Rent rises yearly by two percent.", "id": sid, "overwrite": True})
    assert r.status_code in (200, 201), r.text
    tokens = r.json()["tokens"]
    answer = _ask(c, sid)
    assert answer.status_code == 200 and kept.opened == opened + 1
    assert answer.json()["kite"]["load"]["tokens"] == tokens     # read from the new file
    assert c.delete(f"/v1/states/{sid}").status_code == 200
    assert _ask(c, sid).status_code == 404
    assert not any(sid in k for k in kept._open)


# -- admin -------------------------------------------------------------------------------------

def test_bad_reload_is_refused_while_requests_keep_succeeding(live):
    c = live["client"]
    sid = _upload(c)
    before = c.get("/admin/rules/status", headers=_auth()).json()
    results: list[httpx.Response] = []

    def ask():
        with httpx.Client(base_url=live["url"], timeout=60) as own:
            results.append(_ask(own, sid))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    r = c.post("/admin/rules/reload", json={"path": "yoco_rules_bad.yaml"}, headers=_auth())
    for t in threads:
        t.join()
    assert r.status_code == 422
    err = r.json()["error"]
    assert len(err["errors"]) == 4 and "4 errors" in err["report"]
    assert "did you mean 'intent_entropy'" in err["report"] and "^" in err["report"]
    assert [x.status_code for x in results] == [200] * 4
    assert {x.json()["kite"]["rules"]["sha256"] for x in results} == {before["sha256"]}
    after = c.get("/admin/rules/status", headers=_auth()).json()
    assert after["sha256"] == before["sha256"] and after["version"] == "v1"
    assert "yoco_rules_bad.yaml" in after["last_error"]["source"]
    assert "unknown field" in after["last_error"]["message"]
    assert _ask(c, sid).status_code == 200  # the old set still serves


def test_switch_rules_and_status(live):
    c = live["client"]
    r = c.post("/admin/rules/switch", json={"version": "v2"}, headers=_auth())
    assert r.status_code == 200 and r.json()["version"] == "v2"
    status = c.get("/admin/rules/status", headers=_auth()).json()
    assert status["version"] == "v2" and status["source"].endswith("yoco_rules_v2.yaml")
    assert len(status["sha256"]) == 64 and status["loaded_at"] > 0
    assert _ask(c, _upload(c)).json()["kite"]["plan"]["matched_rule"] == "default_v2"
    assert c.post("/admin/rules/switch", json={"version": "v9"}, headers=_auth()).status_code == 404
    assert c.post("/admin/rules/switch", json={"version": "../x"}, headers=_auth()).status_code == 400
    outside = live["root"] / "rules_outside.yaml"
    outside.write_text(RULES_V1)
    for path in (str(outside), "../rules_outside.yaml"):
        r = c.post("/admin/rules/reload", json={"path": path}, headers=_auth())
        assert r.status_code == 400 and "outside the rules folder" in r.json()["error"]["message"]
    r = c.post("/admin/rules/switch", json={"version": "v1"}, headers=_auth())
    assert r.status_code == 200 and r.json()["version"] == "v1"
    r = c.post("/admin/rules/reload", headers=_auth())  # no body: re-read the active file
    assert r.status_code == 200 and r.json()["version"] == "v1"


def test_admin_needs_the_token(live, plain):
    c = live["client"]
    for method, path in (("GET", "/admin/rules/status"), ("POST", "/admin/rules/reload"),
                         ("POST", "/admin/rules/switch")):
        r = c.request(method, path, json={"version": "v2"} if path.endswith("switch") else None)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = c.request(method, path, headers=_auth("wrong"), json={"version": "v2"})
        assert r.status_code == 403
    assert c.get("/admin/rules/status", headers={"Authorization": TOKEN}).status_code == 401  # not Bearer
    # No token configured: refused, not open.
    r = plain["client"].get("/admin/rules/status", headers=_auth())
    assert r.status_code == 403 and "no admin token is configured" in r.json()["error"]["message"]
    assert c.get("/admin/rules/status", headers=_auth()).json()["version"] == "v1"


# -- limits, fusion off, metrics ---------------------------------------------------------------

def test_oversized_bodies_are_refused(live):
    c = live["client"]
    big = {"prompt": "x", "kite": {"document": "word " * 60_000}}  # ~0.3 MB > 0.25 MB
    r = c.post("/v1/completions", json=big)
    assert r.status_code == 413 and "max_body_mb" in r.json()["error"]["message"]

    def chunks():
        for _ in range(40):
            yield b" " * 10_000

    r = c.post("/v1/states", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    # A declared length over the limit is refused before any of the body is sent.
    host, port = live["url"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
    assert c.get("/healthz").json()["ok"] is True


def test_fusion_off_loads_nothing(plain):
    c = plain["client"]
    sid = _upload(c)
    body = _ask(c, sid).json()
    k = body["kite"]
    assert k["fusion"] is False and k["loaded"] is False and k["load"] is None and k["gain"] is None
    assert "upcycle_yoco_fusion is off" in k["note"] and body["usage"]["prefix_tokens"] == 0
    assert k["plan"]["matched_rule"] == "default"  # the decision is still reported


def test_metrics_and_healthz(live):
    c = live["client"]
    _ask(c, _upload(c))
    health = c.get("/healthz").json()
    assert health["ok"] and health["fusion"] is True and health["rules"]["version"] in ("v1", "v2")
    text = c.get("/metrics").text
    for name in ("kite_yoco_decision_latency_seconds_bucket", "kite_yoco_signals_latency_seconds_bucket",
                 "kite_yoco_loads_total", "kite_yoco_hits_total",
                 "kite_yoco_hit_rate", "kite_upcycle_regenerate_rate", "kite_requests_total",
                 "kite_request_latency_seconds_bucket", "kite_watermark_gpu_mem", "kite_watermark_cpu_queue",
                 "kite_watermark_spike", "kite_rules_reloads_total"):
        assert f"\n{name}" in text or f"# HELP {name}" in text, name   # (a labelled counter before its first count)
    rate = next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("kite_upcycle_regenerate_rate "))
    assert rate > 0
    loads = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kite_yoco_loads_total"))
    assert loads >= 1


def test_metrics_count_the_collectors_pauses(live):
    """Every thread waits while Python's cyclic collector runs: /metrics counts its collections and
    their seconds by generation, from the app's start-up on."""
    import gc

    from kite.serve.scrape import parse_metrics

    c = live["client"]
    before = parse_metrics(c.get("/metrics").text)
    gc.collect()
    gc.collect()
    after = parse_metrics(c.get("/metrics").text)
    full = {"generation": "2"}
    assert after.value("kite_gc_pauses_total", **full) >= before.value("kite_gc_pauses_total", **full) + 2
    assert after.value("kite_gc_pause_seconds_total", **full) > before.value("kite_gc_pause_seconds_total", **full)
    assert 0 < after.value("kite_gc_pause_max_seconds", **full) <= after.value("kite_gc_pause_seconds_total", **full)


def test_a_serving_process_freezes_its_startup_heap_out_of_the_collector():
    import gc

    from kite.serve.heap import freeze_startup_heap

    class Cycle:
        pass

    a = Cycle()
    a.me = a                           # a cycle: an object the collector walks
    try:
        frozen = freeze_startup_heap()
        assert frozen > 1000 and gc.get_freeze_count() > 1000
        assert not any(o is a for o in gc.get_objects())    # the collector no longer walks it
    finally:
        gc.unfreeze()


def test_a_model_thread_that_stops_answers_503_in_one_line_and_healthz_says_so(lm, tmp_path):
    """A step that fails beyond repair (its clean-up fails too, as after a GPU's illegal memory access)
    stops the model's thread: the request in flight gets a 503 naming the error, later ones too (a
    stream is refused before its status line), and /healthz answers 503 with it, so whatever watches
    the server restarts it."""
    server, app, _ = _start(lm, _settings(tmp_path, fusion=True), tmp_path)
    try:
        c = httpx.Client(base_url=server.url, timeout=60)
        assert c.get("/healthz").status_code == 200
        decoder = app.state.kite.runner.batcher.decoder

        def broken(*a, **k):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        decoder.step = decoder.cancel = broken
        r = c.post("/v1/completions", json={"prompt": " Hello", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert "illegal memory access" in r.json()["error"]["message"]
        assert "\n" not in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": " Hello again", "max_tokens": 2, "stream": True})
        assert r.status_code == 503 and "model's thread stopped" in r.json()["error"]["message"]
        h = c.get("/healthz")
        assert h.status_code == 503 and h.json()["ok"] is False and "illegal memory access" in h.json()["error"]
        c.close()
    finally:
        server.stop()


def _metric(client, name: str, **labels) -> float:
    """One sample of /metrics (0 when the series does not exist yet)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # the exposition sorts labels
    head = f"{name}{{{want}}} " if labels else f"{name} "
    text = client.get("/metrics").text
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(head)), 0.0)


def test_every_refused_reload_or_switch_counts_as_an_error_and_every_one_is_logged(live, caplog):
    c = live["client"]
    caplog.set_level(logging.INFO, logger="kite.serve")
    before = {r: _metric(c, "kite_rules_reloads_total", result=r) for r in ("ok", "error")}
    refused = [c.post("/admin/rules/switch", json={"version": "../x"}, headers=_auth()),       # 400: not a version
               c.post("/admin/rules/switch", json={"version": "v9"}, headers=_auth()),         # 404: no such file
               c.post("/admin/rules/reload", json={"path": "../x.yaml"}, headers=_auth()),     # 400: outside
               c.post("/admin/rules/switch", json={"versoin": "v2"}, headers=_auth()),         # 400: bad body
               c.post("/admin/rules/reload", content=b"{not json", headers=_auth()),           # 400: not JSON
               c.post("/admin/rules/reload", json={"path": "yoco_rules_bad.yaml"}, headers=_auth())]  # 422
    assert [r.status_code for r in refused] == [400, 404, 400, 400, 400, 422]
    assert c.post("/admin/rules/switch", json={"version": "v2"}, headers=_auth()).status_code == 200
    assert c.post("/admin/rules/switch", json={"version": "v1"}, headers=_auth()).status_code == 200
    assert c.post("/admin/rules/reload", json={"version": "v2"}).status_code == 401  # not past the token
    assert _metric(c, "kite_rules_reloads_total", result="error") == before["error"] + 6
    assert _metric(c, "kite_rules_reloads_total", result="ok") == before["ok"] + 2
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "kite.serve"]
    refusals = [m for level, m in lines if level == "WARNING" and m.startswith("rules ")]
    assert [m.split(":")[0] for m in refusals] == ["rules switch refused (400)", "rules switch refused (404)",
                                                   "rules reload refused (400)", "rules switch refused (400)",
                                                   "rules reload refused (400)", "rules reload refused (422)"]
    assert "4 errors in" in refusals[-1] and all("v1 (sha256" in m for m in refusals)
    swaps = [m for level, m in lines if level == "INFO" and m.startswith("rules ")]
    assert swaps[0].startswith("rules switch: v2 (") and "was v1" in swaps[0]
    assert swaps[1].startswith("rules switch: v1 (") and "was v2" in swaps[1]
    assert any(level == "WARNING" and m.startswith("admin request refused (401, no token sent): POST "
                                                   "/admin/rules/reload from 127.0.0.1:") for level, m in lines)


def test_refused_admin_tokens_are_logged_without_the_token(live, plain, caplog):
    caplog.set_level(logging.INFO, logger="kite.serve")
    assert live["client"].get("/admin/rules/status", headers=_auth("guess-1234")).status_code == 403
    assert plain["client"].get("/admin/rules/status", headers=_auth()).status_code == 403
    lines = [r.getMessage() for r in caplog.records if r.name == "kite.serve" and r.levelname == "WARNING"]
    assert any(m.startswith("admin request refused (403, wrong token): GET /admin/rules/status from ")
               for m in lines)
    assert any(m.startswith("admin request refused (403, no token configured)") for m in lines)
    assert not any("guess-1234" in r.getMessage() or TOKEN in r.getMessage() for r in caplog.records)


def test_each_request_gets_an_access_line(live, caplog):
    caplog.set_level(logging.INFO, logger="kite.serve")
    c = live["client"]
    assert c.get("/healthz").status_code == 200
    assert c.post("/v1/completions", json={"prompt": "x", "kite": {"document": "word " * 60_000}}).status_code == 413

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "kite.serve.access" and r.levelname == "INFO"]

    # the line is written once the response has gone
    wait_until(lambda: any(" 413 " in m for m in lines()), 5, 0.02, "the 413's access line")
    seen = lines()
    assert any(re.fullmatch(r'127\.0\.0\.1:\d+ "GET /healthz HTTP/1\.1" 200 [\d.]+ ms', m) for m in seen), seen
    assert any('"POST /v1/completions HTTP/1.1" 413 ' in m for m in seen), seen


def test_kite_serve_logs_access_and_rule_lines_at_its_default_level():
    """`kite serve`'s own logging (the foreground run, --log-level info by default) shows KITE's
    server lines on stderr; debug stays out."""
    import inspect
    import subprocess
    import sys

    from kite.cli.serve import serve

    assert inspect.signature(serve).parameters["log_level"].default == "info"
    code = ("import logging\n"
            "from kite.serve.server import uvicorn_config\n"
            "uvicorn_config(None, '127.0.0.1', 1, 'info', kite_logs=True)\n"
            "logging.getLogger('kite.serve.access').info('an access line')\n"
            "logging.getLogger('kite.serve').info('a rules line')\n"
            "logging.getLogger('kite.serve').debug('a debug line')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "INFO:     an access line" in proc.stderr and "INFO:     a rules line" in proc.stderr
    assert "debug" not in proc.stderr


def test_413s_are_counted_under_their_route(live):
    c = live["client"]
    before = _metric(c, "kite_requests_total", route="/v1/states", method="POST", status="413")
    unmatched = _metric(c, "kite_requests_total", route="unmatched", method="POST", status="413")
    r = c.post("/v1/states", json={"document": "word " * 60_000})
    assert r.status_code == 413
    assert _metric(c, "kite_requests_total", route="/v1/states", method="POST", status="413") == before + 1
    assert _metric(c, "kite_requests_total", route="unmatched", method="POST", status="413") == unmatched
    assert c.post("/no/such/route", json={}).status_code == 404
    assert _metric(c, "kite_requests_total", route="unmatched", method="POST", status="404") >= 1


def test_a_model_the_server_does_not_serve_is_not_found(live, lm):
    c = live["client"]
    spec = lm.source.spec
    for name in ("gpt-4o", spec + "-other"):
        for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                     "max_tokens": 1, "stream": True})):
            r = c.post(path, json={**body, "model": name})
            assert r.status_code == 404, r.text
            err = r.json()["error"]
            assert err["code"] == "model_not_found" and err["param"] == "model" and name in err["message"]
    served = c.get("/v1/models").json()["data"][0]["id"]
    for name in (served, Path(spec).name, None):  # the spec, its short name, or no model at all
        body = {"prompt": "x", "max_tokens": 1, **({"model": name} if name else {})}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == served, r.text


def test_a_body_that_is_not_json_says_so(live):
    c = live["client"]
    for path in ("/v1/completions", "/v1/states", "/admin/rules/switch"):
        r = c.post(path, content=b"{not json", headers={"content-type": "application/json", **_auth()})
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert message.startswith("the request body is not valid JSON"), message
    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens: ")


# -- the CLI against the live server -----------------------------------------------------------

def test_cli_rules_commands_against_the_live_server(live, monkeypatch):
    url = live["url"]
    res = runner.invoke(cli, ["yoco", "rules-status", "--server", url, "--token", TOKEN, "--json"])
    assert res.exit_code == 0, res.output
    assert parse_json(res.output)["version"] == "v1"

    res = runner.invoke(cli, ["yoco", "reload-rules", "yoco_rules_bad.yaml", "--server", url, "--token", TOKEN])
    assert res.exit_code == 2
    assert "did you mean 'intent_entropy'" in res.output and "the old set keeps serving" in res.output

    monkeypatch.setenv("KITE_ADMIN_TOKEN", TOKEN)  # the token from the environment
    res = runner.invoke(cli, ["yoco", "switch-rules", "v2", "--server", url])
    assert res.exit_code == 0 and "switched to rules v2" in res.output
    res = runner.invoke(cli, ["yoco", "reload-rules", str(live["settings"].rules_path), "--server", url, "--json"])
    assert res.exit_code == 0 and parse_json(res.output)["version"] == "v1"
    res = runner.invoke(cli, ["yoco", "rules-status", "--server", url])
    assert res.exit_code == 0 and "active rules v1" in res.output and "last error" in res.output

    monkeypatch.delenv("KITE_ADMIN_TOKEN")
    res = runner.invoke(cli, ["yoco", "rules-status", "--server", url])
    assert res.exit_code == 2 and "401" in res.output
    res = runner.invoke(cli, ["yoco", "rules-status", "--server", url, "--token", "wrong"])
    assert res.exit_code == 2 and "403" in res.output
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    res = runner.invoke(cli, ["yoco", "rules-status", "--server", dead, "--token", TOKEN])
    assert res.exit_code == 1 and "cannot reach the KITE server" in res.output


@pytest.mark.parametrize("url", ["notaurl", "ftp://127.0.0.1:8088", "http://", "http://127.0.0.1:99999"])
def test_a_server_url_that_names_no_server_is_bad_usage(url):
    res = runner.invoke(cli, ["yoco", "rules-status", "--server", url, "--token", TOKEN])
    assert res.exit_code == 2 and "expected http://HOST:PORT" in res.stderr, res.output


def test_fusion_is_off_by_default_and_the_serve_command_offers_it(tmp_path, monkeypatch):
    from kite.config import load_config

    assert load_config().features.upcycle_yoco_fusion is False
    assert ServeSettings(state_dir=tmp_path, rules_path=tmp_path / "r.yaml").fusion is False
    monkeypatch.setenv("COLUMNS", "200")
    res = runner.invoke(cli, ["serve", "--help"])
    assert res.exit_code == 0 and "--fusion" in res.stdout


def test_server_binds_loopback_by_default(tmp_path):
    s = ServeSettings(state_dir=tmp_path / "s", rules_path=tmp_path / "r.yaml")
    assert s.host == "127.0.0.1"
    from kite.config import load_config

    cfg = load_config()
    assert cfg.server.host == "127.0.0.1"


def test_serve_command_refuses_a_bad_rule_file_before_loading(tmp_path, tiny_models):
    bad = tmp_path / "rules" / "yoco_rules.yaml"
    bad.parent.mkdir()
    bad.write_text(RULES_BAD)
    res = runner.invoke(cli, ["serve", "--model", str(tiny_models["llama"]), "--rules", str(bad)])
    assert res.exit_code == 2 and "unknown field 'intent_entropyy'" in res.output
    res = runner.invoke(cli, ["serve", "--model", str(tiny_models["llama"]), "--rules", str(tmp_path / "missing.yaml")])
    assert res.exit_code == 2 and "no such rule file" in res.output
    res = runner.invoke(cli, ["serve", "--model", str(tiny_models["llama"]), "--port", "70000"])
    assert res.exit_code == 2 and "server.port" in res.output


def _serve_without_binding(monkeypatch, lm, rule_compiles: list) -> list:
    """`kite serve` on the tiny model with no port bound. Returns its events in order: ("model", rule
    sets compiled so far) when the model loads, ("run", app) where it would start serving."""
    import kite.serve.server
    import kite.upcycle

    events: list = []
    pipe = _pipeline(lm)
    monkeypatch.setattr(kite.upcycle, "open_pipeline",
                        lambda *a, **kw: events.append(("model", len(rule_compiles))) or pipe)
    monkeypatch.setattr(kite.serve.server, "run", lambda app, *a, **kw: events.append(("run", app)))
    return events


def test_serve_command_compiles_the_rule_set_once_and_before_the_model_loads(lm, tmp_path, monkeypatch,
                                                                            rule_compiles, tiny_models):
    settings = _settings(tmp_path)
    events = _serve_without_binding(monkeypatch, lm, rule_compiles)
    res = runner.invoke(cli, ["serve", "--model", str(tiny_models["llama"]), "--rules", str(settings.rules_path),
                              "--state-dir", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    assert [e[0] for e in events] == ["model", "run"] and events[0][1] == 1  # compiled before the model
    assert rule_compiles == [str(settings.rules_path)]  # and never again
    active = events[1][1].state.kite.rules.current
    assert active.source == str(settings.rules_path) and active.n_layers == lm.geometry.n_layers


def test_serve_command_refuses_rule_layers_past_the_model_before_its_weights_load(lm, tmp_path, monkeypatch,
                                                                                  rule_compiles, tiny_models):
    rules = tmp_path / "yoco_rules.yaml"
    rules.write_text(RULES_V1.replace("precision: int8", 'precision: int8\n      layers: "0-7"'))
    events = _serve_without_binding(monkeypatch, lm, rule_compiles)
    res = runner.invoke(cli, ["serve", "--model", str(tiny_models["llama"]), "--rules", str(rules),
                              "--state-dir", str(tmp_path / "s")])
    assert res.exit_code == 2 and events == []  # the model's config said 3 layers: no weights loaded
    assert f"{rules}:8:16: layer 7 is out of range 0-2 (the model has 3 layers)" in res.stderr
    assert '      layers: "0-7"\n' in res.stderr and "\n" + " " * 19 + "^~~\n" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(f"error: {rules}: 1 error in the rule set")
    assert len(rule_compiles) == 1


def test_create_app_serves_a_compiled_rule_set_without_compiling_it_again(lm, tmp_path, rule_compiles):
    from kite.yoco.health import HealthStore
    from kite.yoco.rules import load_rules

    settings = _settings(tmp_path)
    given = load_rules(settings.rules_path)
    with HealthStore(tmp_path / "health.sqlite") as health:
        app = create_app(_pipeline(lm), settings, rules=given, health=health, start_sampler=False)
        assert len(rule_compiles) == 1 and app.state.kite.rules.current.sha256 == given.sha256
        app = create_app(_pipeline(lm), settings, health=health, start_sampler=False)
    assert rule_compiles == [str(settings.rules_path)] * 2  # given none, it compiles the settings' file
    assert app.state.kite.rules.current.n_layers == lm.geometry.n_layers


RULES_TYPO_AND_LAYERS = """rules:
  - name: r1
    condition: intent_entropyy > 3
    action: {load_all_clusters: true, layers: "1,40-50"}
  - name: r2
    condition: intent_entropy > 4
    action: {load_all_clusters: true, layers: [0, 3]}
  - name: default
    action: {load_all_clusters: true}
"""


def test_one_rule_file_gets_one_error_list_from_validate_serve_and_reload(live, lm, tiny_models, tmp_path,
                                                                         monkeypatch, rule_compiles):
    """`kite yoco validate --model M` (or --layers N), `kite serve --model M` starting up and a reload
    on a server of M list the same errors for one file: layers M lacks and everything else."""
    path = live["settings"].rules_path.parent / "yoco_rules_typo.yaml"
    path.write_text(RULES_TYPO_AND_LAYERS)
    model = str(tiny_models["llama"])  # 3 layers
    res = runner.invoke(cli, ["yoco", "validate", str(path), "--model", model, "--json"])
    assert res.exit_code == 2
    by_model = parse_json(res.stdout)["errors"]
    assert [e["message"] for e in by_model] == [
        "unknown field 'intent_entropyy'; did you mean 'intent_entropy'?",
        "layer 40 is out of range 0-2 (the model has 3 layers)",
        "layer 3 is out of range 0-2 (the model has 3 layers)"]
    res = runner.invoke(cli, ["yoco", "validate", str(path), "--layers", "3", "--json"])
    assert parse_json(res.stdout)["errors"] == by_model

    events = _serve_without_binding(monkeypatch, lm, rule_compiles)
    res = runner.invoke(cli, ["serve", "--model", model, "--rules", str(path), "--state-dir", str(tmp_path / "s")])
    assert res.exit_code == 2 and events == []
    assert res.stderr.strip().splitlines()[-1].startswith(f"error: {path}: 3 errors in the rule set")

    r = live["client"].post("/admin/rules/reload", json={"path": path.name}, headers=_auth())
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["errors"] == by_model
    assert err["report"] in res.stderr  # start-up printed the very same report


def test_validate_checks_layers_only_against_a_model_and_says_so(tiny_models, tmp_path, monkeypatch):
    import transformers

    def no_weights(*a, **kw):
        raise AssertionError("validate --model read the model's weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    path = tmp_path / "yoco_rules.yaml"
    path.write_text(RULES_V1.replace("precision: int8", 'precision: int8\n      layers: "40-50"'))
    res = runner.invoke(cli, ["yoco", "validate", str(path)])
    assert res.exit_code == 0 and "layers not checked (give --model or --layers)" in res.stdout
    res = runner.invoke(cli, ["yoco", "validate", str(path), "--model", str(tiny_models["llama"])])
    assert res.exit_code == 2 and "layer 40 is out of range 0-2 (the model has 3 layers)" in res.stderr
    res = runner.invoke(cli, ["yoco", "validate", str(path), "--model", str(tiny_models["llama"]), "--layers", "3"])
    assert res.exit_code == 2 and "not both" in res.stderr


def test_admin_and_metrics_answer_while_the_model_is_busy(live):
    c = live["client"]
    done: dict[str, float] = {}

    def long_completion(i):
        with httpx.Client(base_url=live["url"], timeout=120) as own:
            r = own.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 150})
            assert r.status_code == 200
            done[f"gen{i}"] = time.perf_counter()

    threads = [threading.Thread(target=long_completion, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    batcher = live["app"].state.kite.runner.batcher
    wait_until(lambda: batcher.batch_size + batcher.queue_length >= 1, 30, 0.01, "a generation in the batch")
    assert c.get("/admin/rules/status", headers=_auth()).status_code == 200
    assert c.post("/admin/rules/reload", headers=_auth()).status_code == 200
    assert "kite_requests_total" in c.get("/metrics").text
    done["admin"] = time.perf_counter()
    for t in threads:
        t.join()
    # Three generations queue for the model one after another; admin did not wait behind them.
    assert done["admin"] < max(done[f"gen{i}"] for i in range(3)), done


def test_state_summaries_follow_the_file_version_not_its_size_and_mtime(tiny_contract_state, tmp_path):
    """A state replaced by another file of the same size and mtime (a rename) is read again: the
    store keys on the file version (inode, ctime too), as every cache of a state does."""
    import os
    import shutil

    from kite.serve.states import StateStore

    _, _, good = tiny_contract_state
    store = StateStore(tmp_path / "states")
    path = store.path_for("doc-a")
    shutil.copyfile(good, path)
    first = store.summary("doc-a")
    assert first.error is None and first.tokens > 0
    damaged = tmp_path / "damaged.upc"
    data = bytearray(good.read_bytes())
    data[40] ^= 0xFF   # inside the header: its checksum no longer matches
    damaged.write_bytes(bytes(data))
    st = path.stat()
    os.utime(damaged, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(damaged, path)
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    assert store.summary("doc-a").error is not None
