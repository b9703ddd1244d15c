"""KiteConnector's worker side on CPU tensors: states decoded into vLLM 0.33's own per-layer cache
views (built by vLLM's create_kv_cache_views in its KVCacheLayouts) and read back the way vLLM's
attention backends split K from V; prompts saved from those views as states the scheduler then
offers. No model runs in vLLM here (its compiled ops do not load on this CPU)."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import BLOCK, copy_state, make_request, make_scheduler

from kite.errors import BadInput

QUERY = [5, 6, 7, 8, 9, 10, 11]
H, D, LAYERS = 2, 16, 3                 # the tiny Llama's KV geometry
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
NUM_BLOCKS = 64


def vllm_views(layout_name: str, kernel_block: int | None = None) -> dict[str, torch.Tensor]:
    """Per-layer cache views as vLLM 0.33's allocator makes them (one backing buffer, the layers'
    pages placed by the layout), filled with NaN: a slot nobody wrote reads NaN."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=H, head_size=D, dtype=torch.float32)
    page = spec.page_size_bytes
    if layout.is_layer_compact:
        tensor = KVCacheTensor(size=page * NUM_BLOCKS * LAYERS, layers=NAMES, layer_stride=page * NUM_BLOCKS,
                               block_stride=page)
    else:
        tensor = KVCacheTensor(size=page * NUM_BLOCKS * LAYERS, layers=NAMES, layer_stride=page,
                               block_stride=page * LAYERS)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    raw.view(torch.float32).fill_(float("nan"))
    views = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor, kernel_block_size=kernel_block)
    return dict(zip(NAMES, views))


def backend_kv(view: torch.Tensor, packing: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches [kernel blocks, N, H, d] cut from a layer's view the way vLLM's backends do:
    FlashAttention/FlashInfer/Triton/Flex `kv_cache.transpose(1, 2).split(head_size, dim=-1)`, the CPU
    backend `kv_cache.view(B, H, 2N, -1).chunk(2, dim=2)`."""
    if packing == "halves":
        return view.transpose(1, 2).split(D, dim=-1)
    B, Hh, N, _ = view.shape
    k, v = view.view(B, Hh, 2 * N, -1).chunk(2, dim=2)
    return k.transpose(1, 2), v.transpose(1, 2)


def read_back(views, packing: str, positions, block_ids) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) [H, T, d] of the tokens at ``positions`` through the backends' own cut."""
    out = []
    for name in NAMES:
        k, v = backend_kv(views[name], packing)
        n = k.shape[1]                                    # kernel block size
        ratio = BLOCK // n
        pos = torch.as_tensor(list(positions))
        blocks = torch.as_tensor(block_ids)[pos // BLOCK] * ratio + (pos % BLOCK) // n
        slots = pos % n
        out.append((k[blocks, slots].permute(1, 0, 2), v[blocks, slots].permute(1, 0, 2)))
    return out


def worker_for(sched, views, packing: str):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kite.integrations.vllm import KiteConnector

    worker = KiteConnector(sched.vllm_config, KVConnectorRole.WORKER, sched.kv_cache_config)
    worker.register_kv_caches(views, packing={name: packing for name in NAMES})
    return worker


def run_step(worker, meta) -> set[int]:
    """One forward's connector calls, in vLLM's order (kv_connector_model_runner_mixin): bind,
    start_load_kv, per layer wait_for_layer_load then save_kv_layer, wait_for_save, load errors."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for name in NAMES:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, None, None)
    worker.wait_for_save()
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return errors


@pytest.fixture(scope="module")
def kite_rebuilt(tiny_llama, doc_state):
    """KITE's own rebuild of the document's state on the full model (load_prefix): keys after
    RoPE, values, [H, T, d] per layer."""
    from kite.model import load_model
    from kite.upcycle import load_prefix

    folder, _ = doc_state
    prefix, _ = load_prefix(next(folder.glob("*.upc")), load_model(str(tiny_llama), device="cpu"))
    return [(prefix.keys[i], prefix.values[i]) for i in range(LAYERS)]


class Blocks:
    def __init__(self, ids):
        self.ids = list(ids)

    def get_block_ids(self):
        return (self.ids,)


@pytest.mark.parametrize("layout,packing,kernel_block", [
    ("LBNHC", "halves", None),     # FlashAttention's default (NHD)
    ("LBHNC", "halves", None),     # FlashInfer's HND
    ("BLHNC", "halves", None),     # block-outermost (FlashInfer on Blackwell)
    ("LBNHC", "halves", 8),        # each vLLM block split into two kernel blocks
    ("LBHNC", "rows", None),       # the CPU backend's
])
def test_a_load_writes_kites_rebuilt_kv_into_vllms_blocks(tiny_llama, doc_state, kite_rebuilt, layout, packing,
                                                          kernel_block):
    folder, ids = doc_state
    sched = make_scheduler(tiny_llama, folder, num_blocks=NUM_BLOCKS)
    sched.add_request(make_request("a", ids + QUERY))
    meta = sched.schedule().kv_connector_metadata
    [load] = meta.loads
    views = vllm_views(layout, kernel_block)
    worker = worker_for(sched, views, packing)
    assert run_step(worker, meta) == set()
    got = read_back(views, packing, range(load.start, load.end), load.block_ids)
    for (k, v), (k_ref, v_ref) in zip(got, kite_rebuilt):
        torch.testing.assert_close(k, k_ref[:, load.start:load.end], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v, v_ref[:, load.start:load.end], rtol=1e-6, atol=1e-6)
    # the query's slots (computed by vLLM) are not touched
    rest = read_back(views, packing, range(load.end, len(ids) + len(QUERY)), load.block_ids)
    assert all(torch.isnan(k).all() and torch.isnan(v).all() for k, v in rest)


@pytest.mark.parametrize("backend,packing,layout", [
    ("vllm.v1.attention.backends.flash_attn:FlashAttentionBackend", "halves", "LBNHC"),
    ("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend", "rows", "LBHNC"),
])
def test_the_packing_comes_from_the_layers_attention_backend(tiny_llama, doc_state, kite_rebuilt, backend, packing,
                                                            layout):
    """As in a worker: the attention layers sit in vLLM's static forward context, each naming its
    backend class (vLLM's own), and the connector reads the packing from there."""
    import importlib

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    from kite.integrations.vllm import KiteConnector

    module, cls = backend.split(":")
    backend_cls = getattr(importlib.import_module(module), cls)

    class Layer(AttentionLayerBase):
        def get_attn_backend(self):
            return backend_cls

        def get_kv_cache_spec(self, vllm_config):
            return None

    folder, ids = doc_state
    sched, meta = _planned(tiny_llama, folder, ids)
    [load] = meta.loads
    sched.vllm_config.compilation_config.static_forward_context.update({name: Layer() for name in NAMES})
    views = vllm_views(layout)
    worker = KiteConnector(sched.vllm_config, KVConnectorRole.WORKER, sched.kv_cache_config)
    worker.register_kv_caches(views)
    assert run_step(worker, meta) == set()
    got = read_back(views, packing, range(load.start, load.end), load.block_ids)
    for (k, v), (k_ref, v_ref) in zip(got, kite_rebuilt):
        torch.testing.assert_close(k, k_ref[:, load.start:load.end], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v, v_ref[:, load.start:load.end], rtol=1e-6, atol=1e-6)


def test_a_partial_hit_starts_at_the_block_vllm_does_not_hold(tiny_llama, doc_state, kite_rebuilt):
    folder, ids = doc_state
    sched = make_scheduler(tiny_llama, folder, num_blocks=NUM_BLOCKS)
    conn = sched.connector
    req = make_request("p", ids + QUERY)
    n, _ = conn.get_num_new_matched_tokens(req, BLOCK)          # vLLM's prefix cache holds block 0
    assert n == (len(ids) // BLOCK) * BLOCK - BLOCK
    table = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 2 - len(ids) // BLOCK, -1))   # a reversed block table
    conn.update_state_after_alloc(req, Blocks(table), n)
    meta = conn.build_connector_meta(None)
    [load] = meta.loads
    assert (load.start, load.end) == (BLOCK, BLOCK + n)
    views = vllm_views("LBNHC")
    worker = worker_for(sched, views, "halves")
    assert run_step(worker, meta) == set()
    got = read_back(views, "halves", range(BLOCK, BLOCK + n), table)
    for (k, v), (k_ref, v_ref) in zip(got, kite_rebuilt):
        torch.testing.assert_close(k, k_ref[:, BLOCK:BLOCK + n], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v, v_ref[:, BLOCK:BLOCK + n], rtol=1e-6, atol=1e-6)
    held = read_back(views, "halves", range(BLOCK), table)       # vLLM's own block: untouched
    assert all(torch.isnan(k).all() for k, _ in held)


def _planned(tiny_llama, folder, ids):
    sched = make_scheduler(tiny_llama, folder, num_blocks=NUM_BLOCKS)
    sched.add_request(make_request("c", ids + QUERY))
    meta = sched.schedule().kv_connector_metadata
    return sched, meta


def test_a_state_corrupted_after_it_was_offered_is_reported_and_recomputed(tiny_llama, doc_state, tmp_path):
    folder, ids = doc_state
    state = copy_state(next(folder.glob("*.upc")), tmp_path / "store")
    sched, meta = _planned(tiny_llama, tmp_path / "store", ids)
    [load] = meta.loads
    data = bytearray(state.read_bytes())
    data[len(data) - 200] ^= 0xFF                    # a flipped byte in a blob of the last layer
    state.write_bytes(bytes(data))
    views = vllm_views("LBNHC")
    worker = worker_for(sched, views, "halves")
    assert run_step(worker, meta) == load.blocks(BLOCK)


def test_a_state_torn_after_it_was_offered_is_never_written(tiny_llama, doc_state, tmp_path):
    folder, ids = doc_state
    state = copy_state(next(folder.glob("*.upc")), tmp_path / "store")
    sched, meta = _planned(tiny_llama, tmp_path / "store", ids)
    [load] = meta.loads
    state.write_bytes(state.read_bytes()[:-7])
    views = vllm_views("LBNHC")
    worker = worker_for(sched, views, "halves")
    assert run_step(worker, meta) == load.blocks(BLOCK)
    assert all(torch.isnan(v).all() for v in views.values())


def test_a_worker_serving_another_model_refuses_the_state(tiny_llama, tiny_qwen, doc_state):
    folder, ids = doc_state
    _, meta = _planned(tiny_llama, folder, ids)                  # planned by a Llama scheduler
    [load] = meta.loads
    views = vllm_views("LBNHC")
    worker = worker_for(make_scheduler(tiny_qwen, folder, num_blocks=NUM_BLOCKS), views, "halves")
    assert run_step(worker, meta) == load.blocks(BLOCK)
    assert all(torch.isnan(v).all() for v in views.values())


@pytest.mark.parametrize("what", ["unknown backend", "fp8 cache", "tensor parallel heads"])
def test_a_cache_the_connector_cannot_write_turns_loads_into_errors(tiny_llama, doc_state, what):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kite.integrations.vllm import KiteConnector

    folder, ids = doc_state
    sched, meta = _planned(tiny_llama, folder, ids)
    [load] = meta.loads
    views = vllm_views("LBNHC")
    packing = {name: None if what == "unknown backend" else "halves" for name in NAMES}
    if what == "fp8 cache":
        sched.vllm_config.cache_config.cache_dtype = "fp8"
    if what == "tensor parallel heads":
        views = {name: v[:, :1] for name, v in views.items()}        # one of the two KV heads
    worker = KiteConnector(sched.vllm_config, KVConnectorRole.WORKER, sched.kv_cache_config)
    worker.register_kv_caches(views, packing=packing)
    assert worker.saver is None
    assert run_step(worker, meta) == load.blocks(BLOCK)


def test_a_saved_prompt_becomes_a_state_the_next_request_hits(tiny_llama, tmp_path):
    """The prompt's KV (the tiny model's own prefill, written into the blocks as vLLM's forward
    would) is saved from the blocks; the state appears; the next request and a restart hit it."""
    from kite.model import load_model
    from kite.testing.corpus import CORPUS
    from kite.upcycle import apply_rope, capture_kv, load_prefix, rope_cos_sin

    lm = load_model(str(tiny_llama), device="cpu")
    ids = lm.tokenizer(CORPUS)["input_ids"][:150]
    store = tmp_path / "saved"
    extra = dict(save=True, save_ratio="exact", save_min_tokens=64, save_clusters=2)
    sched = make_scheduler(tiny_llama, store, num_blocks=NUM_BLOCKS, **extra)
    sched.add_request(make_request("s", ids))
    meta = sched.schedule().kv_connector_metadata
    assert meta.loads == [] and [sv.request_id for sv in meta.saves] == ["s"]
    [sv] = meta.saves
    # what vLLM's forward leaves in the blocks: every layer's post-RoPE keys and values
    cap = capture_kv(lm, "", ids=ids)
    cos, sin = rope_cos_sin(lm.model, torch.arange(len(ids)))
    views = vllm_views("LBNHC")
    for name, kp, v in zip(NAMES, cap.keys_pre, cap.values):
        k_cache, v_cache = backend_kv(views[name], "halves")
        pos = torch.arange(len(ids))
        blocks, slots = torch.as_tensor(sv.block_ids)[pos // BLOCK], pos % BLOCK
        k_cache[blocks, slots] = apply_rope(kp, cos, sin).permute(1, 0, 2)
        v_cache[blocks, slots] = v.permute(1, 0, 2)
    worker = worker_for(sched, views, "halves")
    assert run_step(worker, meta) == set()
    worker.saver.join()
    assert worker.saver.failed == 0
    [saved] = worker.saver.saved
    assert saved.parent == store and saved.exists()
    # the saved state holds the prompt's KV (the exact codec: as it was)
    prefix, _ = load_prefix(saved, lm)
    for i in range(LAYERS):
        torch.testing.assert_close(prefix.keys[i], apply_rope(cap.keys_pre[i], cos, sin), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(prefix.values[i], cap.values[i], rtol=1e-5, atol=1e-5)
    offered = ((len(ids)) // BLOCK) * BLOCK
    # the same scheduler's next request with the prompt as its document hits, and is not saved again
    assert sched.connector.get_num_new_matched_tokens(make_request("t", ids + QUERY), 0) == (offered, False)
    sched.add_request(make_request("u", ids + QUERY))
    assert sched.schedule().kv_connector_metadata.saves == []
    # a restart over the folder hits too
    again = make_scheduler(tiny_llama, store, num_blocks=NUM_BLOCKS, **extra).connector
    assert again.get_num_new_matched_tokens(make_request("v", ids + QUERY), 0) == (offered, False)
    worker.shutdown()


def test_a_prompt_prefilled_in_chunks_is_saved_in_the_step_its_prefill_ends(tiny_llama, tmp_path):
    sched = make_scheduler(tiny_llama, tmp_path / "s", num_blocks=NUM_BLOCKS, max_batched=64, save=True,
                           save_min_tokens=64)
    ids = [3 + i % 50 for i in range(150)]
    sched.add_request(make_request("x", ids))
    steps = [sched.schedule() for _ in range(3)]
    assert [out.num_scheduled_tokens["x"] for out in steps] == [64, 64, 22]
    assert [len(out.kv_connector_metadata.saves) for out in steps] == [0, 0, 1]
    [sv] = steps[-1].kv_connector_metadata.saves
    assert sv.ids == tuple(ids)
    assert list(sv.block_ids) == list(sched.kv_cache_manager.get_block_ids("x")[0])
    assert len(sv.block_ids) == -(-len(ids) // BLOCK)


def test_a_prompt_whose_request_ends_before_its_prefill_is_saved_by_the_next(tiny_llama, tmp_path):
    from vllm.v1.request import RequestStatus

    sched = make_scheduler(tiny_llama, tmp_path / "s", num_blocks=NUM_BLOCKS, max_batched=64, save=True,
                           save_min_tokens=64)
    ids = [3 + i % 50 for i in range(150)]
    sched.add_request(make_request("a", ids))
    assert sched.schedule().kv_connector_metadata.saves == []
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    sched.add_request(make_request("b", ids))
    saves = [sv.request_id for _ in range(3) for sv in sched.schedule().kv_connector_metadata.saves]
    assert saves == ["b"]


def test_a_malformed_tenant_gets_nothing_and_is_not_saved(tiny_llama, doc_state, tmp_path):
    folder, ids = doc_state
    sched = make_scheduler(tiny_llama, copy_state(next(folder.glob("*.upc")), tmp_path / "s").parent,
                           num_blocks=NUM_BLOCKS, save=True, save_min_tokens=16)
    req = make_request("m", ids + QUERY, {"kite_tenant": "no spaces allowed"})
    assert sched.connector.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.add_request(req)
    out = sched.schedule()
    assert out.kv_connector_metadata.loads == [] and out.kv_connector_metadata.saves == []


def test_a_short_prompt_is_not_saved(tiny_llama, tmp_path):
    sched = make_scheduler(tiny_llama, tmp_path / "s", num_blocks=NUM_BLOCKS, save=True, save_min_tokens=64)
    sched.add_request(make_request("w", list(range(3, 40))))
    assert sched.schedule().kv_connector_metadata.saves == []


@pytest.mark.parametrize("extra,word", [
    ({"save": "yes"}, "save"),
    ({"save_ratio": 0.5}, "save_ratio"),
    ({"save_min_tokens": 0}, "save_min_tokens"),
    ({"sav": True}, "unknown key 'sav'"),
])
def test_a_bad_setting_is_one_clear_error(tiny_llama, doc_state, extra, word):
    folder, _ = doc_state
    with pytest.raises(BadInput, match=word):
        make_scheduler(tiny_llama, folder, **extra)


def test_the_states_folder_must_exist_unless_saving_creates_it(tiny_llama, tmp_path):
    with pytest.raises(BadInput, match="not a folder"):
        make_scheduler(tiny_llama, tmp_path / "missing")
    make_scheduler(tiny_llama, tmp_path / "made", save=True)
    assert (tmp_path / "made").is_dir()
    shutil.rmtree(tmp_path / "made")
