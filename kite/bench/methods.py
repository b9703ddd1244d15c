"""The methods a bench run compares, behind one interface (one shared test matrix).

Each method answers a case from the document's full cache (`DocumentContext`) with a budget of
bytes equal to the fused pipeline's state: `prepare` runs once per document (the reusable part:
a state, a quantized or evicted cache), `answer` once per question. Times are what a request
pays: full prefill pays the document's prefill every time; a reusable cache pays its load
(dequantization) and the prompt's prefill; SnapKV, being query-aware, pays the full prefill.
"""

from __future__ import annotations

import abc

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kite.bench.document import DocumentContext, take_tokens
from kite.config import DEFAULT_MIN_HIT_GAIN
from kite.runtime.cache import KVPrefix, new_cache
from kite.runtime.generate import GenerationResult, generate

if TYPE_CHECKING:
    from kite.model import LoadedModel


@dataclass
class Prepared:
    """What a method keeps for one document between questions."""

    kv_bytes: int  # bytes it holds for the document (fp16 for kept tokens, stored size otherwise)
    data: Any = None
    build_ms: float = 0.0
    note: str = ""


@dataclass
class MethodAnswer:
    text: str
    ttft_ms: float
    latency_ms: float  # end to end for the request: load + prompt prefill + decode
    tokens_per_s: float
    new_tokens: int
    kv_bytes: int
    ppl_prefix: KVPrefix | None  # what the reference is teacher-forced after
    ppl_prompt: list[int]
    details: dict = field(default_factory=dict)


def _answer(gen: GenerationResult, before_ms: float, kv_bytes: int, prefix, prompt, **details) -> MethodAnswer:
    return MethodAnswer(gen.text, before_ms + gen.ttft_ms, before_ms + gen.total_ms, gen.tokens_per_s,
                        gen.new_tokens, kv_bytes, prefix, prompt, details)


def fp16_token_bytes(lm: LoadedModel) -> float:
    return lm.geometry.kv_bytes_per_token("fp16")


class Method(abc.ABC):
    name: ClassVar[str]
    equal_bytes: ClassVar[bool] = True  # held to the state's byte budget
    uses_state: ClassVar[bool] = False  # Prepared.data is the document's states.StateRef
    needs_document: ClassVar[bool] = True  # reads the document's full cache (DocumentContext.full)

    def prepare(self, lm: LoadedModel, doc: DocumentContext, budget_bytes: int) -> Prepared:
        return Prepared(kv_bytes=doc.raw_kv_bytes(lm))

    @abc.abstractmethod
    def answer(self, lm: LoadedModel, doc: DocumentContext, prep: Prepared, question: str, prompt: list[int],
               gen: dict) -> MethodAnswer:
        """Answer `question` (tokens `prompt`) about the document with this method's cache."""

    def reference_logits(self, lm: LoadedModel, doc: DocumentContext, ans: MethodAnswer, reference: list[int]) -> torch.Tensor:
        """Logits [len(reference), vocab] of the reference teacher-forced after what the answer
        read (its `ppl_prefix` and `ppl_prompt`)."""
        from kite.bench.scoring import reference_logits

        return reference_logits(lm, ans.ppl_prefix, ans.ppl_prompt, reference)


@dataclass
class FullPrefill(Method):
    """The reference: the whole document at full precision, prefilled for every request."""

    name: ClassVar[str] = "full"
    equal_bytes: ClassVar[bool] = False

    def answer(self, lm: LoadedModel, doc, prep, question, prompt, gen):
        # The document's prefill was measured once (DocumentContext.prefill_ms); the prompt then
        # continues that cache, which gives the same logits as prefilling both at once.
        g = generate(lm, prompt, prefix=doc.full, **gen)
        return _answer(g, doc.prefill_ms, prep.kv_bytes, doc.full, prompt,
                       document_prefill_ms=round(doc.prefill_ms, 3))


@dataclass
class KeepLastWindow(Method):
    """StreamingLLM-style: `sinks` first tokens + the most recent ones, as many as the budget
    buys at fp16. Tokens keep their original positions."""

    name: ClassVar[str] = "window"
    sinks: int = 4

    def prepare(self, lm: LoadedModel, doc, budget_bytes):
        n = doc.n_tokens
        keep = max(1, min(n, round(budget_bytes / fp16_token_bytes(lm))))
        sinks = min(self.sinks, keep)
        idx = torch.cat([torch.arange(sinks), torch.arange(n - (keep - sinks), n)]).unique()
        prefix = take_tokens(doc.full, idx)
        return Prepared(kv_bytes=int(idx.numel() * fp16_token_bytes(lm)), data=prefix,
                        note=f"{sinks} sinks + last {idx.numel() - sinks} of {n} tokens")

    def answer(self, lm: LoadedModel, doc, prep, question, prompt, gen):
        g = generate(lm, prompt, prefix=prep.data, **gen)
        return _answer(g, 0.0, prep.kv_bytes, prep.data, prompt, kept_tokens=int(prep.data.keys[0].shape[1]))


@dataclass
class KiviQuant(Method):
    """KIVI-style int-N of the whole cache (keys per channel, values per token, fp16 residual
    of recent tokens) at the state's bytes; see kite.bench.kivi."""

    name: ClassVar[str] = "kivi"
    group_size: int = 32

    def prepare(self, lm: LoadedModel, doc, budget_bytes):
        from kite.bench.kivi import kivi_at_budget

        t0 = time.perf_counter()
        cache = kivi_at_budget(doc.full, budget_bytes, self.group_size)
        note = (f"int{cache.bits} of {cache.n_quantized} tokens + {doc.n_tokens - cache.first_token - cache.n_quantized}"
                f" fp16 residual" + (f"; {cache.note}" if cache.note else ""))
        return Prepared(cache.nbytes, cache, (time.perf_counter() - t0) * 1e3, note)

    def answer(self, lm: LoadedModel, doc, prep, question, prompt, gen):
        t0 = time.perf_counter()
        prefix = prep.data.to_prefix()
        load_ms = (time.perf_counter() - t0) * 1e3
        g = generate(lm, prompt, prefix=prefix, **gen)
        return _answer(g, load_ms, prep.kv_bytes, prefix, prompt, bits=prep.data.bits,
                       load_ms=round(load_ms, 3))


@dataclass
class SnapKV(Method):
    """SnapKV-style attention-score selection: observation window = the last `window` prompt
    tokens, scores avg-pooled over `kernel` tokens, top tokens per layer and KV head."""

    name: ClassVar[str] = "snapkv"
    window: int = 32
    kernel: int = 7

    def prepare(self, lm: LoadedModel, doc, budget_bytes):
        keep = max(1, min(doc.n_tokens, round(budget_bytes / fp16_token_bytes(lm))))
        return Prepared(kv_bytes=int(keep * fp16_token_bytes(lm)), data=keep,
                        note=f"{keep} of {doc.n_tokens} tokens per layer and head")

    @torch.inference_mode()
    def answer(self, lm: LoadedModel, doc, prep, question, prompt, gen):
        from kite.bench.snapkv import capture_queries, select
        from kite.runtime.cache import cache_layers
        from kite.runtime.generate import forward_tokens

        head, last = prompt[:-1], prompt[-1:]
        t0 = time.perf_counter()
        window = max(1, min(self.window, len(head)))
        if head:
            cache = new_cache(lm.model, doc.full)
            with capture_queries(lm.model, window) as queries:
                forward_tokens(lm.model, head, cache, doc.n_tokens)
            layers = cache_layers(cache)
            T = doc.n_tokens
            win_keys = [k[0][:, T + len(head) - window:T + len(head)] for k, _ in layers]
            picks = select(doc.full, queries, win_keys, prep.data, self.kernel)
            chosen = take_tokens(doc.full, picks)
            keys = [torch.cat([ck, k[0][:, T:]], dim=1) for ck, (k, _) in zip(chosen.keys, layers)]
            values = [torch.cat([cv, v[0][:, T:]], dim=1) for cv, (_, v) in zip(chosen.values, layers)]
            prefix = KVPrefix(keys, values, next_position=T + len(head))
        else:
            prefix = take_tokens(doc.full, torch.arange(doc.n_tokens - prep.data, doc.n_tokens))
        before = (time.perf_counter() - t0) * 1e3
        g = generate(lm, last, prefix=prefix, **gen)
        return _answer(g, doc.prefill_ms + before, prep.kv_bytes, prefix, last,
                       document_prefill_ms=round(doc.prefill_ms, 3), select_ms=round(before, 3))


@dataclass
class WholeState(Method):
    """Diagnostic: the fused pipeline's state loaded whole (every cluster, every layer, as
    stored), no rules. Separates what the codec keeps from what YOCO chooses to load."""

    name: ClassVar[str] = "state"
    uses_state: ClassVar[bool] = True
    needs_document: ClassVar[bool] = False

    def prepare(self, lm: LoadedModel, doc, budget_bytes):
        return Prepared(kv_bytes=budget_bytes)

    def answer(self, lm: LoadedModel, doc, prep, question, prompt, gen):
        from kite.upcycle import load_prefix

        t0 = time.perf_counter()
        prefix, report = load_prefix(prep.data.path, lm)
        load_ms = (time.perf_counter() - t0) * 1e3
        g = generate(lm, prompt, prefix=prefix, **gen)
        return _answer(g, load_ms, prep.kv_bytes, prefix, prompt, load_ms=round(load_ms, 3),
                       bytes_read=report.bytes_read)


@dataclass
class Fused(Method):
    """The fused pipeline: signals → rules → LoadPlan → partial load of the state → generate →
    measured gain recorded in the health store (kite.yoco.fused.answer)."""

    name: ClassVar[str] = "fused"
    equal_bytes: ClassVar[bool] = False  # it *is* the budget
    uses_state: ClassVar[bool] = True
    needs_document: ClassVar[bool] = False
    tagger: Any = None
    rules: Any = None
    health: Any = None
    min_hit_gain: float = DEFAULT_MIN_HIT_GAIN

    def prepare(self, lm: LoadedModel, doc, budget_bytes):
        return Prepared(kv_bytes=budget_bytes)  # the runner attaches the state (states.StateRef)

    def answer(self, lm: LoadedModel, doc, prep, question, prompt, gen):
        from kite.upcycle import load_prefix
        from kite.yoco.fused import answer as fused_answer, load_args

        state = prep.data
        out = fused_answer(lm, self.tagger, self.rules, state.path, question, prompt,
                           health=self.health, min_hit_gain=self.min_hit_gain,
                           state_id=state.path.name.removesuffix(".upc"), **gen)
        before = out.timings_ms["signals_and_decision"] + out.timings_ms["load"]
        prefix = None
        if out.load is not None:  # the same prefix again, for the teacher-forced reference
            prefix, _ = load_prefix(state.path, lm, **load_args(out.plan, out.signals.query_label))
        return _answer(out.generation, before, prep.kv_bytes, prefix, prompt,
                       loaded=out.load is not None, gain=out.gain, plan=out.plan.to_dict(),
                       load=out.load.to_dict() if out.load else None, timings_ms=out.timings_ms,
                       query_label=out.signals.query_label)


@dataclass
class KVBudget(Method):
    """The memory-budgeted cache (docs/kv-budget.md, `--kv-budget-tokens`): document and prompt
    prefilled through a BudgetCache that holds `budget_tokens` tokens raw and upcycles older ones
    into codec blocks. Nothing is reused between requests: each pays its whole prefill, as full
    prefill does; what it saves is memory. `kv_bytes` is the document's share of what the cache
    holds at the end: all of it less the prompt's and the answer's tokens, the newest, still raw
    at 16 bits (BudgetCache.stats counts raw tokens so)."""

    name: ClassVar[str] = "budget"
    equal_bytes: ClassVar[bool] = False  # its own budget, not the state's
    needs_document: ClassVar[bool] = False  # it prefills the document's ids itself
    budget_tokens: int = 1024
    codec: str = "ratio=8"
    block_tokens: int = 256

    def check(self, context_length: int | None = None):
        """The cache's settings, checked (BadInput for a budget that cannot work on this model)."""
        from kite.upcycle import BudgetSettings, check_budget

        return check_budget(BudgetSettings(budget_tokens=self.budget_tokens, codec=self.codec,
                                           block_tokens=self.block_tokens), context_length)

    def _cache(self, lm: LoadedModel):
        from kite.upcycle import BudgetCache

        return BudgetCache(lm.model, self.check(lm.geometry.context_length))

    def prepare(self, lm: LoadedModel, doc, budget_bytes):
        return Prepared(kv_bytes=0, note=f"{self.budget_tokens} tokens raw, older ones in {self.codec} blocks "
                                        f"of {self.block_tokens}")

    def answer(self, lm: LoadedModel, doc, prep, question, prompt, gen):
        cache = self._cache(lm)
        g = generate(lm, doc.ids + prompt, cache=cache, prefill_chunk=self.block_tokens, **gen)
        stats = cache.stats()
        newest = (stats["tokens"] - doc.n_tokens) * fp16_token_bytes(lm)
        return _answer(g, 0.0, int(stats["kv_bytes"] - newest), None, doc.ids + prompt, budget_tokens=self.budget_tokens,
                       compressed_tokens=stats["compressed_tokens"], ratio_to_raw=stats["ratio_to_raw"])

    @torch.inference_mode()
    def reference_logits(self, lm: LoadedModel, doc, ans, reference):
        from kite.runtime.generate import forward_tokens

        ids = ans.ppl_prompt + reference[:-1]
        cache = self._cache(lm)
        chunks = [forward_tokens(lm.model, ids[at:at + self.block_tokens], cache, at)
                  for at in range(0, len(ids), self.block_tokens)]
        return torch.cat(chunks)[len(ans.ppl_prompt) - 1:]


def kvpress_status() -> tuple[bool, str]:
    """(usable, note): kvpress presses run only when kvpress is installed, declares support for
    the installed transformers, and imports."""
    import importlib.metadata as md

    import transformers

    try:
        version, reqs = md.version("kvpress"), md.requires("kvpress") or []
    except md.PackageNotFoundError:
        return False, "kvpress is not installed; its presses were not run"
    spec = next((r for r in reqs if r.replace(" ", "").startswith("transformers")), "")
    if spec:
        from packaging.requirements import Requirement

        req = Requirement(spec.split(";")[0])
        if not req.specifier.contains(transformers.__version__, prereleases=True):
            return False, (f"kvpress {version} needs {req}, the installed transformers is "
                           f"{transformers.__version__}; its presses were not run")
    try:
        import kvpress  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return False, f"kvpress {version} does not import ({type(exc).__name__}: {exc}); its presses were not run"
    return True, f"kvpress {version} is importable"


@dataclass
class KVPress(Method):
    """NVIDIA kvpress' ExpectedAttentionPress at the state's budget (only when kvpress_status()
    says it is usable): the press compresses the document's cache during its prefill."""

    name: ClassVar[str] = "kvpress"

    def prepare(self, lm: LoadedModel, doc, budget_bytes):
        from kvpress import ExpectedAttentionPress

        from kite.bench.document import prefill_document

        ratio = max(0.0, 1.0 - budget_bytes / doc.raw_kv_bytes(lm))
        press = ExpectedAttentionPress(compression_ratio=ratio)
        with press(lm.model):
            ctx = prefill_document(lm, doc.key, doc.ids)
        kept = int(ctx.full.keys[0].shape[1])
        return Prepared(int(kept * fp16_token_bytes(lm)), take_tokens(ctx.full, torch.arange(kept)),
                        note=f"ExpectedAttentionPress(compression_ratio={ratio:.3f})")

    def answer(self, lm: LoadedModel, doc, prep, question, prompt, gen):
        g = generate(lm, prompt, prefix=prep.data, **gen)
        return _answer(g, 0.0, prep.kv_bytes, prep.data, prompt)


BASELINES: dict[str, type[Method]] = {m.name: m for m in (FullPrefill, KeepLastWindow, KiviQuant, SnapKV,
                                                         WholeState, KVPress, KVBudget)}
ALL_METHODS = tuple(BASELINES) + ("fused",)
