"""KiteConnector's scheduler side inside vLLM's real v1 Scheduler (CPU config, no model run)."""

from __future__ import annotations

from pathlib import Path

from conftest import BLOCK, compress, copy_state, make_request, make_scheduler

QUERY = [5, 6, 7, 8, 9, 10, 11]


def schedule_one(sched, req):
    sched.add_request(req)
    out = sched.schedule()
    loads = [ld for ld in out.kv_connector_metadata.loads if ld.request_id == req.request_id]
    return out.num_scheduled_tokens[req.request_id], loads


def test_a_prompt_that_begins_with_a_states_document_is_served_its_whole_blocks(tiny_llama, doc_state):
    folder, ids = doc_state
    prompt = ids + QUERY
    offered = (len(ids) // BLOCK) * BLOCK       # the document, in whole blocks; the query is computed
    assert offered > 0
    sched = make_scheduler(tiny_llama, folder)
    scheduled, loads = schedule_one(sched, make_request("a", prompt))
    assert scheduled == len(prompt) - offered
    [load] = loads
    assert (load.start, load.end) == (0, offered)
    slots = sorted((r.start, r.end) for runs in load.runs.values() for r in runs)
    assert slots[0][0] == 0 and slots[-1][1] == offered          # every offered token has a slot run
    assert sum(b - a for a, b in slots) == offered
    for runs in load.runs.values():
        for r in runs:
            assert r.block_id == load.block_ids[r.start // BLOCK] and r.offset == r.start % BLOCK


def test_the_offer_stops_at_a_block_boundary_short_of_the_prompts_last_token(tiny_llama, doc_state):
    folder, ids = doc_state
    conn = make_scheduler(tiny_llama, folder).connector
    n = len(ids)
    # the prompt is the document alone: its last token is left to vLLM, then whole blocks
    assert conn.get_num_new_matched_tokens(make_request("b", ids), 0) == (((n - 1) // BLOCK) * BLOCK, False)
    # vLLM's own prefix cache already holds the first block: only the blocks after it are offered
    assert conn.get_num_new_matched_tokens(make_request("c", ids + QUERY), BLOCK) == \
        ((n // BLOCK) * BLOCK - BLOCK, False)
    # the document cut short by one token is not the document
    assert conn.get_num_new_matched_tokens(make_request("d", ids[:-1]), 0) == (0, False)


def test_a_prompt_that_is_not_the_document_gets_no_tokens(tiny_llama, doc_state):
    folder, ids = doc_state
    sched = make_scheduler(tiny_llama, folder)
    prompt = [ids[0] + 1] + ids[1:] + QUERY
    scheduled, loads = schedule_one(sched, make_request("e", prompt))
    assert scheduled == len(prompt) and loads == []


def test_another_models_state_is_never_offered(tiny_qwen, doc_state):
    folder, ids = doc_state                       # made by the tiny Llama; vLLM serves the tiny Qwen2
    sched = make_scheduler(tiny_qwen, folder)
    assert sched.connector.states == []
    scheduled, loads = schedule_one(sched, make_request("f", ids + QUERY))
    assert scheduled == len(ids) + len(QUERY) and loads == []


def test_a_named_state_is_the_only_one_offered(tiny_llama, doc_state):
    folder, ids = doc_state
    conn = make_scheduler(tiny_llama, folder).connector
    [state] = conn.states
    assert conn.get_num_new_matched_tokens(make_request("g", ids + QUERY, {"kite_state": state.address}), 0)[0] > 0
    assert conn.get_num_new_matched_tokens(make_request("h", ids + QUERY, {"kite_state": "0" * 64}), 0) == (0, False)


def test_a_tenants_state_is_offered_to_that_tenant_only(tiny_llama, tmp_path):
    from kite.testing.corpus import CORPUS

    _, ids = compress(tiny_llama, CORPUS, tmp_path / "acme.upc", tenant="acme")
    conn = make_scheduler(tiny_llama, tmp_path).connector
    prompt = ids + QUERY
    assert conn.get_num_new_matched_tokens(make_request("i", prompt), 0) == (0, False)
    assert conn.get_num_new_matched_tokens(make_request("j", prompt, {"kite_tenant": "other"}), 0) == (0, False)
    assert conn.get_num_new_matched_tokens(make_request("k", prompt, {"kite_tenant": "acme"}), 0) == \
        ((len(ids) // BLOCK) * BLOCK, False)


def test_a_corrupt_state_is_left_out_and_a_restart_finds_the_good_one_again(tiny_llama, doc_state, tmp_path):
    folder, ids = doc_state
    good = copy_state(next(Path(folder).glob("*.upc")), tmp_path / "store")
    bad = tmp_path / "store" / "torn.upc"
    data = bytearray(good.read_bytes())
    data[len(data) // 2] ^= 0xFF                   # a flipped byte inside a blob
    bad.write_bytes(bytes(data[: len(data) - 7]))  # and torn short
    for _ in range(2):                             # a fresh scheduler over the same folder: a restart
        conn = make_scheduler(tiny_llama, tmp_path / "store").connector
        assert [s.path.name for s in conn.states] == [good.name]
        assert conn.get_num_new_matched_tokens(make_request("l", ids + QUERY), 0)[0] == (len(ids) // BLOCK) * BLOCK


def test_blocks_the_worker_could_not_fill_are_reported_so_vllm_recomputes_them(tiny_llama, doc_state):
    from kite.integrations.vllm import KiteConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    folder, ids = doc_state
    sched = make_scheduler(tiny_llama, folder)
    sched.add_request(make_request("m", ids + QUERY))
    meta = sched.schedule().kv_connector_metadata
    [load] = meta.loads
    worker = KiteConnector(sched.vllm_config, KVConnectorRole.WORKER, sched.kv_cache_config)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    assert worker.get_block_ids_with_load_errors() == set(load.block_ids[: load.end // BLOCK])
    assert worker.get_block_ids_with_load_errors() == set()      # reported once
