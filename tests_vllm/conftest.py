"""vLLM's real v1 scheduler over a CPU config, as vLLM's own connector unit tests build it
(tests/v1/kv_connector/unit/utils.py in vLLM), driving KiteConnector. Runs in .venv-vllm
(`make test-vllm`); pytest's testpaths leave this folder out of `make test`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

BLOCK = 16


@pytest.fixture(autouse=True, scope="session")
def kite_home(tmp_path_factory):
    """KITE_HOME of the session's own, and no verification records: nothing read from or written
    to the user's ~/.kite (and a state corrupted by a test is checked again when read)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KITE_HOME", str(tmp_path_factory.mktemp("kite-home")))
        mp.setenv("KITE_VERIFY_RECORD", "0")
        yield


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from kite.testing.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> Path:
    from kite.testing.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "qwen2", arch="qwen2")


def compress(model: Path, text: str, out: Path, tenant: str | None = None) -> tuple[Path, list[int]]:
    """A state of ``text`` on ``model`` (all clusters exact), and the document's token ids."""
    from kite.model import load_model
    from kite.upcycle import codec
    from kite.upcycle.compress import CompressSettings, compress_document

    lm = load_model(str(model), device="cpu")
    kw = {"tenant": tenant} if tenant else {}
    compress_document(lm, text, out, CompressSettings(codec=codec.settings_for("exact"), n_clusters=2,
                                                      min_span_tokens=8, max_span_tokens=24), address=True, **kw)
    return out, lm.tokenizer(text)["input_ids"]


@pytest.fixture(scope="session")
def doc_state(tiny_llama, tmp_path_factory):
    """A folder holding one state of the tiny corpus on the tiny Llama; (folder, token ids)."""
    from kite.testing.corpus import CORPUS

    folder = tmp_path_factory.mktemp("states")
    _, ids = compress(tiny_llama, CORPUS.replace(". ", ".\n\n", 3), folder / "doc.upc")
    return folder, ids


def make_scheduler(model: Path, states: Path, num_blocks: int = 400, max_batched: int = 2048, **extra):
    import torch
    from vllm.config import (AttentionConfig, CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                             SchedulerConfig, VllmConfig)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    mc = ModelConfig(model=str(model), dtype="float32", seed=42, skip_tokenizer_init=True)
    sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_batched, max_model_len=mc.max_model_len,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    cc = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=True)
    kt = KVTransferConfig(kv_connector="KiteConnector", kv_connector_module_path="kite.integrations.vllm",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"states": str(states), **extra})
    vc = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc, kv_transfer_config=kt,
                    device_config=DeviceConfig("cpu"), attention_config=AttentionConfig())
    kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    vc.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=vc, kv_cache_config=kcc, log_stats=True,
                     structured_output_manager=StructuredOutputManager(vc), block_size=BLOCK)


_none_hash = []


def make_request(rid: str, ids: list[int], kv_transfer_params: dict | None = None):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if not _none_hash:
        init_none_hash(sha256)
        _none_hash.append(True)
    sp = SamplingParams(max_tokens=4)
    sp.update_from_generation_config({}, 2)
    req = Request(request_id=rid, prompt_token_ids=list(ids), sampling_params=sp, pooling_params=None,
                  mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    req.kv_transfer_params = kv_transfer_params
    return req


def copy_state(src: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(src, folder / src.name))
