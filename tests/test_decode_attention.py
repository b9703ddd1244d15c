"""A CPU batch's decode attention through the native runtime (kite.runtime.attention.decode_rows):
each row over its own first slots, the query heads of a KV head together, the same answer as torch's
attention and, for a row, the same bits whatever rows are beside it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kite.kernels import native
from kite.runtime import attention
from kite.runtime.attention import decode_rows

pytestmark = pytest.mark.skipif(native.cpu() is None, reason="the native runtime is not built (make build-runtime)")


def _batch(rows=5, hq=9, hkv=3, cap=300, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache_k = torch.randn(rows + 2, hkv, cap, d, generator=g)       # a batch cache, its step's rows a view of it
    cache_v = torch.randn(rows + 2, hkv, cap, d, generator=g)
    q = torch.randn(rows, hq, 1, d, generator=g)
    visible = torch.tensor([1, 17, 300, 64, 129][:rows])
    return q, cache_k[1:rows + 1], cache_v[1:rows + 1], visible


def _reference(q, k, v, visible, scale=None):
    out = []
    for b, n in enumerate(visible.tolist()):
        o = F.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], scale=scale,
                                           enable_gqa=True)
        out.append(o.transpose(1, 2))
    return torch.cat(out)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 80)])
def test_each_row_attends_over_its_own_slots_as_torch_does(hq, hkv, d):
    q, k, v, visible = _batch(hq=hq, hkv=hkv, d=d)
    got = decode_rows(q, k, v, visible, scaling=0.11)
    assert got.shape == (5, 1, hq, d)
    assert torch.allclose(got, _reference(q, k, v, visible, scale=0.11), atol=1e-5, rtol=1e-4)
    assert torch.allclose(decode_rows(q, k, v, visible), _reference(q, k, v, visible), atol=1e-5, rtol=1e-4)


def test_a_rows_answer_does_not_depend_on_the_rows_beside_it():
    q, k, v, visible = _batch()
    every = decode_rows(q, k, v, visible)
    for b in range(5):
        alone = decode_rows(q[b:b + 1], k[b:b + 1], v[b:b + 1], visible[b:b + 1])
        assert torch.equal(alone, every[b:b + 1]), b


def test_what_it_does_not_take_is_left_to_the_caller_and_bad_lengths_are_refused():
    q, k, v, visible = _batch()
    assert decode_rows(q.half(), k.half(), v.half(), visible) is None          # fp32 only
    assert decode_rows(q, k.transpose(-1, -2), v, visible) is None             # head dimension not contiguous
    with pytest.raises(native.NativeError, match="bad arguments"):
        decode_rows(q, k, v, torch.tensor([1, 0, 3, 4, 5]))                    # a row that sees no slot
    with pytest.raises(ValueError, match="sees 301 slots of the 300"):
        decode_rows(q, k, v, torch.tensor([1, 2, 301, 4, 5]))                  # past the keys given: never read


def test_a_cpu_batch_decodes_through_it_as_each_sequence_alone(tiny_models, monkeypatch):
    from kite.model import load_model
    from kite.runtime.batch_decode import BatchDecoder
    from kite.runtime.generate import generate

    lm = load_model(str(tiny_models["llama"]), device="cpu")
    prompts = [lm.tokenizer(t, add_special_tokens=False)["input_ids"]
               for t in ("the cat sat on the mat and", "a long time ago in a land", "one two three")]
    alone = [generate(lm, p, max_new_tokens=6, stop_ids=set()).text for p in prompts]
    calls = []
    real = attention.decode_rows
    monkeypatch.setattr(attention, "decode_rows", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    engine = BatchDecoder(lm, max_rows=3)
    handles = [engine.add(p, max_new_tokens=6, stop_ids=set()) for p in prompts]
    results = engine.drain()
    assert [results[h].text for h in handles] == alone
    assert calls and set(calls) <= {1, 2, 3}
