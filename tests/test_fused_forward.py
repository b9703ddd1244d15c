"""The fused forward (kite.model.fused: one RMSNorm kernel, residual add + norm, RoPE of q / k in one
kernel, silu(gate) * up in one, q / k / v and gate / up as one product each) computes what
transformers' Llama-family modules compute: on the CPU through Triton's interpreter (where Triton is
installed), on a GPU at bf16 / fp16, eager and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from kite.model import fused
from kite.runtime.attention import register
from tests.tiny_models import tiny_config
from kite.testing.triton_interpreter import run_interpreted

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def last_place(x: torch.Tensor, dtype) -> float:
    """The last place of the largest |x| in ``dtype`` (bf16: 8 significant bits, fp16: 11)."""
    top = x.float().abs().max().clamp_min(2.0 ** -100)
    return float(torch.exp2(torch.floor(torch.log2(top)))) * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10)


def kernels_vs_modules(device: str, dtypes, places: float, exact: float, rope_exact: float) -> None:
    """Each kernel against the transformers code it stands in for, on fresh random inputs: at fp16 /
    bf16 within ``places`` last places of the largest output, and at least a fraction ``exact`` of the
    elements bit-equal (``rope_exact`` for RoPE: on the H200 78 % of its bf16 outputs were bit-equal
    to torch's, the rest one last place off, as if the compiler kept fewer of the products' roundings
    than torch does; cause not established)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

    from kite.kernels.fused_norm_triton import rms_norm
    from kite.kernels.rope_triton import rope_qkv
    from kite.kernels.silu_mul_triton import silu_mul

    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype):
        return (torch.randn(*shape, generator=g) * 2).to(device, dtype)

    for dtype in dtypes:
        def close(got, ref, what, dtype=dtype, exact=exact):
            assert got.shape == ref.shape and got.dtype == ref.dtype, what
            if dtype == torch.float32:
                err = (got - ref).abs().max().item()
                assert err < 1e-5 * max(1.0, ref.abs().max().item()), (what, err)
            else:
                err = (got.float() - ref.float()).abs().max().item()
                assert err <= places * last_place(ref, dtype), (what, err)
                assert (got == ref).float().mean().item() >= exact, (what, (got == ref).float().mean().item())
            print(f"{what} {dtype}: max abs diff {(got.float() - ref.float()).abs().max().item():.2e}")

        with torch.no_grad():
            norm = Qwen2RMSNorm(300, eps=1e-6).to(device, dtype)
            norm.weight.copy_(rand(300, dtype=dtype))
            x, res = rand(3, 5, 300, dtype=dtype), rand(3, 5, 300, dtype=dtype)
            close(rms_norm(x, norm.weight, 1e-6), norm(x), "rms_norm")
            total, out = rms_norm(x, norm.weight, 1e-6, residual=res)
            close(total, res + x, "residual add")
            close(out, norm(res + x), "residual add + rms_norm")
            gate_up = rand(2, 7, 2 * 1500, dtype=dtype)             # column blocks of one product
            gate, up = gate_up[..., :1500], gate_up[..., 1500:]
            close(silu_mul(gate, up), torch.nn.functional.silu(gate) * up, "silu(gate) * up")
            for B, T, hq, hkv, d, cos_rows in ((2, 3, 4, 2, 16, 1), (1, 5, 6, 2, 32, 1), (2, 4, 2, 2, 64, 2)):
                qkv = rand(B, T, (hq + 2 * hkv) * d, dtype=dtype)
                q = qkv[..., :hq * d].view(B, T, hq, d)
                k = qkv[..., hq * d:(hq + hkv) * d].view(B, T, hkv, d)
                v = qkv[..., (hq + hkv) * d:].view(B, T, hkv, d)
                cos, sin = rand(cos_rows, T, d, dtype=dtype), rand(cos_rows, T, d, dtype=dtype)
                qo, ko, vo = rope_qkv(q, k, v, cos, sin)
                qr, kr = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
                close(qo, qr, "rope q", exact=rope_exact)
                close(ko, kr, "rope k", exact=rope_exact)
                assert torch.equal(vo, v.transpose(1, 2)) and qo.stride() == qr.stride()
                rope_into_slots(q, k, v, cos, sin, qo, ko, vo)


def rope_into_slots(q, k, v, cos, sin, qo, ko, vo) -> None:
    """rope_store gives rope_qkv's q and writes its k and v into a batch cache's slots: token t <
    counts[b] of sequence b at slot starts[b] + t of row rows[b], every head; nothing else written."""
    from kite.kernels.rope_triton import rope_store

    B, T, _, d = q.shape
    hkv = k.shape[2]
    keys = torch.full((B + 2, hkv, T + 6, d), -7.0, dtype=q.dtype, device=q.device)
    values = keys.clone()
    rows = torch.tensor([B + 1 - b for b in range(B)], dtype=torch.int32, device=q.device)
    starts = torch.tensor([2 + b for b in range(B)], dtype=torch.int32, device=q.device)
    counts = torch.tensor([T - b % 2 for b in range(B)], dtype=torch.int32, device=q.device)   # padding too
    got_q = rope_store(q, k, v, cos, sin, keys, values, rows, starts, counts)
    assert torch.equal(got_q, qo) and got_q.stride() == qo.stride()
    want_k, want_v = keys.clone(), values.clone()
    want_k[:], want_v[:] = -7.0, -7.0
    for b in range(B):
        n, r, s0 = int(counts[b]), int(rows[b]), int(starts[b])
        want_k[r, :, s0:s0 + n] = ko[b, :, :n]
        want_v[r, :, s0:s0 + n] = vo[b, :, :n]
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)


def fused_vs_unfused_models() -> None:
    """Tiny Llama / Qwen2 / Mistral (fp32): a prefix then a query through a DynamicCache, logits with
    the fused forwards equal transformers' own; parameters unchanged and held once; hooks on q_proj
    still fire."""
    from transformers import AutoModelForCausalLM, DynamicCache

    for arch in ("llama", "qwen2", "mistral"):
        torch.manual_seed(0)
        cfg = tiny_config(arch, layers=2)
        cfg._attn_implementation = register()
        model = AutoModelForCausalLM.from_config(cfg).eval()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        done = fused.fuse_forward(model, on_cpu=True)
        assert done == fused.Fused(layers=2, qkv_concatenated=2, gate_up_concatenated=2), done
        assert fused.fuse_forward(model, on_cpu=True) == fused.Fused(layers=2)   # idempotent
        after = model.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
        attn = model.model.layers[0].self_attn
        weight, bias, _ = attn._kite_qkv
        assert attn.k_proj.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
        held = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
        assert sum(held.values()) == sum(p.numel() * p.element_size() for p in model.parameters())   # one copy
        doc, query = torch.randint(cfg.vocab_size, (2, 12)), torch.randint(cfg.vocab_size, (2, 5))
        logits, seen = {}, []
        for on in (False, True):
            fused.ENABLED = on
            try:
                with torch.inference_mode():
                    cache = DynamicCache(config=cfg)
                    a = model(doc, past_key_values=cache).logits
                    logits[on] = torch.cat([a, model(query, past_key_values=cache).logits], 1)
                    hook = attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
                    hooked = model(doc).logits    # a capture's hook on q_proj: the separate products run
                    hook.remove()
            finally:
                fused.ENABLED = True
            assert (hooked - a).abs().max().item() < 1e-5
        err = (logits[True] - logits[False]).abs().max().item()
        assert err < 1e-5, (arch, err)
        assert len(seen) == 2
        print(f"{arch}: logits max abs diff {err:.1e}")


def fused_forward_under_a_lora_adapter() -> None:
    """A peft LoRA on q_proj / v_proj / up_proj (a reader adapter): the fused forward keeps the wrapped
    projections' separate products, so the adapter still applies, switched on and off (fp32)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config("qwen2", layers=2)
    cfg._attn_implementation = register()
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg).eval(), LoraConfig(
        r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)).eval()
    assert fused.fuse_forward(model, on_cpu=True) == fused.Fused(layers=2)   # nothing concatenated
    ids = torch.randint(cfg.vocab_size, (1, 30))
    for adapter_on in (True, False):
        (model.base_model.enable_adapter_layers if adapter_on else model.base_model.disable_adapter_layers)()
        logits = {}
        for on in (False, True):
            fused.ENABLED = on
            try:
                with torch.inference_mode():
                    logits[on] = model(input_ids=ids).logits
            finally:
                fused.ENABLED = True
        err = (logits[True] - logits[False]).abs().max().item()
        assert err < 1e-5, (adapter_on, err)
        print(f"LoRA {'on' if adapter_on else 'off'}: logits max abs diff {err:.1e}")


def fused_forward_in_batched_rows() -> None:
    """kite.runtime.batch_decode.forward_rows (the server's batched step: a BatchKVCache, a per-row
    mask, per-row positions): rows prefilling 7 / 3 / 5 tokens, then two of them decoding one, give the
    same logits with the fused forward as without (tiny Llama, fp32)."""
    from transformers import AutoModelForCausalLM

    from kite.runtime.batch_decode import BatchKVCache, forward_rows

    torch.manual_seed(0)
    cfg = tiny_config("llama", layers=2)
    cfg._attn_implementation = register()
    model = AutoModelForCausalLM.from_config(cfg).eval()
    fused.fuse_forward(model, on_cpu=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 3, 5)]
    logits = {}
    for on in (False, True):
        fused.ENABLED = on
        try:
            cache = BatchKVCache(model, max_rows=3)
            rows = [cache.take(None) for _ in prompts]
            got = forward_rows(model, cache, rows, prompts, [0, 0, 0])
            got += forward_rows(model, cache, rows[:2], [[11], [12]], [7, 3])
        finally:
            fused.ENABLED = True
        logits[on] = got
    err = max((a - b).abs().max().item() for a, b in zip(logits[True], logits[False]))
    assert err < 1e-5, err
    print(f"batched rows: logits max abs diff {err:.1e}")


def check_in_the_interpreter() -> None:
    """(Run by run_interpreted.) The interpreter casts fp32 to bf16 by truncation, not rounding to
    nearest as the GPU and torch do: bf16 results may sit a few last places off there."""
    kernels_vs_modules("cpu", (torch.float32, torch.bfloat16), places=4, exact=0.0, rope_exact=0.0)
    fused_vs_unfused_models()
    fused_forward_under_a_lora_adapter()
    fused_forward_in_batched_rows()


@pytest.mark.slow   # Triton's interpreter on the CPU: 13-25 s
def test_fused_kernels_and_forward_equal_transformers_on_the_cpu():
    """In Triton's interpreter: RMSNorm (alone and after the residual add), RoPE of q / k from one
    projection's column blocks (v copied alike), silu(gate) * up, against transformers' code at fp32
    (1e-5) and bf16 (a few last places); whole tiny Llama / Qwen2 / Mistral forwards over a cached
    prefix at fp32 equal the unfused ones to 1e-5, with parameters unchanged and held once; under a
    LoRA adapter (on and off) and in the server's batched rows too."""
    run_interpreted("tests.test_fused_forward:check_in_the_interpreter")


def test_cpu_models_keep_transformers_forward():
    torch.manual_seed(0)
    cfg = tiny_config("qwen2", layers=1)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert fused.fuse_forward(model) is None
    assert "forward" not in vars(model.model.layers[0])


def test_a_head_dim_the_rope_kernel_cannot_block_keeps_transformers_forward():
    """head_dim 48 (halves of 24, not a power of 2): not fused, even where it would be (on_cpu)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama", layers=1)
    cfg.hidden_size, cfg.head_dim = 96, 48
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert fused.fuse_forward(model, on_cpu=True) is None
    assert "forward" not in vars(model.model.layers[0])


# ---- on a GPU (the H200 runs these) ------------------------------------------------------------------


@cuda
def test_gpu_kernels_equal_transformers_modules():
    kernels_vs_modules("cuda", (torch.float32, torch.bfloat16, torch.float16), places=1, exact=0.95, rope_exact=0.5)


def _qwen2(dtype, layers=2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    cfg._attn_implementation = register()
    return cfg, Qwen2ForCausalLM(cfg).to("cuda", dtype).eval()


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_fused_forward_matches_the_unfused_one(dtype):
    """A random Qwen2 prefills 3,000 tokens; a 16-token query's logits through the fused forwards
    (split-KV attention on) equal the unfused ones to bf16 / fp16 rounding; the same inside a CUDA
    graph over a static cache; with autograd on, transformers' forward runs (gradients flow)."""
    from transformers import DynamicCache, StaticCache

    cfg, model = _qwen2(dtype)
    assert fused.fuse_forward(model) == fused.Fused(layers=2, qkv_concatenated=2, gate_up_concatenated=2)
    doc, query = torch.randint(512, (1, 3000), device="cuda"), torch.randint(512, (1, 16), device="cuda")
    logits = {}
    try:
        for on in (False, True):
            fused.ENABLED = on
            with torch.inference_mode():
                cache = DynamicCache(config=cfg)
                model(doc, past_key_values=cache)
                logits[on] = model(query, past_key_values=cache).logits.float()
    finally:
        fused.ENABLED = True
    top = logits[False].abs().max().item()
    diff = (logits[True] - logits[False]).abs().max().item()
    assert diff <= 0.02 * top, (diff, top)

    sc = StaticCache(config=cfg, max_cache_len=3016)
    pos = torch.arange(3000, 3016, device="cuda")[None]
    with torch.inference_mode():
        model(doc, past_key_values=sc)

        def forward():
            for layer in sc.layers:
                if torch.is_tensor(getattr(layer, "cumulative_length", None)):
                    layer.cumulative_length.fill_(3000)
            return model(query, past_key_values=sc, position_ids=pos, cache_position=pos[0]).logits

        eager = forward().float()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward()
        out.fill_(float("nan"))
        graph.replay()
    assert torch.equal(out.float(), eager)
    assert (eager - logits[True]).abs().max().item() <= 0.02 * top

    model.zero_grad()
    model(query).logits.float().sum().backward()       # training: transformers' forward, gradients flow
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


@cuda
def test_gpu_load_model_fuses_the_forward(tiny_models):
    from kite.model import load_model

    loaded = load_model(str(tiny_models["qwen2"]), device="cuda", dtype="bf16")
    assert all(getattr(layer, "_kite_fused", False) for layer in loaded.model.model.layers)
    ids = torch.randint(100, (1, 12), device="cuda")
    with torch.inference_mode():
        on = loaded.model(ids).logits.float()
        fused.ENABLED = False
        try:
            off = loaded.model(ids).logits.float()
        finally:
            fused.ENABLED = True
    assert (on - off).abs().max().item() <= 0.02 * off.abs().max().item()
