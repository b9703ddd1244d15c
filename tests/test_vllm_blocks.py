"""What the vLLM connector design (docs/vllm-connector.md) can be tested for without vLLM or a GPU:
how a state's tokens map to a request's paged blocks, how many it offers, and block names."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kite.errors import BadInput
from kite.serve.vllm_blocks import (SlotRun, block_key, blocks_for, cluster_runs, covered_prefix, loadable_tokens,
                                    slot_mapping, slot_runs)


def test_the_covered_prefix_is_where_the_first_hole_starts():
    assert covered_prefix([[10, 20], [0, 10], [30, 40]], 40) == 20
    assert covered_prefix([[0, 15], [5, 25]], 40) == 25      # overlaps count once
    assert covered_prefix([[4, 20]], 40) == 0                # token 0 missing: nothing to offer
    assert covered_prefix([[0, 50]], 40) == 40
    assert covered_prefix([], 40) == 0


def test_the_offer_is_whole_blocks_short_of_the_last_prompt_token_past_what_vllm_holds():
    assert loadable_tokens(100, 150, 16) == 96
    assert loadable_tokens(100, 150, 16, num_computed=32) == 64
    assert loadable_tokens(100, 150, 16, num_computed=96) == 0
    assert loadable_tokens(96, 96, 16) == 80                  # the whole prompt: its last token is computed
    assert loadable_tokens(97, 97, 16) == 96
    assert loadable_tokens(15, 200, 16) == 0                  # less than one block
    with pytest.raises(BadInput, match="block size"):
        loadable_tokens(10, 20, 0)


def test_slot_runs_split_a_range_at_block_boundaries():
    assert slot_runs(5, 40, [7, 3, 9], 16) == [SlotRun(0, 7, 5, 5, 16), SlotRun(1, 3, 0, 16, 32),
                                               SlotRun(2, 9, 0, 32, 40)]
    assert slot_runs(16, 16, [7, 3], 16) == []
    with pytest.raises(BadInput, match="passes the block table"):
        slot_runs(0, 49, [7, 3, 9], 16)
    with pytest.raises(BadInput, match="need 0"):
        slot_runs(10, 5, [7], 16)
    assert blocks_for(33, 16) == 3 and blocks_for(32, 16) == 2


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_slot_mapping_is_vllms_block_id_times_size_plus_offset(block_size):
    block_ids = [11, 2, 40, 7, 5, 19, 3, 8, 21, 30]
    n = len(block_ids) * block_size
    for start, end in [(0, n), (3 % n, n - 1), (block_size, 2 * block_size)]:
        want = [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
        assert slot_mapping(start, end, block_ids, block_size) == want


def test_a_real_states_clusters_fill_each_offered_slot_exactly_once(tiny_contract_state):
    from kite.upcycle import StateFile

    _, _, path = tiny_contract_state
    with StateFile(path) as state:
        meta = state.meta
    n, clusters = meta["n_tokens"], meta["clusters"]
    assert len(clusters) == 3
    block_size = 16
    block_ids = list(range(100, 100 + blocks_for(n + 8, block_size)))[::-1]   # any order vLLM gives
    covered = covered_prefix([r for c in clusters for r in c["token_ranges"]], n)
    assert covered == n   # every cluster loaded: the whole document
    offered = loadable_tokens(covered, n + 8, block_size)   # document + an 8-token query
    assert offered == n - n % block_size
    runs = cluster_runs(clusters, block_ids, block_size, 0, offered)
    written = {}
    for cid, rs in runs.items():
        for r in rs:
            for pos, slot in zip(range(r.start, r.end), r.slots):
                assert pos not in written   # no position twice
                written[pos] = (r.block_id, slot, cid)
    assert sorted(written) == list(range(offered))
    for pos, (block_id, slot, cid) in written.items():
        assert block_id == block_ids[pos // block_size] and slot == pos % block_size
        assert any(a <= pos < b for a, b in next(c for c in clusters if c["id"] == cid)["token_ranges"])
    # one cluster left out: the offer stops at its first token
    first = min(clusters, key=lambda c: c["token_ranges"][0][0])
    later = [c for c in clusters if c is not first]
    assert covered_prefix([r for c in later for r in c["token_ranges"]], n) == 0


def test_block_keys_are_the_same_in_every_process_and_differ_by_block_and_size():
    address = "ab" * 32
    keys = {block_key(address, i, 16) for i in range(50)}
    assert len(keys) == 50
    assert block_key(address, 0, 16) != block_key(address, 0, 32) != block_key("cd" * 32, 0, 32)
    code = f"from kite.serve.vllm_blocks import block_key; print(block_key({address!r}, 7, 16))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout.strip()
    assert other == block_key(address, 7, 16)


def test_a_prompt_matches_a_state_only_when_it_begins_with_the_states_own_tokens(tiny_models, tmp_path):
    """The connector's id check, on a state carrying its content address (kite.upcycle.address)."""
    from kite.model import load_model
    from kite.upcycle import StateFile, check_address, codec
    from kite.upcycle.compress import CompressSettings, compress_document
    from kite.serve.vllm_blocks import prompt_matches
    from tests.tiny_models import CORPUS

    lm = load_model(str(tiny_models["llama"]), device="cpu")
    doc = CORPUS.replace(". ", ".\n\n", 3)
    result = compress_document(lm, doc, tmp_path / "s.upc",
                               CompressSettings(codec=codec.settings_for("exact"), n_clusters=2, min_span_tokens=8,
                                                max_span_tokens=24), address=True)
    with StateFile(tmp_path / "s.upc") as state:
        meta, version = state.meta, state.format_version
    assert check_address(meta, version) == result.address   # the id the router passes, from the bytes
    addr = {**meta["address"], "n_tokens": meta["n_tokens"]}
    ids = lm.tokenizer(doc)["input_ids"]
    query = lm.tokenizer(" Which court?", add_special_tokens=False)["input_ids"]
    assert len(ids) == meta["n_tokens"]
    assert prompt_matches(ids + query, addr) == len(ids)
    assert prompt_matches(ids[:-1], addr) == 0                      # shorter than the document
    assert prompt_matches([ids[0] + 1] + ids[1:] + query, addr) == 0   # another first token
    assert prompt_matches(query + ids, addr) == 0                   # the document, but not first


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_tokens_scattered_into_paged_blocks_read_back_at_their_slots(layout):
    import torch

    from kite.serve.vllm_blocks import scatter_into_blocks

    H, d, bs, n_blocks = 2, 4, 4, 12
    block_ids = [7, 3, 10, 0]                              # the request's block table
    positions = list(range(8, 13)) + list(range(0, 8))     # a load's second cluster came first
    rows = torch.randn(H, len(positions), d, dtype=torch.float32)
    shape = (n_blocks, bs, H, d) if layout == "NHD" else (n_blocks, H, bs, d)
    cache = torch.full(shape, float("nan"), dtype=torch.bfloat16)
    assert scatter_into_blocks(cache, rows, positions, block_ids, bs, layout) == len(positions)
    for t, p in enumerate(positions):
        flat = slot_mapping(p, p + 1, block_ids, bs)[0]
        b, s = divmod(flat, bs)
        got = cache[b, s] if layout == "NHD" else cache[b, :, s]
        assert torch.equal(got, rows[:, t].to(torch.bfloat16))
    written = {divmod(slot_mapping(p, p + 1, block_ids, bs)[0], bs) for p in positions}
    for b in range(n_blocks):                              # nothing else was touched
        for s in range(bs):
            if (b, s) not in written:
                assert torch.isnan((cache[b, s] if layout == "NHD" else cache[b, :, s]).float()).all()


def test_a_scatter_refuses_positions_outside_the_table_repeated_or_not_matching_the_rows():
    import torch

    from kite.serve.vllm_blocks import scatter_into_blocks

    cache = torch.zeros(4, 4, 1, 2)
    with pytest.raises(BadInput, match="pass the block table"):
        scatter_into_blocks(cache, torch.zeros(1, 1, 2), [8], [0, 1], 4)
    with pytest.raises(BadInput, match="repeat"):
        scatter_into_blocks(cache, torch.zeros(1, 2, 2), [1, 1], [0, 1], 4)
    with pytest.raises(BadInput, match="need"):
        scatter_into_blocks(cache, torch.zeros(1, 3, 2), [0, 1], [0, 1], 4)
    with pytest.raises(BadInput, match="layout"):
        scatter_into_blocks(cache, torch.zeros(1, 1, 2), [0], [0], 4, layout="LBNHC")
    assert not cache.any()


def test_a_whole_state_load_scattered_into_paged_blocks_holds_each_tokens_own_kv(tiny_models, tmp_path):
    """A state of the tiny Llama (exact codec, clusters whose token ranges interleave), loaded whole
    by KITE and scattered into a paged buffer in a shuffled block table: the value at each position's slot is the prefill's value
    there (values carry no RoPE, so they name the token), and the keys land in the same slots."""
    import torch

    from kite.model import load_model
    from kite.serve.vllm_blocks import loaded_positions, scatter_into_blocks
    from kite.upcycle import StateFile, capture_kv, codec, load_prefix
    from kite.upcycle.compress import CompressSettings, compress_document
    from tests.tiny_models import CORPUS

    lm = load_model(str(tiny_models["llama"]), device="cpu")
    doc = CORPUS.replace(". ", ".\n\n", 3)
    compress_document(lm, doc, tmp_path / "s.upc", CompressSettings(codec=codec.settings_for("exact"), n_clusters=3,
                                                                    min_span_tokens=8, max_span_tokens=24))
    with StateFile(tmp_path / "s.upc") as state:
        clusters, n = state.meta["clusters"], state.meta["n_tokens"]
    prefix, _ = load_prefix(tmp_path / "s.upc", lm)
    positions = loaded_positions(clusters)
    assert positions == list(range(n))
    assert any(len(c["token_ranges"]) > 1 for c in clusters)              # the clusters interleave
    reference = capture_kv(lm, doc)
    bs = 16
    n_blocks = -(-n // bs)
    block_ids = list(torch.randperm(n_blocks + 5, generator=torch.Generator().manual_seed(0))[:n_blocks].tolist())
    for layer in range(len(prefix.values)):
        H, _, d = prefix.values[layer].shape
        k_cache = torch.zeros(n_blocks + 5, bs, H, d)
        v_cache = torch.zeros(n_blocks + 5, bs, H, d)
        assert scatter_into_blocks(k_cache, prefix.keys[layer], positions, block_ids, bs) == n
        scatter_into_blocks(v_cache, prefix.values[layer], positions, block_ids, bs)
        slots = torch.tensor(slot_mapping(0, n, block_ids, bs))
        v_read = v_cache.reshape(-1, H, d)[slots].permute(1, 0, 2)          # [H, n, d] in document order
        assert torch.allclose(v_read, reference.values[layer], atol=1e-4)
        k_read = k_cache.reshape(-1, H, d)[slots].permute(1, 0, 2)
        assert torch.allclose(k_read.norm(dim=-1), reference.keys_pre[layer].norm(dim=-1), atol=1e-3)  # RoPE keeps norms


def test_a_gather_reads_back_what_a_scatter_wrote_in_either_layout():
    import torch

    from kite.serve.vllm_blocks import gather_from_blocks, scatter_into_blocks

    rows = torch.randn(2, 6, 4)
    positions, table = [9, 2, 3, 8, 0, 15], [5, 1, 6, 2]
    for layout, shape in (("NHD", (8, 4, 2, 4)), ("HND", (8, 2, 4, 4))):
        cache = torch.zeros(shape)
        scatter_into_blocks(cache, rows, positions, table, 4, layout)
        assert torch.equal(gather_from_blocks(cache, positions, table, 4, layout), rows)
    with pytest.raises(BadInput, match="pass the block table"):
        gather_from_blocks(torch.zeros(8, 4, 2, 4), [16], table, 4)


def test_a_kernel_block_table_splits_each_block_in_order():
    from kite.serve.vllm_blocks import kernel_block_table

    assert kernel_block_table([3, 0], 2) == [6, 7, 0, 1]
    assert kernel_block_table([3, 0], 1) == [3, 0]
    with pytest.raises(BadInput, match="ratio"):
        kernel_block_table([1], 0)


def _devices():
    import torch

    return ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("packing", ["halves", "rows"])
def test_a_paged_layer_writes_k_and_v_where_the_backend_reads_them(packing, device):
    """vLLM 0.33's per-layer view [B, H, N, 2d]: FlashAttention-style backends read K from the
    first d of C and V from the rest; the CPU backend reads each (block, head)'s memory as [2N, d],
    K's N rows first. A PagedLayer's writes (host rows into a cache on ``device``, cast to bf16)
    land there, and kernel blocks of N/2 map alike."""
    import torch

    from kite.serve.vllm_blocks import PagedLayer

    B, H, N, d = 6, 2, 4, 3
    keys, values = torch.randn(H, 7, d).bfloat16().float(), torch.randn(H, 7, d).bfloat16().float()
    positions, table = [0, 1, 2, 3, 4, 6, 7], [4, 1]
    for kernel in (N, N // 2):
        view = torch.full((B * N // kernel, H, kernel, 2 * d), float("nan"), dtype=torch.bfloat16, device=device)
        layer = PagedLayer.of(view, packing, d, N)
        assert layer.write(keys, values, positions, table) == 7
        if packing == "halves":
            k_cache, v_cache = view[..., :d], view[..., d:]
        else:
            k_cache, v_cache = view.view(view.shape[0], H, 2 * kernel, d).chunk(2, dim=2)
        for t, p in enumerate(positions):
            kb = table[p // N] * (N // kernel) + (p % N) // kernel
            assert torch.equal(k_cache[kb, :, p % kernel].float().cpu(), keys[:, t])
            assert torch.equal(v_cache[kb, :, p % kernel].float().cpu(), values[:, t])
        assert torch.isnan(k_cache[table[1] * (N // kernel) + (5 % N) // kernel, :, 5 % kernel]).all()  # no token 5
        k, v = layer.read(positions, table)
        assert k.device.type == device
        assert torch.equal(k.float().cpu(), keys) and torch.equal(v.float().cpu(), values)


def test_a_paged_layer_refuses_a_view_it_cannot_split():
    import torch

    from kite.serve.vllm_blocks import PagedLayer

    with pytest.raises(BadInput, match="2·4"):
        PagedLayer.of(torch.zeros(2, 1, 4, 6), "halves", 4, 4)        # C is not 2·head_size
    with pytest.raises(BadInput, match="does not divide"):
        PagedLayer.of(torch.zeros(2, 1, 3, 8), "halves", 4, 4)
    with pytest.raises(BadInput, match="contiguous"):
        PagedLayer.of(torch.zeros(2, 4, 2, 8).transpose(1, 2), "rows", 4, 4)
    with pytest.raises(BadInput, match="halves or rows"):
        PagedLayer.of(torch.zeros(2, 1, 4, 8), "nhd", 4, 4)


def test_connector_settings_come_from_kites_config_and_vllms_extra_config(tmp_path):
    """The config's vllm section gives what kv_connector_extra_config leaves out; a key there wins;
    with neither, the states folder is server.state_dir."""
    from kite.config import KiteConfig
    from kite.errors import BadInput
    from kite.integrations.vllm_settings import ConnectorSettings

    cfg = KiteConfig(vllm={"states": str(tmp_path / "a"), "save": True, "save_min_tokens": 32},
                     server={"state_dir": str(tmp_path / "srv")})
    s = ConnectorSettings.from_extra({"save_min_tokens": 64}, cfg)
    assert (s.states, s.save, s.save_min_tokens, s.save_ratio) == (tmp_path / "a", True, 64, 4.0)
    (tmp_path / "srv").mkdir()
    assert ConnectorSettings.from_extra({}, KiteConfig(server={"state_dir": str(tmp_path / "srv")})).states == \
        tmp_path / "srv"
    with pytest.raises(BadInput, match="not a folder"):
        ConnectorSettings.from_extra({"states": str(tmp_path / "none"), "save": False}, cfg)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_layers_go_to_pinned_host_memory_without_waiting():
    import torch

    from kite.serve.vllm_blocks import to_host

    t = torch.randn(4, 300, 64, device="cuda")
    host = to_host(t)
    event = torch.cuda.Event()
    event.record()
    event.synchronize()
    assert host.is_pinned() and not host.is_cuda and torch.equal(host, t.cpu())
    cpu = torch.ones(2)
    assert to_host(cpu) is cpu
