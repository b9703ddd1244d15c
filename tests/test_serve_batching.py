"""`kite serve` batches continuously: many concurrent requests over real HTTP, each answered as it
would be alone (its sequential twin), with states, without, refused, and cancelled mid-stream."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_serve import DOC, _settings, _start
from tests.waiting import wait_until
from tests.tiny_models import load_tiny_llama

SECOND_DOC = DOC.replace("Shanghai", "Geneva").replace("supplier", "vendor")


@pytest.fixture(scope="module")
def lm(tiny_models):
    return load_tiny_llama(tiny_models)


@pytest.fixture(scope="module")
def batched(lm, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-batch")
    server, app, _ = _start(lm, _settings(root, fusion=True, max_batch=8), root)
    client = httpx.Client(base_url=server.url, timeout=120)
    yield {"client": client, "app": app, "url": server.url}
    client.close()
    server.stop()


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _requests(states: list[str]) -> list[dict]:
    """50 mixed requests: completions and chats, with each state and without, of different lengths."""
    prompts = [" What is the capital of France?", " Payment?", " Who shall deliver the goods?",
               " Confidential information", " Once upon a time"]
    out = []
    for i in range(50):
        kind = i % 5
        body: dict = {"max_tokens": 4 + (i * 7) % 13}
        if kind == 4:
            body["messages"] = [{"role": "user", "content": prompts[i % 5].strip()}]
        else:
            body["prompt"] = prompts[(i // 5) % 5]
        if kind in (0, 1):
            body["kite"] = {"state": states[kind]}
        out.append(body)
    return out


def _post(client, body: dict):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = client.post(path, json=body)
    return r.status_code, r.json()


def _text(body: dict) -> str:
    ch = body["choices"][0]
    return ch["message"]["content"] if "message" in ch else ch["text"]


def test_fifty_concurrent_mixed_requests_each_match_their_sequential_twin(batched):
    c = batched["client"]
    states = [c.post("/v1/states", json={"document": d}).json()["id"] for d in (DOC, SECOND_DOC)]
    reqs = _requests(states)
    twins = {}
    for body in reqs:   # one at a time: the answers batching must not change
        key = json.dumps(body, sort_keys=True)
        if key not in twins:
            status, out = _post(c, body)
            assert status == 200, out
            twins[key] = (_text(out), out["usage"], out["kite"]["loaded"])
    bad = [{"prompt": " Payment?", "max_tokens": 99999},                       # over the server's limit
           {"prompt": " Payment?", "kite": {"state": "no-such-state"}},         # an unknown state
           {"prompt": "", "max_tokens": 3}]                                      # an empty prompt
    cancelled_before = _metric(c.get("/metrics").text, "kite_batch_cancelled_total")
    steps_before = _metric(c.get("/metrics").text, "kite_batch_steps_total")

    def cancel_mid_stream(i: int) -> str:
        with httpx.Client(base_url=batched["url"], timeout=120) as own:
            with own.stream("POST", "/v1/completions", json={"prompt": " Once upon a time", "max_tokens": 400,
                                                              "stream": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        return line   # the first piece arrived: leave
        return ""

    def one(body):
        with httpx.Client(base_url=batched["url"], timeout=120) as own:
            return _post(own, body)

    with ThreadPoolExecutor(max_workers=len(reqs) + len(bad) + 3) as pool:
        futures = [pool.submit(one, b) for b in reqs]
        refused = [pool.submit(one, b) for b in bad]
        leavers = [pool.submit(cancel_mid_stream, i) for i in range(3)]
        results = [f.result() for f in futures]
        refusals = [f.result() for f in refused]
        left = [f.result() for f in leavers]
    for body, (status, out) in zip(reqs, results):
        assert status == 200, out
        text, usage, loaded = twins[json.dumps(body, sort_keys=True)]
        assert (_text(out), out["usage"], out["kite"]["loaded"]) == (text, usage, loaded), body
    assert [s for s, _ in refusals] == [400, 404, 400]
    assert all(line.startswith("data: ") for line in left)
    # the leavers were dropped from the batch, not decoded to their 400 tokens
    runner = batched["app"].state.kite.runner
    wait_until(lambda: runner.batcher.batch_size == 0, 30, 0.05, "an empty batch")
    assert runner.batcher.batch_size == 0 and runner.batcher.queue_length == 0
    metrics = c.get("/metrics").text
    assert _metric(metrics, "kite_batch_cancelled_total") - cancelled_before == 3
    # requests really decoded together: far fewer steps than tokens, some steps with several rows
    tokens = sum(out["usage"]["completion_tokens"] for _, out in results)
    assert _metric(metrics, "kite_batch_steps_total") - steps_before < tokens
    assert _metric(metrics, 'kite_batch_rows_bucket{le="1.0"}') < _metric(metrics, "kite_batch_rows_count")
    assert "kite_batch_queue_length" in metrics and "kite_batch_size" in metrics
    # every step that ran rows is timed, under its row count
    timed = [x for f in text_string_to_metric_families(metrics) if f.name == "kite_batch_step_seconds"
             for x in f.samples if x.name.endswith("_count")]
    assert sum(x.value for x in timed) == _metric(metrics, "kite_batch_rows_count")
    assert timed and all(int(x.labels["rows"]) >= 1 for x in timed)
    kinds = {x.labels["kind"] for x in timed}
    assert "decode" in kinds and kinds <= {"prefill", "decode", "mixed"} and len(kinds) > 1
    # the two states were loaded once each (the twins did it) and read from the prefix cache since
    assert runner.prefixes.misses == 2 and runner.prefixes.hits >= 20
    # and the server goes on answering
    status, out = _post(c, reqs[0])
    assert status == 200 and _text(out) == twins[json.dumps(reqs[0], sort_keys=True)][0]


def test_streamed_answers_in_a_batch_equal_the_plain_ones(batched):
    c = batched["client"]
    body = {"prompt": " Who shall deliver the goods?", "max_tokens": 12}
    _, plain = _post(c, body)

    def streamed():
        with httpx.Client(base_url=batched["url"], timeout=120) as own:
            with own.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
        return "".join(ch["choices"][0]["text"] for ch in chunks)

    with ThreadPoolExecutor(max_workers=6) as pool:
        texts = list(pool.map(lambda _: streamed(), range(6)))
    assert texts == [_text(plain)] * 6


def test_a_request_larger_than_the_batch_kv_budget_is_refused_alone(lm, tmp_path):
    # a budget of ~1 row of 64 slots: a long request can never fit, a short one still runs
    kv_per_slot = 2 * lm.geometry.n_layers * lm.geometry.n_kv_heads * lm.geometry.head_dim * 4
    server, _, _ = _start(lm, _settings(tmp_path, max_batch=4, batch_kv_gb=64 * kv_per_slot / 1024 ** 3), tmp_path)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": " Payment?", "max_tokens": 300})
            assert r.status_code == 400 and "KV" in r.json()["error"]["message"]
            r = c.post("/v1/completions", json={"prompt": " Payment?", "max_tokens": 3})
            assert r.status_code == 200, r.text
    finally:
        server.stop()


def test_serve_settings_refuse_a_bad_batch(tmp_path):
    from kite.errors import BadInput

    with pytest.raises(BadInput, match="--max-batch 0"):
        _settings(tmp_path, max_batch=0)
    with pytest.raises(BadInput, match="--batch-kv-gb"):
        _settings(tmp_path, batch_kv_gb=0)
    with pytest.raises(BadInput, match="--batch-reserve-tokens 0"):
        _settings(tmp_path, batch_reserve_tokens=0)


def test_the_prefix_cache_keys_on_the_file_version_and_keeps_within_its_bytes(tiny_contract_state, tmp_path):
    import shutil

    from kite.serve.prefixes import PrefixCache
    from kite.upcycle import StateFile

    lm, _, path = tiny_contract_state
    copy = tmp_path / "c.upc"
    shutil.copy(path, copy)
    cache = PrefixCache(max_bytes=1 << 30)
    with StateFile(copy) as st:
        a, rep_a = cache.load(st, lm)
        b, rep_b = cache.load(st, lm)
        c, _ = cache.load(st, lm, clusters=[st.meta["clusters"][0]["label"]])
    assert b is a and rep_b.bytes_read == 0 and "cached" in rep_b.timings_ms and rep_a.bytes_read > 0
    assert c is not a and (cache.hits, cache.misses) == (1, 2)
    shutil.copy(path, tmp_path / "new.upc")
    (tmp_path / "new.upc").replace(copy)          # the same name, another file: loaded again
    with StateFile(copy) as st:
        d, _ = cache.load(st, lm)
    assert d is not a and cache.misses == 3
    small = PrefixCache(max_bytes=a.nbytes())      # room for one: the older one goes
    with StateFile(copy) as st:
        small.load(st, lm)
        small.load(st, lm, clusters=[st.meta["clusters"][0]["label"]])
        small.load(st, lm)
    assert small.misses == 3 and small.nbytes <= a.nbytes()
