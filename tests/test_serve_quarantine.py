"""`kite serve` survives a bad state: a crafted `.upc` named in one request fails that request alone
(422 naming the state, in the stream's error event when streamed) while others decode in the batch;
the state is then quarantined (listed, counted, refused without a read) until its file changes."""

from __future__ import annotations

import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kite.errors import BadInput, FingerprintMismatch
from kite.serve.quarantine import Quarantine, StateQuarantined, StateUnusable
from tests.test_serve import DOC, TOKEN, _settings, _start
from tests.waiting import wait_until
from tests.tiny_models import load_tiny_llama

PROMPTS = [" What is the capital of France?", " Payment?", " Who shall deliver the goods?",
           " Confidential information", " Once upon a time"]


@pytest.fixture(scope="module")
def lm(tiny_models):
    return load_tiny_llama(tiny_models)


@pytest.fixture(scope="module")
def served(lm, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-quarantine")
    server, app, _ = _start(lm, _settings(root, fusion=True, max_batch=8, admin_token=TOKEN), root)
    client = httpx.Client(base_url=server.url, timeout=120)
    good = client.post("/v1/states", json={"document": DOC}).json()["id"]
    yield {"client": client, "app": app, "url": server.url, "good": good, "folder": root / "states"}
    client.close()
    server.stop()


def _write(folder, state_id: str, data: bytes):
    """A state file placed in the server's folder by hand (whole, then renamed in)."""
    tmp = folder / f".{state_id}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, folder / f"{state_id}.upc")


def _damaged_part(data: bytes) -> bytes:
    """The last part's last byte flipped: the header reads, the part's checksum does not match."""
    return data[:-1] + bytes([data[-1] ^ 0x01])


def _damaged_header(data: bytes) -> bytes:
    """A byte inside the header's JSON flipped: refused when the file is opened."""
    at = 40
    return data[:at] + bytes([data[at] ^ 0x20]) + data[at + 1:]


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _listed(client) -> dict:
    return {s["id"]: s for s in client.get("/v1/states").json()["data"]}


def _stream(url: str, body: dict, started: threading.Event | None = None) -> list[dict]:
    """Every event of a streamed request, parsed; ``started`` is set when the first one arrives."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    events = []
    with httpx.Client(base_url=url, timeout=120) as own:
        with own.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                if started is not None:
                    started.set()
    return events


def _streamed_text(events: list[dict]) -> tuple[str, str]:
    chunks = [e for e in events if e != "[DONE]"]
    assert events[-1] == "[DONE]" and not any("error" in e for e in chunks), chunks[-1:]
    pieces = [c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or "" for c in chunks]
    return "".join(pieces), chunks[-1]["choices"][0]["finish_reason"]


def _answer(client, body: dict) -> tuple[str, str]:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return (ch["message"]["content"] if "message" in ch else ch["text"]), ch["finish_reason"]


def test_a_crafted_state_fails_its_request_alone_and_is_quarantined(served, monkeypatch):
    c, app, good = served["client"], served["app"], served["good"]
    srv = app.state.kite
    runner, quarantine = srv.runner, srv.store.quarantine
    _write(served["folder"], "crafted", _damaged_part((served["folder"] / f"{good}.upc").read_bytes()))
    bodies = []
    for i in range(8):
        body: dict = {"max_tokens": 60 if i % 2 == 0 else 160}   # a state holds 434 of the 512 positions
        if i % 4 == 3:
            body["messages"] = [{"role": "user", "content": PROMPTS[i % 5].strip()}]
        else:
            body["prompt"] = PROMPTS[i % 5]
        if i % 2 == 0:
            body["kite"] = {"state": good}
        bodies.append(body)
    twins = [_answer(c, b) for b in bodies]   # one at a time: what the batch must not change
    assert {finish for _, finish in twins} == {"length"}   # each runs its whole length
    misses = runner.prefixes.misses

    rows_at_failure = []
    put = quarantine.put

    def noting_rows(*args, **kwargs):   # how many sequences were decoding when the load failed
        rows_at_failure.append(runner.batcher.batch_size)
        return put(*args, **kwargs)

    monkeypatch.setattr(quarantine, "put", noting_rows)
    started = [threading.Event() for _ in bodies]
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        streams = [pool.submit(_stream, served["url"], b, e) for b, e in zip(bodies, started)]
        wait_until(lambda: all(e.is_set() for e in started), 60, 0.01, "the 8 streams' first pieces")
        bad = _stream(served["url"], {"prompt": " Payment?", "max_tokens": 8, "kite": {"state": "crafted"}})
        results = [f.result() for f in streams]

    # the 8 finished with their full answers
    assert [_streamed_text(events) for events in results] == twins
    # the bad one got its error, naming the state, as the stream's error event
    assert bad[-1] == "[DONE]" and len(bad) == 2, bad
    error = bad[0]["error"]
    assert error["code"] == 422 and "'crafted'" in error["message"] and "quarantined" in error["message"]
    assert str(served["folder"]) not in error["message"]   # the server's folders stay its own
    assert rows_at_failure and rows_at_failure[0] >= 1      # it failed while the others decoded
    assert runner.prefixes.misses == misses + 1             # its load was tried once

    listed = _listed(c)
    assert listed["crafted"]["quarantined"] is True
    assert "checksum" in listed["crafted"]["quarantine"]["reason"]
    assert listed[good]["quarantined"] is False and "quarantine" not in listed[good]
    metrics = c.get("/metrics").text
    assert _metric(metrics, "kite_states_quarantined") == 1
    assert _metric(metrics, 'kite_state_loads_refused_total{cause="unreadable"}') == 1
    assert _metric(metrics, 'kite_state_loads_refused_total{cause="quarantined"}') == 0

    # named again: refused at once, the file not opened
    from kite import upcycle

    opened = []

    class CountingStateFile(upcycle.StateFile):
        def __init__(self, path):
            opened.append(str(path))
            super().__init__(path)

    monkeypatch.setattr(upcycle, "StateFile", CountingStateFile)
    for path, body in (("/v1/completions", {"prompt": " Payment?", "kite": {"state": "crafted"}}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Payment?"}],
                                                 "stream": True, "kite": {"state": "crafted"}})):
        r = c.post(path, json=body)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["type"] == "unprocessable_entity"
        assert "state 'crafted' is quarantined" in r.json()["error"]["message"]
    assert opened == [] and runner.prefixes.misses == misses + 1
    monkeypatch.undo()
    metrics = c.get("/metrics").text
    assert _metric(metrics, 'kite_state_loads_refused_total{cause="quarantined"}') == 2
    assert _metric(metrics, 'kite_state_loads_refused_total{cause="unreadable"}') == 1
    assert c.get("/v1/states/crafted").json()["quarantine"]["refused"] == 2

    # the server answers a normal request after, and one with the good state
    assert _answer(c, bodies[1]) == twins[1]
    assert _answer(c, bodies[0]) == twins[0]

    # an upload that replaces the file lifts the quarantine
    r = c.post("/v1/states", json={"id": "crafted", "document": DOC, "overwrite": True})
    assert r.status_code == 201, r.text
    assert r.json()["quarantined"] is False
    assert _listed(c)["crafted"]["quarantined"] is False
    assert _metric(c.get("/metrics").text, "kite_states_quarantined") == 0
    r = c.post("/v1/completions", json={"prompt": " Payment?", "max_tokens": 4, "kite": {"state": "crafted"}})
    assert r.status_code == 200 and r.json()["kite"]["loaded"] is True


def test_a_state_whose_header_is_refused_is_quarantined_until_its_file_changes(served):
    c, good, folder = served["client"], served["good"], served["folder"]
    clean = (folder / f"{good}.upc").read_bytes()
    _write(folder, "bad-header", _damaged_header(clean))
    srv = served["app"].state.kite
    before = srv.store.quarantine.counts()["unreadable"]
    chat = {"messages": [{"role": "user", "content": "Payment?"}], "max_tokens": 4, "kite": {"state": "bad-header"}}

    r = c.post("/v1/chat/completions", json=chat)
    assert r.status_code == 422, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("state 'bad-header' does not load: corrupt .upc state")
    assert str(folder) not in message
    assert srv.store.quarantine.counts()["unreadable"] == before + 1
    assert "is quarantined" in c.post("/v1/chat/completions", json=chat).json()["error"]["message"]

    # the admin route lifts it: the next request reads the file again, and quarantines it again
    assert c.delete("/admin/states/bad-header/quarantine").status_code == 401
    auth = {"authorization": f"Bearer {TOKEN}"}
    r = c.delete("/admin/states/bad-header/quarantine", headers=auth)
    assert r.json() == {"id": "bad-header", "lifted": True}
    assert c.delete("/admin/states/bad-header/quarantine", headers=auth).json()["lifted"] is False
    assert c.delete("/admin/states/no-such/quarantine", headers=auth).status_code == 404
    assert "does not load" in c.post("/v1/chat/completions", json=chat).json()["error"]["message"]
    assert srv.store.quarantine.counts()["unreadable"] == before + 2

    # a new version of the file on disk lifts it
    _write(folder, "bad-header", clean)
    assert _listed(c)["bad-header"]["quarantined"] is False
    assert c.post("/v1/chat/completions", json=chat).status_code == 200

    # a delete lifts it too
    _write(folder, "bad-header", _damaged_header(clean))
    assert c.post("/v1/chat/completions", json=chat).status_code == 422
    assert c.delete("/v1/states/bad-header").status_code == 200
    assert "bad-header" not in srv.store.quarantine.ids()


def test_a_document_whose_state_is_quarantined_is_upcycled_again(served):
    c, good, folder = served["client"], served["good"], served["folder"]
    path = folder / f"{good}.upc"
    clean = path.read_bytes()
    _write(folder, good, _damaged_part(clean))
    asked = {"prompt": " Payment?", "max_tokens": 4, "kite": {"state": good}}
    assert c.post("/v1/completions", json=asked).status_code == 422
    assert _listed(c)[good]["quarantined"] is True
    # the same document again: its content id is quarantined, so it is upcycled in its place
    r = c.post("/v1/completions", json={"prompt": " Payment?", "max_tokens": 4, "kite": {"document": DOC}})
    assert r.status_code == 200, r.text
    kite = r.json()["kite"]
    assert kite["state"] == good and kite["upcycled"]["created"] is True and kite["loaded"] is True
    assert kite["upcycled"]["quarantined"] is False
    assert path.read_bytes() != _damaged_part(clean)
    # and reused as before once it is whole
    r = c.post("/v1/states", json={"document": DOC})
    assert r.status_code == 200 and r.json()["created"] is False
    assert c.post("/v1/completions", json=asked).status_code == 200


# -- the quarantine record ---------------------------------------------------------------------------

def test_the_quarantine_record_keys_on_the_file_version(tmp_path):
    from kite.upcycle import path_version

    q = Quarantine()
    path = tmp_path / "s1.upc"
    path.write_bytes(b"first version")
    q.check("s1")   # not quarantined: nothing happens
    with pytest.raises(StateUnusable) as err:
        with q.reading("s1", path, path_version(path)):
            raise BadInput(f"{path}: corrupt .upc state (header checksum mismatch)")
    assert str(err.value) == ("state 's1' does not load: corrupt .upc state (header checksum mismatch); "
                              "it is quarantined until its file is replaced")
    assert q.ids() == ["s1"] and q.counts() == {"unreadable": 1, "quarantined": 0}
    with pytest.raises(StateQuarantined, match=r"state 's1' is quarantined: corrupt \.upc state"):
        q.check("s1")
    seen = q.describe("s1")
    assert seen["reason"] == "corrupt .upc state (header checksum mismatch)" and seen["refused"] == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", seen["since"])
    assert q.counts() == {"unreadable": 1, "quarantined": 1}

    # a new version of the file lifts it; the same id refused again is quarantined again
    replacement = tmp_path / "new.upc"
    replacement.write_bytes(b"second version")
    os.replace(replacement, path)
    assert q.entry("s1") is None and q.ids() == [] and q.describe("s1") is None
    q.check("s1")
    q.put("s1", path_version(path), "part c0/L1/K does not decode")
    assert q.ids() == ["s1"]
    assert q.lift("s1", "by hand") is True and q.lift("s1", "by hand") is False
    # a file that is gone is not quarantined
    q.put("s1", path_version(path), "why")
    path.unlink()
    assert q.ids() == []


def test_only_a_readers_refusal_quarantines(tmp_path):
    from kite.upcycle import path_version

    q = Quarantine()
    path = tmp_path / "s2.upc"
    path.write_bytes(b"x")
    for exc in (FingerprintMismatch("made by another model"), RuntimeError("out of memory")):
        with pytest.raises(type(exc)):
            with q.reading("s2", path, path_version(path)):
                raise exc
    assert q.ids() == [] and q.counts()["unreadable"] == 0
    with pytest.raises(StateQuarantined):   # a refusal made inside a reading passes through as it is
        with q.reading("s2", path, path_version(path)):
            raise StateQuarantined("state 's2' is quarantined: ...")
    assert q.ids() == []
