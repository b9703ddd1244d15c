"""Generation: prefill the prompt after an optional state prefix, then decode token by token."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from kite.runtime.cache import KVPrefix, new_cache
from kite.runtime.decoding import (GenerationResult, SequenceDecode, check_request, nll_bits,
                                   prompt_nll_nats)

__all__ = ["GenerationResult", "cache_kwarg", "encode_prompt", "forward_tokens", "generate"]


def encode_prompt(tokenizer, prompt: str, chat: bool, system: str | None = None,
                  add_special_tokens: bool = True) -> list[int]:
    """Token ids of `prompt`, through the chat template when `chat`."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            from kite.errors import BadInput

            raise BadInput("--chat: this model's tokenizer has no chat template")
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]


def cache_kwarg(model) -> str:
    """transformers 5.x renamed `past_key_values` to `cache`; pass whichever this version takes."""
    if hasattr(model, "get_base_model"):   # a peft model passes the kwarg on to the model it wraps
        model = model.get_base_model()
    cls = type(model)
    name = _CACHE_KWARG.get(cls)
    if name is None:
        import inspect

        params = inspect.signature(model.forward).parameters
        name = _CACHE_KWARG[cls] = "cache" if "cache" in params else "past_key_values"
    return name


_CACHE_KWARG: dict[type, str] = {}


@torch.inference_mode()
def forward_tokens(model, ids: list[int] | torch.Tensor, cache, start_position: int) -> torch.Tensor:
    """Run `ids` through `model` at positions start_position…; returns logits [n, vocab] (fp32)."""
    device = next(model.parameters()).device
    ids_t = torch.as_tensor(ids, device=device).view(1, -1)
    pos = torch.arange(start_position, start_position + ids_t.shape[1], device=device).unsqueeze(0)
    out = model(input_ids=ids_t, position_ids=pos, use_cache=True, **{cache_kwarg(model): cache})
    return out.logits[0].float()


@torch.inference_mode()
def generate(lm, prompt_ids: list[int], *, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, prefix: KVPrefix | None = None,
             on_text: Callable[[str], None] | None = None,
             stop_ids: set[int] | None = None, cache=None,
             prefill_chunk: int | None = None) -> GenerationResult:
    """Generate after `prompt_ids` (and after `prefix`, a loaded state, when given).

    Greedy when temperature is 0. `on_text` receives each new piece of text as it is decoded.
    `cache`: an empty transformers Cache to generate into (e.g. a memory-budgeted one) instead of
    a fresh DynamicCache; not together with `prefix`. `prefill_chunk`: run the prompt through the
    model that many tokens at a time (a budgeted cache then never holds more than its budget plus
    one chunk raw); default one forward. A prefix made for the model's reader adapter switches it on
    for this generation (`reader_adapter` in the result says so).
    """
    reading = lm.reading(prefix is not None and prefix.reader) if hasattr(lm, "reading") else nullcontext(False)
    with reading as reader_on:
        result = _generate(lm, prompt_ids, max_new_tokens, temperature, top_p, seed, prefix, on_text, stop_ids,
                           cache, prefill_chunk)
    result.reader_adapter = bool(reader_on)
    return result


def _generate(lm, prompt_ids, max_new_tokens, temperature, top_p, seed, prefix, on_text, stop_ids, cache,
              prefill_chunk) -> GenerationResult:
    model = lm.model
    start = prefix.next_position if prefix is not None else 0
    check_request(lm, prompt_ids, start, max_new_tokens)
    decode = SequenceDecode(lm.tokenizer, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            seed=seed, stop_ids=stop_ids if stop_ids is not None else lm.eos_ids(),
                            on_text=on_text)
    if cache is not None and prefix is not None:
        raise ValueError("give a prefix or a cache, not both")
    if cache is None:
        # the cache reserves what this generation will hold: each token's keys and values are written
        # in place, the prefix not copied again at every step
        cache = new_cache(model, prefix, reserve=start + len(prompt_ids) + max_new_tokens)
    step = prefill_chunk if prefill_chunk and prefill_chunk > 0 else len(prompt_ids)
    nll_sum = 0.0  # nats, over prompt tokens 1.. (each predicted by the position before it)
    for at in range(0, len(prompt_ids), step):
        prompt_logits = forward_tokens(model, prompt_ids[at:at + step], cache, start + at)
        nll_sum += prompt_nll_nats(prompt_logits, prompt_ids[at + 1:at + 1 + len(prompt_logits)])
    pos = start + len(prompt_ids)
    token = decode.take(prompt_logits[-1])
    while token is not None:
        token = decode.take(forward_tokens(model, [token], cache, pos)[-1])
        pos += 1
    return decode.result(prompt_tokens=len(prompt_ids), prefix=prefix,
                         prompt_nll_bits=nll_bits(nll_sum, len(prompt_ids)))
