"""The random-weight models benchmarks time: Qwen2-7B's geometry (28 layers, 28 query / 4 KV heads,
head_dim 128, vocab 152,064, bf16, sdpa), or a tiny one of the same shape for CPU smoke runs.

    cfg, model = random_qwen2("cuda")                        # in memory (gpu_speed, lanes_decode)
    info = write_random_qwen2(folder, "cuda")                # an HF folder `kite serve` can load

The folder's tokenizer is written beside the weights (no hub download): a small byte-level BPE
learnt on KITE's generated contracts (real words, for the clause tagger), then ``<t0>``, ``<t1>``, ...
added as whole tokens up to the model's vocabulary, so a text of N of them from :func:`random_words`
is exactly N tokens and every id the model can emit decodes to text. Random weights say nothing
about quality.
"""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

GEOMETRY = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6)
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4, vocab_size=1000)
SPECIALS = ("<unk>", "<s>", "</s>")          # ids 0, 1, 2: unk, bos, eos


def qwen2_config(small: bool = False, **extra):
    """Qwen2-7B's geometry (``small``: the tiny one), attention through sdpa; ``extra`` overrides."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(**{**GEOMETRY, **(SMALL if small else {}), **extra})
    cfg._attn_implementation = "sdpa"
    return cfg


def random_qwen2(device, small: bool = False, seed: int = 0, **extra):
    """(config, bf16 Qwen2ForCausalLM with random weights on ``device``, in eval mode)."""
    import torch
    from transformers import Qwen2ForCausalLM

    cfg = qwen2_config(small, **extra)
    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(before)
    return cfg, model


@lru_cache(maxsize=4)
def bench_tokenizer(size: int):
    """A tokenizer of exactly ``size`` entries: a byte-level BPE learnt on two generated contracts and
    the test corpus (at most ``min(size // 2, 2000)`` entries: real words for the clause tagger), then
    ``<t0>``, ``<t1>``, ... added as whole tokens up to ``size`` (:func:`random_words`). Qwen2's own
    tokenizer class loads it back unchanged."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kite.data.contracts import generate_contracts
    from kite.testing.corpus import CORPUS

    text = " ".join([CORPUS, *(c["text"] for c in generate_contracts(2, tokens=900, seed=7))])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(size // 2, 2000), special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    learnt = tok.get_vocab_size()
    tok.add_tokens([AddedToken(f"<t{i}>", normalized=False) for i in range(size - learnt)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>"), size - learnt


def random_words(n: int, size: int, rng: random.Random) -> str:
    """``n`` of the added tokens of :func:`bench_tokenizer` (``size`` entries), drawn uniformly and
    written without spaces: exactly ``n`` tokens."""
    fillers = bench_tokenizer(size)[1]
    return "".join(f"<t{rng.randrange(fillers)}>" for _ in range(n))


def write_random_qwen2(folder: Path, device, small: bool = False, seed: int = 0) -> dict:
    """Write a random-weight Qwen2 (:func:`random_qwen2`, bf16 safetensors) and its word-level
    tokenizer into ``folder``; free the model. Returns what a floor needs: the parameters, the bytes
    a decode step reads of them (everything but the input embedding), the KV bytes of one token."""
    import torch

    cfg, model = random_qwen2(device, small, seed, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                              tie_word_embeddings=False)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.model.embed_tokens.weight.numel()
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="4GB")
    bench_tokenizer(cfg.vocab_size)[0].save_pretrained(folder)
    del model
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    d = cfg.hidden_size // cfg.num_attention_heads
    return {"params": n_params, "weights_read_bytes": (n_params - n_embed) * 2,
            "kv_bytes_per_token": 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * d * 2,
            "vocab_size": cfg.vocab_size, "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads,
            "head_dim": d, "tokenizer": "byte-level BPE of a generated contract + <tN> added tokens, written beside the weights"}
