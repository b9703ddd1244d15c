"""One sequence's decoding after its prompt: sample each next token, stop on an end token or the
length limit, stream the new text, and report a GenerationResult.

`generate()` drives one `SequenceDecode` with its own forwards; the batch engine
(`kite.runtime.batch_decode`) drives many with shared ones. Both go through this module so that a
sequence decoded in a batch is sampled, stopped, streamed and timed exactly as it is alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kite.runtime.cache import KVPrefix


@dataclass
class GenerationResult:
    text: str
    prompt_tokens: int
    new_tokens: int
    prefix_tokens: int
    ttft_ms: float  # from the call to the first new token (prefill of the prompt included)
    total_ms: float
    tokens_per_s: float  # decode speed after the first token
    stop_reason: str  # "eos" | "length" | "cancelled" (the batch engine's cancel)
    # Mean negative log-likelihood (bits) of the prompt's tokens after its first, from the
    # prefill's own logits (None for a one-token prompt): YOCO compares it with and without a
    # state to measure what a load gained (kite.yoco.fused.measured_gain).
    prompt_nll_bits: float | None = None
    reader_adapter: bool = False   # the model's reader adapter was on (a state made for it was read)

    def to_dict(self) -> dict:
        return asdict(self)


def check_request(lm, prompt_ids: list[int], start: int, max_new_tokens: int) -> None:
    """Raise BadInput for an empty prompt, or one that with the state before it (`start` = the
    first live position) and `max_new_tokens` does not fit the model's context."""
    from kite.errors import BadInput

    if not prompt_ids:
        raise BadInput("the prompt is empty")
    limit = lm.geometry.context_length
    if limit and start + len(prompt_ids) + max_new_tokens > limit:
        raise BadInput(f"prompt ({len(prompt_ids)} tokens) + state ({start}) + new tokens asked "
                       f"({max_new_tokens}) exceed the model's context of {limit} tokens")


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    """The next token from fp32 `logits` [vocab]: argmax when temperature is 0, else nucleus sampling
    drawn from `gen` (a seeded generator makes the draw repeatable)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
        probs /= probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen))


def prompt_nll_nats(logits: torch.Tensor, targets: list[int]) -> float:
    """Summed negative log-likelihood (nats) of `targets` under `logits` [≥len(targets), vocab], row i
    predicting targets[i]."""
    if not targets:
        return 0.0
    logp = torch.log_softmax(logits[:len(targets)].float(), dim=-1)
    return -float(logp.gather(1, torch.tensor(targets, device=logp.device)[:, None]).sum())


def nll_bits(nll_nats: float, prompt_tokens: int) -> float | None:
    """Mean bits per predicted prompt token (every token after the first); None for one token."""
    return nll_nats / (prompt_tokens - 1) / math.log(2) if prompt_tokens > 1 else None


def prefix_tokens(prefix: KVPrefix | None) -> int:
    """Tokens a loaded state holds, averaged over layers (layers may hold different numbers)."""
    return sum(prefix.tokens_per_layer()) // max(prefix.n_layers, 1) if prefix else 0


class TextStream:
    """Hands each new piece of decoded text to `on_text` once it is whole (a multi-byte character
    split across tokens waits for its last byte).

    A piece is decoded from the tokens since the last piece with the few before them as context (a
    tokenizer may space a token by what precedes it), the way vLLM detokenizes incrementally: a
    step costs the same however long the answer has grown, not a decode of the whole answer."""

    def __init__(self, tokenizer, on_text: Callable[[str], None] | None):
        self.tokenizer, self.on_text, self.emitted = tokenizer, on_text, ""
        self.context = 0    # first token decoded as context before the new ones
        self.start = 0      # first token whose text has not gone out
        self.finished = False
        self.left: str | None = None   # the end of the text, kept back by finish(emit=False)

    def piece(self, tokens: list[int]) -> str | None:
        """The text of ``tokens`` (every token so far) not yet handed out, once whole; None when there
        is none (or nobody listens). Counted as handed out."""
        if self.on_text is None or self.finished or len(tokens) <= self.start:
            return None
        decode = self.tokenizer.decode
        before = decode(tokens[self.context:self.start], skip_special_tokens=True) if self.start > self.context else ""
        text = decode(tokens[self.context:], skip_special_tokens=True)
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return None
        self.context, self.start = self.start, len(tokens)
        piece = text[len(before):]
        self.emitted += piece
        return piece

    def push(self, tokens: list[int]) -> None:
        piece = self.piece(tokens)
        if piece is not None:
            self.on_text(piece)

    def finish(self, tokens: list[int], emit: bool = True) -> str:
        """The whole text of `tokens`; whatever `on_text` has not had yet goes out now (``emit``
        False: it waits for :meth:`take_left`)."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if self.on_text is not None and not self.finished and len(text) > len(self.emitted):
            rest, self.emitted = text[len(self.emitted):], text
            if emit:
                self.on_text(rest)
            else:
                self.left = rest
        self.finished = True
        return text

    def take_left(self) -> str | None:
        """What :meth:`finish` kept back for the caller to hand out (once)."""
        left, self.left = self.left, None
        return left


class SequenceDecode:
    """The decoding state of one sequence: its new tokens, sampler, stop rule, stream and clock.

    Feed it the logits after each forward with `take`; it answers the token to feed next, or None
    once the sequence has ended (`stop_reason` then says why). `t0` is when the request started
    (time.perf_counter()): time to first token and total time count from it.
    """

    def __init__(self, tokenizer, *, max_new_tokens: int, temperature: float, top_p: float,
                 seed: int | None, stop_ids: set[int], on_text: Callable[[str], None] | None,
                 t0: float | None = None):
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.stop_ids = stop_ids
        self.gen = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
        self.stream = TextStream(tokenizer, on_text)
        self.new: list[int] = []
        self.stop_reason: str | None = None
        self.t0 = time.perf_counter() if t0 is None else t0
        self.t_first: float | None = None

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    @property
    def greedy(self) -> bool:
        """Whether the next token is the logits' argmax (temperature 0): a caller may take the
        argmax where the logits are (:meth:`accept`) instead of handing them over."""
        return self.temperature <= 0

    def take(self, logits: torch.Tensor, *, stream: bool = True) -> int | None:
        """Sample the next token from `logits` [vocab]; the token to feed next, or None when the
        sequence ends here (an end token, which is not kept, or the length limit). ``stream`` False:
        its text waits for :meth:`pending_text` (a batch hands out a step's text all at once)."""
        if len(self.new) >= self.max_new_tokens:
            self.stop_reason = "length"
            return None
        return self.accept(sample_token(logits.float().cpu(), self.temperature, self.top_p, self.gen), stream=stream)

    def accept(self, token: int, *, stream: bool = True) -> int | None:
        """Take ``token`` as the next one (chosen by the caller: the argmax, for a greedy sequence);
        as :meth:`take` answers."""
        if len(self.new) >= self.max_new_tokens:
            self.stop_reason = "length"
            return None
        if self.t_first is None:
            self.t_first = time.perf_counter()
        if token in self.stop_ids:
            self.stop_reason = "eos"
            return None
        self.new.append(token)
        if stream:
            self.stream.push(self.new)
        if len(self.new) == self.max_new_tokens:
            self.stop_reason = "length"
            return None
        return token

    def pending_text(self) -> tuple[Callable[[str], None], str] | None:
        """(on_text, the text of the tokens accepted with ``stream`` False since it was last asked),
        or None when there is none yet (or nobody listens, or the sequence has reported)."""
        piece = self.stream.piece(self.new)
        return None if piece is None else (self.stream.on_text, piece)

    def final_text(self) -> tuple[Callable[[str], None], str] | None:
        """(on_text, the end of the text) that :meth:`result` kept back with ``stream`` False, once."""
        left = self.stream.take_left()
        return None if left is None else (self.stream.on_text, left)

    def cancel(self) -> None:
        if not self.done:
            self.stop_reason = "cancelled"

    def result(self, *, prompt_tokens: int, prefix: KVPrefix | None, prompt_nll_bits: float | None,
               reader_adapter: bool = False, stream: bool = True) -> GenerationResult:
        """The finished sequence's report (its remaining text goes to `on_text` first; ``stream``
        False: to :meth:`final_text`)."""
        end = time.perf_counter()
        total = (end - self.t0) * 1e3
        text = self.stream.finish(self.new, emit=stream)
        t_first = self.t_first if self.t_first is not None else self.t0
        ttft = (t_first - self.t0) * 1e3 if self.t_first is not None else total
        decode_s = time.perf_counter() - t_first
        n = len(self.new)
        return GenerationResult(
            text=text, prompt_tokens=prompt_tokens, new_tokens=n, prefix_tokens=prefix_tokens(prefix),
            ttft_ms=round(ttft, 3), total_ms=round(total, 3),
            tokens_per_s=round((n - 1) / decode_s, 3) if n > 1 and decode_s > 0 else 0.0,
            stop_reason=self.stop_reason or "length", prompt_nll_bits=prompt_nll_bits,
            reader_adapter=reader_adapter)
