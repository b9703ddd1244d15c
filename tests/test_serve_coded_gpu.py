"""`kite serve --resident coded` on a GPU: the prefix cache holds the state coded on the device and the
batcher decodes it through the coded-attention kernel (skipped without CUDA; run on the H200). Kept
apart from tests/test_serve_coded.py so it imports no HTTP stack."""

from __future__ import annotations

import pytest

from kite.runtime.cache import CodedPrefix
from kite.upcycle import StateFile, codec
from kite.upcycle.compress import CompressSettings, compress_document

DOC = ("This Services Agreement is made between Acme Corp and Beta LLC. Payment is due within thirty days "
       "of each invoice. Either party may terminate with sixty days written notice. The agreement is "
       "governed by the laws of Delaware. Confidential information stays confidential for five years. ") * 2
PROMPT = " What does the contract say about payment?"


def test_coded_residency_on_the_gpu_answers_as_raw(tiny_models, tmp_path):
    """The server's path on CUDA (bf16): the prefix cache holds the state coded on the GPU and the
    batcher decodes it through the coded-attention kernel; the prompt's NLL and the greedy text
    match the same state held raw (bf16 rounding apart)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kite.model import load_model
    from kite.serve.batcher import Batcher
    from kite.serve.prefixes import PrefixCache
    from kite.serve.runner import GenOptions

    lm = load_model(str(tiny_models["llama"]), device="cuda")
    path = tmp_path / "pca.upc"
    compress_document(lm, DOC, path, CompressSettings(codec=codec.settings_for(4, joint_heads=False), n_clusters=3,
                                                      min_span_tokens=8, max_span_tokens=24), device="cuda")
    ids = lm.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    results = {}
    with StateFile(path) as state:
        for form in ("raw", "coded"):
            prefix, report = PrefixCache(1 << 30, resident=form).load(state, lm, clusters=None, layers=None,
                                                                      precision=None)
            assert report.resident == form and not report.warnings, report.warnings
            batcher = Batcher(lm, max_batch=2)
            try:
                results[form], _ = batcher.generate(ids, prefix, GenOptions(max_new_tokens=8))
            finally:
                batcher.close()
    assert isinstance(prefix, CodedPrefix) and prefix.layers[0].k_codes.is_cuda
    raw, coded = results["raw"], results["coded"]
    assert raw.prefix_tokens == coded.prefix_tokens > 0
    assert abs(raw.prompt_nll_bits - coded.prompt_nll_bits) <= 0.02 * abs(raw.prompt_nll_bits) + 0.05, \
        (raw.prompt_nll_bits, coded.prompt_nll_bits)
    print(f"prompt NLL raw {raw.prompt_nll_bits:.5f} coded {coded.prompt_nll_bits:.5f} bits; "
          f"text raw {raw.text!r} coded {coded.text!r}")
