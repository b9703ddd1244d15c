"""Generation: prefill the prompt after an optional state prefix, then decode token by token."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch

from kite.runtime.cache import KVPrefix, new_cache


@dataclass
class GenerationResult:
    text: str
    prompt_tokens: int
    new_tokens: int
    prefix_tokens: int
    ttft_ms: float  # from the call to the first new token (prefill of the prompt included)
    total_ms: float
    tokens_per_s: float  # decode speed after the first token
    stop_reason: str  # "eos" | "length"
    # Mean negative log-likelihood (bits) of the prompt's tokens after its first, from the
    # prefill's own logits (None for a one-token prompt): YOCO compares it with and without a
    # state to measure what a load gained (kite.yoco.fused.measured_gain).
    prompt_nll_bits: float | None = None
    reader_adapter: bool = False   # the model's reader adapter was on (a state made for it was read)

    def to_dict(self) -> dict:
        return asdict(self)


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


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
        probs /= probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen))


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
    if not prompt_ids:
        from kite.errors import BadInput

        raise BadInput("the prompt is empty")
    model, tok = lm.model, lm.tokenizer
    start = prefix.next_position if prefix is not None else 0
    limit = lm.geometry.context_length
    if limit and start + len(prompt_ids) + max_new_tokens > limit:
        from kite.errors import BadInput

        raise BadInput(f"prompt ({len(prompt_ids)} tokens) + state ({start}) + --max-new-tokens "
                       f"({max_new_tokens}) exceed the model's context of {limit} tokens")
    stop_ids = stop_ids if stop_ids is not None else lm.eos_ids()
    gen = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    t0 = time.perf_counter()
    if cache is not None and prefix is not None:
        raise ValueError("give a prefix or a cache, not both")
    cache = cache if cache is not None else new_cache(model, prefix)
    step = prefill_chunk if prefill_chunk and prefill_chunk > 0 else len(prompt_ids)
    nll_sum = 0.0  # nats, over prompt tokens 1.. (each predicted by the position before it)
    for at in range(0, len(prompt_ids), step):
        prompt_logits = forward_tokens(model, prompt_ids[at:at + step], cache, start + at)
        targets = prompt_ids[at + 1:at + 1 + len(prompt_logits)]
        if targets:
            logp = torch.log_softmax(prompt_logits[:len(targets)].float(), dim=-1)
            nll_sum -= float(logp.gather(1, torch.tensor(targets, device=logp.device)[:, None]).sum())
    logits = prompt_logits[-1]
    prompt_nll = nll_sum / (len(prompt_ids) - 1) / math.log(2) if len(prompt_ids) > 1 else None
    pos = start + len(prompt_ids)
    new: list[int] = []
    emitted = ""
    ttft = None
    stop = "length"
    t_first = t0
    for _ in range(max_new_tokens):
        token = _sample(logits.cpu(), temperature, top_p, gen)
        if ttft is None:
            t_first = time.perf_counter()
            ttft = (t_first - t0) * 1e3
        if token in stop_ids:
            stop = "eos"
            break
        new.append(token)
        if on_text is not None:
            text = tok.decode(new, skip_special_tokens=True)
            if len(text) > len(emitted) and not text.endswith("\ufffd"):
                on_text(text[len(emitted):])
                emitted = text
        if len(new) == max_new_tokens:
            break
        logits = forward_tokens(model, [token], cache, pos)[-1]
        pos += 1
    total = (time.perf_counter() - t0) * 1e3
    text = tok.decode(new, skip_special_tokens=True)
    if on_text is not None and len(text) > len(emitted):
        on_text(text[len(emitted):])
    decode_s = time.perf_counter() - t_first
    return GenerationResult(
        text=text, prompt_tokens=len(prompt_ids), new_tokens=len(new),
        prefix_tokens=sum(prefix.tokens_per_layer()) // max(prefix.n_layers, 1) if prefix else 0,
        ttft_ms=round(ttft or total, 3), total_ms=round(total, 3),
        tokens_per_s=round((len(new) - 1) / decode_s, 3) if len(new) > 1 and decode_s > 0 else 0.0,
        stop_reason=stop, prompt_nll_bits=prompt_nll,
    )
