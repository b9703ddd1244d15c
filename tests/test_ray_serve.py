"""`kite serve --replicas` for real: a local Ray cluster (endpoints on 127.0.0.1), two replicas of a tiny
random model sharing one state folder behind the ingress, the state-aware router, a replica killed
under load, the command line. Every process restarted, with a Redis + S3 store: tests/test_ray_store.py."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.ray

from kite.serve import BackgroundServer, ServeSettings, create_app  # noqa: E402
from kite.serve.scale import ReplicaSpec, ScaleSettings  # noqa: E402
from kite.ports import quiet_port  # noqa: E402
from tests.tiny_models import CORPUS  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

RULES = """version: v1
rules:
  - name: default
    condition: true
    action:
      load_all_clusters: true
"""
UPCYCLE = {"compression": {"precision": "exact", "cluster_num": 3, "min_span_tokens": 8, "max_span_tokens": 24}}
SENTENCES = [s.strip() + "." for s in CORPUS.split(".") if s.strip()][:5]
DOCS = [" ".join(SENTENCES[i:] + SENTENCES[:i]) * 2 for i in range(4)]   # 4 documents, 4 states
TOKEN = "replica-admin-token"
PROMPTS = [" The parties", " Paris is", " Any breach", " Once upon", " What is"]


def _settings(root) -> ServeSettings:
    (root / "rules.yaml").write_text(RULES)
    # min_hit_gain -1: every plan loads (answers do not depend on the health the tiny model earns)
    return ServeSettings(state_dir=root / "states", rules_path=root / "rules.yaml", fusion=True,
                         min_hit_gain=-1.0, default_max_tokens=4, admin_token=TOKEN)


class Cluster:
    """Start/stop the replicas (kite.serve.replicas) with KITE_HOME set for them."""

    def __init__(self, model, root, monkeypatch):
        self.spec = ReplicaSpec(str(model), _settings(root), UPCYCLE, tagger=False)
        self.root, self.port = root, quiet_port()
        monkeypatch.setenv("KITE_HOME", str(root / "home"))
        self.cluster = None

    def start(self):
        from kite.serve import replicas

        self.cluster = replicas.start(self.spec, ScaleSettings(replicas=2, stats_period_s=0.5), port=self.port,
                                      num_cpus=2, timeout_s=240)
        self.client = httpx.Client(base_url=self.cluster.url, timeout=120)
        self._wait_for(2)
        return self

    def _wait_for(self, n: int, timeout: float = 120.0):
        return wait_until(lambda: (lambda alive: alive if len(alive) >= n else None)(self.replicas()),
                          timeout, 0.5, f"{n} replicas alive")

    def replicas(self) -> list[dict]:
        return [r for r in self.client.get("/v1/replicas").json()["data"] if r["alive"]]

    def stop(self):
        from kite.serve import replicas

        if self.cluster is not None:
            self.client.close()
            replicas.stop(self.cluster)
            self.cluster = None


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        c = Cluster(tiny_models["llama"], tmp_path_factory.mktemp("replicas"), mp).start()
        try:
            yield c
        finally:
            c.stop()


def _complete(client, state: str, prompt: str, max_tokens: int = 4):
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "kite": {"state": state}})
    return r


def _metric(text: str, name: str, replica: str | None = None) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (replica is None or f'replica="{replica}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_state_made_through_one_replica_is_answered_by_the_other_without_recompression(cluster):
    a, b = cluster.replicas()[:2]
    with httpx.Client(base_url=a["url"], timeout=120) as ca, httpx.Client(base_url=b["url"], timeout=120) as cb:
        made = ca.post("/v1/states", json={"document": DOCS[0]})
        assert made.status_code == 201 and made.json()["created"] is True
        sid = made.json()["id"]
        answer = _complete(cb, sid, PROMPTS[0])
        assert answer.status_code == 200, answer.text
        assert answer.json()["kite"]["loaded"] is True
        again = cb.post("/v1/states", json={"document": DOCS[0]})   # the same document through B
        assert again.status_code == 200 and again.json()["created"] is False
        assert _metric(cb.get("/metrics").text, "kite_upcycle_states_total") == 0   # B upcycled nothing
    # and through the ingress: the document's content id routes it, nothing is upcycled again
    via = cluster.client.post("/v1/completions", json={"prompt": PROMPTS[1], "kite": {"document": DOCS[0]}})
    assert via.status_code == 200 and via.json()["kite"]["upcycled"]["created"] is False


def test_requests_about_a_state_go_to_the_replica_holding_it_and_cold_states_spread(cluster):
    c = cluster.client
    sids = [c.post("/v1/states", json={"document": d}).json()["id"] for d in DOCS]
    first = _complete(c, sids[1], PROMPTS[0])
    holder = first.headers["x-kite-replica"]
    # Ray Serve pulls each replica's routing stats (its hot states) into the router every stats
    # period (0.5 s); nothing outside Ray shows when it has, so this waits two periods and a margin
    time.sleep(1.2)
    answered = {_complete(c, sids[1], p).headers["x-kite-replica"] for p in PROMPTS}
    assert answered == {holder}
    cold = [f"cold-{i}" for i in range(12)]
    for i, sid in enumerate(cold):   # never made: 404, but routed to their rendezvous homes first
        assert _complete(c, sid, PROMPTS[0]).status_code == 404
    homes = {_complete(c, sid, PROMPTS[0]).headers["x-kite-replica"] for sid in cold}
    assert len(homes) == 2


def test_metrics_are_per_replica_and_aggregated_at_the_endpoint(cluster):
    text = cluster.client.get("/metrics").text
    ids = {r["id"] for r in cluster.replicas()}
    assert re.search(r"^kite_replicas 2(\.0)?$", text, re.M)
    for rid in ids:   # every replica's own series, labelled with it
        assert f'replica="{rid}"' in text
        own = httpx.get(f"{next(r['url'] for r in cluster.replicas() if r['id'] == rid)}/metrics").text
        assert _metric(own, "kite_requests_total") <= _metric(text, "kite_requests_total", rid) + 5
    assert _metric(text, "kite_router_requests_total") > 0


def test_a_stream_through_the_endpoint_gives_the_same_text(cluster):
    import json

    c = cluster.client
    sid = c.post("/v1/states", json={"document": DOCS[2]}).json()["id"]
    whole = _complete(c, sid, PROMPTS[3]).json()["choices"][0]["text"]
    pieces, done = [], False
    with c.stream("POST", "/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 4, "stream": True,
                                                   "kite": {"state": sid}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert done and "".join(pieces) == whole


def test_a_rule_reload_through_the_endpoint_reaches_every_replica(cluster):
    c = cluster.client
    auth = {"Authorization": f"Bearer {TOKEN}"}
    before = c.get("/admin/rules/status", headers=auth).json()["sha256"]
    cluster.spec.settings.rules_path.write_text(RULES.replace("version: v1", "version: v7"))
    r = c.post("/admin/rules/reload", json={}, headers=auth)
    assert r.status_code == 200, r.text
    assert r.json()["ok"] is True and r.json()["sha256"] != before
    assert sorted(r.json()["replicas"].values()) == [200, 200]
    for rep in cluster.replicas():   # each replica now decides with the new file
        assert httpx.get(f"{rep['url']}/admin/rules/status", headers=auth).json()["sha256"] == r.json()["sha256"]
    refused = c.post("/admin/rules/reload", json={})   # no token: every replica refuses
    assert refused.status_code in (401, 403) and set(refused.json()["replicas"].values()) == {refused.status_code}


def _reference_answers(tiny_models, root, keys, store_url=None):
    """Greedy answers of one plain server (no Ray) over the same state folder (and store)."""
    import torch

    from kite.model import load_model
    from kite.upcycle import Pipeline, UpcycleConfig, compress_settings

    torch.set_num_threads(1)
    lm = load_model(str(tiny_models["llama"]), device="cpu")
    cfg = UpcycleConfig.model_validate(UPCYCLE)
    pipe = Pipeline(lm=lm, tagger=None, settings=compress_settings(cfg), config=cfg, config_path=None)
    out = {}
    settings = _settings(root)
    if store_url:
        settings.store_url = store_url
    with BackgroundServer(create_app(pipe, settings, start_sampler=False)) as url:
        with httpx.Client(base_url=url, timeout=120) as c:
            for sid, prompt in keys:
                r = _complete(c, sid, prompt)
                assert r.status_code == 200, r.text
                out[(sid, prompt)] = r.json()["choices"][0]["text"]
    return out


def test_killing_a_replica_under_200_requests_loses_none_and_answers_right(cluster, tiny_models):
    kill_a_replica_under_load(cluster, tiny_models)


def kill_a_replica_under_load(cluster, tiny_models, store_url=None):
    """200 requests from 8 clients; the replica answering most is killed after 40: none lost, every
    answer the plain server's, and Ray Serve brings a replica back."""
    import ray

    c = cluster.client
    sids = [c.post("/v1/states", json={"document": d}).json()["id"] for d in DOCS]
    keys = [(s, p) for s in sids for p in PROMPTS]
    want = _reference_answers(tiny_models, cluster.root, keys, store_url)
    jobs = [keys[i % len(keys)] for i in range(200)]
    done, finished = [], []
    lock = threading.Lock()

    def one(key):
        with httpx.Client(base_url=cluster.cluster.url, timeout=180) as client:
            r = _complete(client, *key)
        with lock:
            done.append(r.headers.get("x-kite-replica"))
            finished.append((time.monotonic(), r.headers.get("x-kite-replica")))
        return key, r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, k) for k in jobs]
        wait_until(lambda: len(done) >= 40, 300, 0.05, "40 answers")
        with lock:
            recent = done[-8:]
        busy = max(set(recent), key=recent.count)   # the replica answering most just now: it has work in flight
        victim = next(n["name"] for n in ray.util.list_named_actors(all_namespaces=True)
                      if n["name"].endswith(f"kite-replica#{busy}"))
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        killed_at = time.monotonic()
        results = [f.result() for f in futures]
    lost = [r for r in results if r[1] != 200]
    wrong = [r for r in results if r[1] == 200 and r[2] != want[r[0]]]
    assert lost == [] and wrong == [], (lost[:3], wrong[:3])
    assert len(results) == 200
    # the kill took effect: nothing came from the victim after it, and many requests came after it
    late = [rid for t, rid in finished if t > killed_at + 0.5]
    assert busy not in late and len(late) >= 40
    retried = _metric(c.get("/metrics").text, "kite_router_retries_total")
    print(f"calls the ingress retried after the kill: {retried:g} (Ray Serve re-routes some itself)")
    alive = cluster._wait_for(2, timeout=120)   # Ray Serve brings a replica back in its place
    assert busy not in {r["id"] for r in alive}


def test_kite_serve_replicas_autoscaled_from_the_command_line_serves_and_stops_on_ctrl_c(tiny_models, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    settings = _settings(tmp_path)
    cfg = tmp_path / "upcycle.yaml"
    cfg.write_text("compression: {precision: exact, cluster_num: 3, min_span_tokens: 8, max_span_tokens: 24}\n"
                   "semantic_tagging: {labels: [], generated_examples_per_label: 0}\n")
    port = quiet_port()
    # autoscaled between 2 and 3 replicas (Ray Serve's autoscaler with the config's bounds), starting at 2
    env = {**os.environ, "KITE_HOME": str(tmp_path / "home"), "KITE_FEATURES__UPCYCLE_YOCO_FUSION": "true",
           "KITE_SERVER__MIN_REPLICAS": "2", "KITE_SERVER__MAX_REPLICAS": "3"}
    proc = subprocess.Popen([sys.executable, "-m", "kite.cli.main", "serve", "--replicas", "2", "--model",
                             str(tiny_models["llama"]), "--rules", str(settings.rules_path), "--upcycle-config", str(cfg),
                             "--state-dir", str(tmp_path / "states"), "--mkdir", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            # Ctrl-C reaches a foreground server; a test run from a background job
                            # (`make test &`) would hand its ignored SIGINT on to the child
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    url = f"http://127.0.0.1:{port}"
    try:
        def two_alive() -> bool:
            assert proc.poll() is None, proc.stdout.read()
            try:
                return len([r for r in httpx.get(f"{url}/v1/replicas", timeout=5).json()["data"] if r["alive"]]) == 2
            except (httpx.HTTPError, ValueError, KeyError):
                return False

        wait_until(two_alive, 240, 1, "kite serve --replicas 2 to come up")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 3,
                                                      "kite": {"document": DOCS[0]}}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["kite"]["upcycled"]["created"] is True and r.json()["kite"]["loaded"] is True
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()     # no Ray head left behind for the next tests to join
            out, _ = proc.communicate()
            subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True)
            pytest.fail(f"kite serve --replicas did not stop within 120 s of Ctrl-C:\n{out[-2000:]}")
    assert proc.returncode == 0, out
    assert "serving" in out and "replicas autoscaled 2-3" in out and "stopping replicas" in out
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/v1/replicas", timeout=3)
