"""bf16 matmuls for throughput passes: close to fp32, and the model is left as it was."""

import pytest
import torch

from kite.runtime.lowp import BF16Linear, bf16_linears


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_linears_close_and_restored(tiny_models, arch):
    from kite.model import load_model

    lm = load_model(str(tiny_models[arch]), device="cpu")
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8]])
    with torch.inference_mode():
        ref = lm.model(ids).logits
        with bf16_linears(lm.model) as m:
            swapped = [mod for mod in m.modules() if isinstance(mod, BF16Linear)]
            low = m(ids).logits
        after = lm.model(ids).logits
    assert swapped and not any(isinstance(mod, BF16Linear) for mod in lm.model.modules())
    assert low.dtype == torch.float32  # the caller's dtype at the boundary
    assert torch.equal(after, ref)  # the fp32 modules are back
    rel = (low - ref).norm() / ref.norm()
    assert 0 < rel < 2e-2  # bf16 rounding: not exact, but close


def test_bf16_linears_restores_on_error(tiny_models):
    from kite.model import load_model

    lm = load_model(str(tiny_models["llama"]), device="cpu")
    before = dict(lm.model.named_modules())
    with pytest.raises(RuntimeError), bf16_linears(lm.model):
        raise RuntimeError("boom")
    assert {n: type(m) for n, m in lm.model.named_modules()} == {n: type(m) for n, m in before.items()}
