"""Tiny random models (Llama, Qwen2, Mistral geometries) with a tiny BPE tokenizer, saved as HF folders:
the unit tests' models, and the fuzz benchmark's (benchmarks/fuzz_states.py)."""

from __future__ import annotations

from pathlib import Path

from kite.testing.corpus import CORPUS  # noqa: F401  (the corpus its tokenizer learns; tests import it with these)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: str = "llama", vocab_size: int = 400, layers: int = 3):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    if arch == "llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    if arch == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0)
    if arch == "mistral":
        return MistralConfig(**common, rope_theta=10000.0, sliding_window=None)
    raise ValueError(arch)


def make_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, layers: int = 3) -> Path:
    """Save a random tiny model of `arch` with the tiny tokenizer into `folder`; returns it."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab_size=len(tok), layers=layers))
    with torch.no_grad():  # larger weights than the default init: attention that is not uniform
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder
