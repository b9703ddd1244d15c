"""kite serve with API keys naming tenants, over real HTTP: two servers, each with its own folder, one
shared file:// store. A tenant sees, finds and loads only its own states; another tenant's state is
answered as a state nobody made; the same document uploaded by two tenants is two states; a key
without a tenant is the server as before tenants. The key file's errors are one line, exit 2."""

from __future__ import annotations

import httpx
import pytest

from kite.serve import BackgroundServer, create_app
from tests.test_serve import DOC, _pipeline, _settings
from tests.tiny_models import load_tiny_llama

KEYS = {"acme-key-0123456789": "acme", "beta-key-0123456789": "beta", "open-key-0123456789": None}


@pytest.fixture(scope="module")
def lm(tiny_models):
    return load_tiny_llama(tiny_models)


@pytest.fixture()
def servers(lm, tmp_path):
    """Two servers over one shared store: {name: (app, {who: client})} for who in acme, beta, open, anon."""
    from kite.yoco.health import HealthStore

    store = f"file://{tmp_path}/shared"
    out, running = {}, []
    for name in ("a", "b"):
        root = tmp_path / name
        settings = _settings(root, fusion=True, store_url=store, api_keys=KEYS)
        app = create_app(_pipeline(lm), settings, health=HealthStore(root / "health.sqlite"), start_sampler=False)
        server = BackgroundServer(app)
        server.start()
        running.append(server)
        clients = {who: httpx.Client(base_url=server.url, timeout=60,
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
                   for who, key in (("acme", "acme-key-0123456789"), ("beta", "beta-key-0123456789"),
                                    ("open", "open-key-0123456789"), ("anon", None))}
        out[name] = (app, clients)
    try:
        yield out
    finally:
        for server, (_, clients) in zip(running, out.values()):
            for c in clients.values():
                c.close()
            server.stop()


def _ask(client, state_id):
    return client.post("/v1/completions", json={"prompt": " Who delivers?", "max_tokens": 2,
                                                "kite": {"state": state_id}})


def _same_as_missing(got, missing, state_id, never):
    """Another tenant's state is answered exactly as one nobody made: status and body."""
    assert got.status_code == missing.status_code == 404
    assert got.text.replace(state_id, "ID") == missing.text.replace(never, "ID")


def test_api_keys_are_required_and_name_the_tenant(servers):
    _, c = servers["a"]
    assert c["anon"].get("/v1/states").status_code == 401
    assert c["anon"].get("/v1/models").status_code == 401
    wrong = httpx.get(f"{c['acme'].base_url}/v1/states", headers={"Authorization": "Bearer nope-0123456789abcd"})
    assert wrong.status_code == 401 and wrong.json()["error"]["message"] == "API key refused"
    assert c["anon"].get("/healthz").status_code == 200       # operations stay open
    assert c["acme"].get("/v1/states").json()["data"] == []


def test_two_tenants_neither_list_find_nor_load_each_other(servers, tmp_path):
    app, c = servers["a"]
    pipe = app.state.kite.runner.pipeline
    up = {who: c[who].post("/v1/states", json={"document": DOC}) for who in ("acme", "beta", "open")}
    # the same document, three states: each tenant's upload made its own (201), none was told of another's
    assert [r.status_code for r in up.values()] == [201, 201, 201], [r.text for r in up.values()]
    ids = {who: r.json()["id"] for who, r in up.items()}
    assert ids == {"acme": pipe.address_of(DOC, tenant="acme").id, "beta": pipe.address_of(DOC, tenant="beta").id,
                   "open": pipe.address_of(DOC).id}                   # no tenant: the address as before tenants
    assert len(set(ids.values())) == 3
    assert c["acme"].post("/v1/states", json={"document": DOC}).status_code == 200   # its own: found
    for who in ("acme", "beta", "open"):
        assert [s["id"] for s in c[who].get("/v1/states").json()["data"]] == [ids[who]]
    # another tenant's state, by its id: exactly as a state nobody made
    never = "e" * 64
    for who, other in (("beta", "acme"), ("acme", "beta"), ("open", "acme"), ("acme", "open")):
        sid = ids[other]
        _same_as_missing(c[who].get(f"/v1/states/{sid}"), c[who].get(f"/v1/states/{never}"), sid, never)
        _same_as_missing(_ask(c[who], sid), _ask(c[who], never), sid, never)
        _same_as_missing(c[who].delete(f"/v1/states/{sid}"), c[who].delete(f"/v1/states/{never}"), sid, never)
    assert _ask(c["acme"], ids["acme"]).status_code == 200     # still there for its owner
    # ids the caller names are the tenant's own: beta's "contract" is not acme's
    named = c["acme"].post("/v1/states", json={"document": DOC, "id": "contract"})
    assert named.status_code == 201
    _same_as_missing(c["beta"].get("/v1/states/contract"), c["beta"].get("/v1/states/nothing"), "contract", "nothing")
    assert c["beta"].post("/v1/states", json={"document": DOC, "id": "contract"}).status_code == 201
    # what YOCO measured on acme's "contract" is acme's record, not beta's nor the server's own
    assert _ask(c["acme"], "contract").status_code == 200
    root = app.state.kite
    views = {who: root.tenants.view(root, who) for who in ("acme", "beta")}
    assert views["acme"].health.records("contract") and not views["beta"].health.records("contract")
    assert root.health.records("contract") == []
    assert views["acme"].runner.novelty is not views["beta"].runner.novelty is not root.runner.novelty
    # on disk: the server's folder keeps its own; each tenant a folder beside it, under its tag
    from kite.tenants import tenant_tag

    folder = tmp_path / "a" / "states"
    assert sorted(p.name for p in folder.glob("*.upc")) == [f"{ids['open']}.upc"]
    assert sorted(p.name for p in (folder / "tenants" / tenant_tag("acme")).glob("*.upc")) == sorted(
        [f"{ids['acme']}.upc", "contract.upc"])


def test_another_server_answers_a_tenant_from_its_part_of_the_shared_store(servers):
    _, ca = servers["a"]
    _, cb = servers["b"]
    sid = ca["acme"].post("/v1/states", json={"document": DOC}).json()["id"]
    never = "d" * 64
    _same_as_missing(_ask(cb["beta"], sid), _ask(cb["beta"], never), sid, never)
    _same_as_missing(_ask(cb["open"], sid), _ask(cb["open"], never), sid, never)
    r = _ask(cb["acme"], sid)                                 # fetched from acme's part of the store
    assert r.status_code == 200, r.text
    assert r.json()["kite"]["state"] == sid
    again = cb["acme"].post("/v1/states", json={"document": DOC})
    assert again.status_code == 200 and again.json()["id"] == sid
    assert cb["beta"].post("/v1/states", json={"document": DOC}).status_code == 201   # beta makes its own


@pytest.mark.parametrize("text,message", [
    ("", "expected a mapping"),
    ("short: acme\n", "key #1 is not a string of at least 16"),
    ("long-enough-key-0001: acme\nlong-enough-key-0002: 'bad tenant'\n", "key #2: tenant 'bad tenant': malformed"),
    ("long-enough-key-0001: ''\n", "key #1: tenant '': empty"),
    ("[a, b]\n", "expected a mapping"),
])
def test_a_bad_api_key_file_is_one_line_exit_2_before_the_model_loads(text, message, tiny_models, tmp_path,
                                                                       monkeypatch):
    from typer.testing import CliRunner

    import kite.model
    from kite.cli.main import app

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kite.model, "load_model", no_load)
    keys = tmp_path / "keys.yaml"
    keys.write_text(text)
    monkeypatch.setenv("KITE_SERVER__API_KEYS_FILE", str(keys))
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_models["llama"]),
                                      "--state-dir", str(tmp_path / "states")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert "long-enough-key" not in result.output and "short" not in result.output   # keys never shown


def test_a_tenant_s_quarantined_state_is_its_own(lm, tmp_path):
    """A state a reader refused for acme is quarantined in acme's view only: beta neither lists it nor
    is refused for it (its own upload of the document loads), /metrics counts it, and an admin lifts it
    naming the tenant."""
    import os

    from tests.test_serve import TOKEN, _start
    from tests.test_serve_quarantine import _damaged_part, _metric
    from kite.tenants import tenant_tag

    root = tmp_path / "q"
    server, _, _ = _start(lm, _settings(root, fusion=True, api_keys=KEYS, admin_token=TOKEN), root)
    acme, beta = (httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {key}"})
                  for key in ("acme-key-0123456789", "beta-key-0123456789"))
    try:
        sid = acme.post("/v1/states", json={"document": DOC}).json()["id"]
        path = root / "states" / "tenants" / tenant_tag("acme") / f"{sid}.upc"
        damaged = path.with_name(".damaged.tmp")
        damaged.write_bytes(_damaged_part(path.read_bytes()))
        os.replace(damaged, path)
        refused = _ask(acme, sid)
        assert refused.status_code == 422 and "quarantined" in refused.json()["error"]["message"], refused.text
        assert {s["id"]: s["quarantined"] for s in acme.get("/v1/states").json()["data"]} == {sid: True}
        assert "is quarantined" in _ask(acme, sid).json()["error"]["message"]
        # beta: not listed, named it is a state nobody made; its own state of the document loads
        assert beta.get("/v1/states").json()["data"] == []
        _same_as_missing(_ask(beta, sid), _ask(beta, "f" * 64), sid, "f" * 64)
        own = beta.post("/v1/states", json={"document": DOC}).json()["id"]
        assert own != sid and _ask(beta, own).status_code == 200
        assert {s["id"]: s["quarantined"] for s in beta.get("/v1/states").json()["data"]} == {own: False}
        metrics = httpx.get(f"{server.url}/metrics").text
        assert _metric(metrics, "kite_states_quarantined") == 1
        # the admin lifts it in acme's view; the server's own (no tenant) does not hold it
        auth = {"authorization": f"Bearer {TOKEN}"}
        assert httpx.delete(f"{server.url}/admin/states/{sid}/quarantine", headers=auth).status_code == 404
        bad = httpx.delete(f"{server.url}/admin/states/{sid}/quarantine?tenant=a%20b", headers=auth)
        assert bad.status_code == 400 and "malformed" in bad.json()["error"]["message"]
        lifted = httpx.delete(f"{server.url}/admin/states/{sid}/quarantine?tenant=acme", headers=auth)
        assert lifted.json() == {"id": sid, "lifted": True}
        assert _metric(httpx.get(f"{server.url}/metrics").text, "kite_states_quarantined") == 0
    finally:
        acme.close()
        beta.close()
        server.stop()
