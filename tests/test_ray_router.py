"""The state-aware router's policy (kite.serve.router), without Ray: who answers a request, how ties
break, and what it does to the hot-tier hit rate and the load over replicas (a simulated stream of
requests over 20 states with Zipf popularity)."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kite.errors import BadInput
from kite.serve.router import ReplicaView, hot_ids, rank, rendezvous, route_key
from kite.serve.scale import ScaleSettings


def test_a_request_goes_to_the_replica_holding_its_state_hot():
    views = [ReplicaView("a", frozenset({"s1"}), queued=2), ReplicaView("b", frozenset(), queued=0)]
    assert rank("s1", views)[0] == "a"


def test_a_holder_whose_queue_is_too_long_loses_the_request_to_the_least_loaded():
    views = [ReplicaView("a", frozenset({"s1"}), queued=5), ReplicaView("b", frozenset(), queued=0)]
    assert rank("s1", views, max_imbalance=4)[0] == "b"
    assert rank("s1", views, max_imbalance=5)[0] == "a"


def test_without_a_holder_the_least_loaded_answers():
    views = [ReplicaView("a", queued=3), ReplicaView("b", queued=1), ReplicaView("c", queued=2)]
    assert rank("cold", views) == ["b", "c", "a"]


def test_ties_break_by_rendezvous_hash_the_same_every_time():
    views = [ReplicaView(r) for r in ("r1", "r2", "r3", "r4")]
    for key in ("s1", "s2", "doc-00ff"):
        home = max(("r1", "r2", "r3", "r4"), key=lambda r: rendezvous(key, r))
        assert rank(key, views)[0] == home
        assert rank(key, list(reversed(views)))[0] == home   # not the order replicas are listed in
    homes = {rank(f"s{i}", views)[0] for i in range(40)}
    assert homes == {"r1", "r2", "r3", "r4"}   # cold states spread over every replica


def test_a_replica_that_leaves_moves_only_its_own_states():
    views = [ReplicaView(r) for r in ("r1", "r2", "r3")]
    before = {f"s{i}": rank(f"s{i}", views)[0] for i in range(60)}
    after = {k: rank(k, views[:2])[0] for k in before}
    moved = {k for k in before if before[k] != after[k]}
    assert moved == {k for k, r in before.items() if r == "r3"}


def test_the_route_key_is_the_named_state_or_the_documents_content_id():
    from kite.serve.states import StateStore

    assert route_key({"prompt": "x", "kite": {"state": "s1"}}, "fp") == "s1"
    assert route_key({"prompt": "x", "kite": {"document": "doc text"}}, "fp") == StateStore.id_for("doc text", "fp")
    assert route_key({"document": "doc text", "id": "mine"}, "fp") == "mine"   # an upload with its id
    assert route_key({"document": "doc text"}, "fp") == StateStore.id_for("doc text", "fp")
    assert route_key({"prompt": "x"}, "fp") is None
    assert route_key(None, "fp") is None
    assert route_key([1, 2], "fp") is None


def test_hot_ids_are_the_state_files_directly_in_the_store(tmp_path):
    root = tmp_path.resolve()
    paths = [str(root / "a.upc"), str(root / "sub" / "b.upc"), str(root / "c.txt"), "/elsewhere/d.upc"]
    assert hot_ids(paths, root) == {"a"}


def test_replica_bounds_are_checked():
    assert ScaleSettings(replicas=2).deployment_options() == {"num_replicas": 2}
    auto = ScaleSettings(replicas=2, min_replicas=1, max_replicas=4).deployment_options()["autoscaling_config"]
    assert (auto["min_replicas"], auto["initial_replicas"], auto["max_replicas"]) == (1, 2, 4)
    with pytest.raises(BadInput, match="give both"):
        ScaleSettings(replicas=2, min_replicas=1)
    with pytest.raises(BadInput, match="min_replicas"):
        ScaleSettings(replicas=5, min_replicas=1, max_replicas=4)


# -- the hit-rate test: a simulated stream -----------------------------------------------------

N_STATES, N_REQUESTS, CAPACITY = 20, 4000, 8   # CAPACITY: states one replica's memory holds


def _zipf_stream(n: int, s: float = 1.0, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** s for i in range(N_STATES)]
    return rng.choices([f"state-{i:02d}" for i in range(N_STATES)], weights=weights, k=n)


class _Replica:
    """A replica in the simulation: an LRU hot tier of `capacity` states and a FIFO queue; a
    request takes 1 time unit when its state is hot, 3 when it must be loaded."""

    def __init__(self, rid: str, capacity: int):
        self.id, self.capacity = rid, capacity
        self.lru: OrderedDict[str, None] = OrderedDict()
        self.busy_until = 0.0
        self.finishing: list[float] = []
        self.served = self.hits = 0

    def queued(self, now: float) -> int:
        self.finishing = [t for t in self.finishing if t > now]
        return len(self.finishing)

    def take(self, key: str, now: float) -> None:
        hit = key in self.lru
        self.served += 1
        self.hits += hit
        if hit:
            self.lru.move_to_end(key)
        else:
            self.lru[key] = None
            if len(self.lru) > self.capacity:
                self.lru.popitem(last=False)
        self.busy_until = max(self.busy_until, now) + (1.0 if hit else 3.0)
        self.finishing.append(self.busy_until)


def _simulate(n_replicas: int, capacity: int, choose, gap: float) -> list[_Replica]:
    replicas = [_Replica(f"replica-{i}", capacity) for i in range(n_replicas)]
    for i, key in enumerate(_zipf_stream(N_REQUESTS)):
        now = i * gap
        views = [ReplicaView(r.id, frozenset(r.lru), r.queued(now)) for r in replicas]
        rid = choose(key, views, i)
        next(r for r in replicas if r.id == rid).take(key, now)
    return replicas


def _rate(replicas: list[_Replica]) -> float:
    return sum(r.hits for r in replicas) / sum(r.served for r in replicas)


@pytest.mark.parametrize("gap", [0.9, 2.5])   # busy (both replicas needed) and light load
def test_router_keeps_90_percent_of_one_big_replicas_hit_rate_and_no_replica_takes_over_65_percent(gap):
    # one replica with the memory of both (its hit rate depends on the order of requests only)
    one = _rate(_simulate(1, 2 * CAPACITY, lambda k, v, i: v[0].id, gap=gap))
    routed = _simulate(2, CAPACITY, lambda k, v, i: rank(k, v, tiebreak=str(i))[0], gap=gap)
    round_robin = _simulate(2, CAPACITY, lambda k, v, i: v[i % 2].id, gap=gap)
    share = max(r.served for r in routed) / N_REQUESTS
    assert _rate(routed) >= 0.9 * one, (_rate(routed), one)
    assert share <= 0.65, share
    assert _rate(routed) > _rate(round_robin)   # state-aware routing is what keeps the hit rate


def test_kite_serve_refuses_bad_replica_bounds_before_loading_anything(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from kite.cli.main import app

    monkeypatch.setenv("KITE_SERVER__MIN_REPLICAS", "1")
    r = CliRunner().invoke(app, ["serve", "--replicas", "2", "--state-dir", str(tmp_path), "--mkdir"],
                           prog_name="kite")
    assert r.exit_code == 2, r.output
    assert "min_replicas and server.max_replicas" in r.output


def test_a_server_reports_hot_the_states_its_prefix_cache_or_memory_tier_holds(tiny_models, tmp_path):
    """What a replica tells the router (kite.serve.router.hot_states), on a real server without Ray."""
    import httpx
    import torch

    from kite.model import load_model
    from kite.serve import BackgroundServer, create_app
    from kite.serve.router import hot_states
    from tests.test_serve import DOC, _pipeline, _settings

    torch.set_num_threads(1)
    lm = load_model(str(tiny_models["llama"]), device="cpu")
    plain = create_app(_pipeline(lm), _settings(tmp_path / "plain", fusion=True), start_sampler=False)
    stored = create_app(_pipeline(lm), _settings(tmp_path / "stored", fusion=True, store_url="mem://?max=16MB"),
                        start_sampler=False)
    for app in (plain, stored):
        srv = app.state.kite
        with BackgroundServer(app) as url, httpx.Client(base_url=url, timeout=60) as c:
            sid = c.post("/v1/states", json={"document": DOC}).json()["id"]
            # with a store the state is in its memory tier at once; without, nothing is hot yet
            assert hot_states(srv) == ({sid} if srv.store.shared is not None else set())
            r = c.post("/v1/completions", json={"prompt": " Who", "max_tokens": 1, "kite": {"state": sid}})
            assert r.status_code == 200 and r.json()["kite"]["loaded"] is True
            assert hot_states(srv) == {sid}   # its loaded KV is in the prefix cache now
