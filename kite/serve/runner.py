"""The one model a server runs, and everything that touches it: upcycling uploads and answering.

Generations decode together in the continuous batch (:mod:`kite.serve.batcher`), whose thread is
the model's only thread. A completion about a state is one request there: YOCO's decision and the
state's load (its Preparation, with every request that arrived since the last step), its steps, and
the measured gain when it ends (its finish). Other model work (an upload's upcycle) is handed to that
thread (``Batcher.call``) and runs between two steps, first come, first served. Routes call these
from worker threads, which keeps the event loop free for admin, health and metrics.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kite.errors import BadInput
from kite.serve.settings import ServeSettings
from kite.serve.states import StateExists, StateNotFound, StateStore, StateSummary

FUSION_OFF_NOTE = "features.upcycle_yoco_fusion is off: nothing was loaded; plain generation ran"


@dataclass(slots=True)
class GenOptions:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    on_text: Callable[[str], None] | None = None
    queued_at: float | None = None  # time.perf_counter() when the request arrived
    on_request: Callable[[object], None] | None = None   # gets its kite.serve.batcher.BatchRequest (to cancel)


@dataclass(slots=True)
class Upcycled:
    """A stored state and whether this call made it (False: the same document was already there)."""

    summary: StateSummary
    created: bool
    timings_ms: dict[str, float] = field(default_factory=dict)
    raw_kv_bytes: int = 0
    warnings: list[str] = field(default_factory=list)   # the compression's (e.g. a ratio the document cannot reach)

    def to_dict(self) -> dict:
        return {**self.summary.to_dict(), "created": self.created, "timings_ms": self.timings_ms,
                "warnings": self.warnings}


@dataclass(slots=True)
class Answer:
    """One completion: the generation and, when a state was named, what YOCO did with it."""

    generation: object  # kite.runtime.generate.GenerationResult
    fused: object | None = None  # kite.yoco.fused.FusedAnswer
    state_id: str | None = None
    rules: dict | None = None  # version and sha256 of the rule set that decided
    wait_ms: float = 0.0  # queued for the model: from arrival (after any upcycle) to holding it
    kv_budget: dict | None = None  # the budgeted cache's stats, or why the budget did not apply

    def kite_dict(self, fusion: bool) -> dict:
        out: dict = {"state": self.state_id, "fusion": fusion, "loaded": False, "wait_ms": round(self.wait_ms, 3)}
        if self.fused is not None:
            f = self.fused
            out.update(loaded=f.load is not None, plan=f.plan.to_dict(), signals=f.signals.flat(),
                       load=f.load.to_dict() if f.load else None, gain=f.gain, timings_ms=f.timings_ms,
                       rules=self.rules, warnings=list(f.load.warnings) if f.load else [])
        else:
            out["timings_ms"] = {"generate": self.generation.total_ms}
        if self.state_id is not None and not fusion:
            out["note"] = FUSION_OFF_NOTE
        if self.kv_budget is not None:
            out["kv_budget"] = self.kv_budget
        g = self.generation
        out["generation"] = {"ttft_ms": g.ttft_ms, "total_ms": g.total_ms, "tokens_per_s": g.tokens_per_s,
                             "prefix_tokens": g.prefix_tokens, "prompt_nll_bits": g.prompt_nll_bits,
                             "reader_adapter": g.reader_adapter}
        return out


class ModelRunner:
    """Holds the pipeline (model, tagger, compression settings), the rules, health store, novelty
    tracker and sampler. ``tenant``: the tenant whose states this runner makes and answers from
    (a tenant's view of the server, kite.serve.tenants; None: no tenant)."""

    tenant: str | None = None

    def __init__(self, pipeline, settings: ServeSettings, rules, store: StateStore, *,
                 health=None, novelty=None, sampler=None, on_step=None):
        from kite.serve.batcher import Batcher
        from kite.serve.prefixes import PrefixCache

        self.pipeline, self.lm, self.tagger = pipeline, pipeline.lm, pipeline.tagger
        self.settings, self.rules, self.store = settings, rules, store
        self.health, self.novelty, self.sampler = health, novelty, sampler
        self.kv_budget = settings.budget_settings(self.lm.geometry.context_length)
        from kite.serve.open_states import OpenStates

        self.prefixes = PrefixCache(settings.prefix_cache_bytes, settings.resident, settings.lane_bits)   # loaded states, for the next question
        self.open_states = OpenStates()   # their files, open once per version
        self.batcher = Batcher(self.lm, max_batch=settings.max_batch, max_kv_bytes=settings.batch_kv_bytes,
                               reserve_tokens=settings.batch_reserve_tokens,
                               on_step=on_step)
        if settings.batch_reserve_tokens is not None:     # its captures before the first request, as the steps'
            from kite.yoco.intent import warm_query_signals

            try:
                self.batcher.call(lambda: warm_query_signals(self.lm, self.tagger))
            except BaseException:
                self.batcher.close()
                raise

    def close(self) -> None:
        """Stop the batch's scheduler (requests still in it fail with a shutdown error), then close the
        state files kept open."""
        self.batcher.close()
        self.open_states.close()

    @property
    def model_name(self) -> str:
        return str(self.lm.source.spec)

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names a request's `model` may give: the model as `--model` named it, and its short
        name (the folder's name, the .gguf file's stem, the embedded model's name)."""
        spec = self.model_name
        short = Path(spec).stem if spec.endswith(".gguf") else Path(spec).name
        return tuple(dict.fromkeys(n for n in (spec, short) if n))

    # -- states -----------------------------------------------------------------------------
    def upcycle(self, document: str, state_id: str | None = None, name: str = "-",
                overwrite: bool = False) -> Upcycled:
        """Store `document` as a state. Without an id the id is a hash of the document and the
        model, and a document already stored is reused rather than upcycled again, unless that
        state is quarantined (kite.serve.quarantine): then it is upcycled again in its place."""
        if not document.strip():
            raise BadInput("the document is empty")
        explicit = state_id is not None
        if explicit:
            sid = state_id
        elif self.store.shared is not None:   # with a shared store, the state's content address
            sid = self.pipeline.address_of(document, tenant=self.tenant).id
        else:
            sid = self.store.id_for(document, self.lm.fingerprints.combined)
        if explicit:
            self.store.check_writable(sid)  # an id the model file's own states hold
        elif sid in self.store.embedded:
            return Upcycled(self.store.summary(sid), created=False)
        path = self.store.path_for(sid)
        if not explicit and not path.is_file() and self.store.fetch(sid):
            return Upcycled(self.store.summary(sid), created=False)   # another server made it

        def reusable() -> bool:   # the same document's state is there, and not quarantined
            return path.is_file() and self.store.quarantine.entry(sid) is None

        if path.is_file():
            if not explicit and reusable():
                return Upcycled(self.store.summary(sid), created=False)
            if explicit and not overwrite:
                raise StateExists(f"state {sid!r} exists (send \"overwrite\": true to replace it)")

        def compress():
            if not explicit and reusable():  # the same document, upcycled while we waited
                return None
            result = self.pipeline.compress(document, path, source_name=name, tenant=self.tenant)
            self.open_states.forget(path)   # a file replaced under its path: its old one is let go now
            return result

        result, _ = self.batcher.call(compress)
        if result is None:
            return Upcycled(self.store.summary(sid), created=False)
        self.store.publish(path)
        self.store.quarantine.lift(sid, "upcycled again")   # its new version would lift it anyway
        if explicit and overwrite and self.health is not None:
            self.health.reset(sid)  # a new document under an old id: its old record means nothing
        return Upcycled(self.store.summary(sid), created=True, timings_ms=result.timings_ms,
                        raw_kv_bytes=result.raw_kv_bytes, warnings=list(result.warnings))

    def delete(self, state_id: str) -> None:
        """Delete a state's file, and close it where it is kept open (on the model's thread, which
        reads it; an unlinked file kept open would hold its disk space)."""
        path = self.store.delete(state_id)
        self.batcher.call(lambda: self.open_states.forget(path))

    # -- answering --------------------------------------------------------------------------
    def encode(self, prompt: str, after_state: bool) -> list[int]:
        # After a state the prompt continues the document: no BOS in the middle.
        return self.lm.tokenizer(prompt, add_special_tokens=not after_state)["input_ids"]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        tok = self.lm.tokenizer
        if not getattr(tok, "chat_template", None):
            raise BadInput("this model's tokenizer has no chat template: use /v1/completions")
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    def answer(self, prompt_ids: list[int], query: str, state_id: str | None, opts: GenOptions,
               path: Path | None = None) -> Answer:
        """Generate after `prompt_ids` in the batch; with a state, through YOCO's fused loop as one
        request on the batch's thread: decided and loaded at the step boundary it joins at (with every
        request that arrived since the last step), the measured gain recorded in the health store when
        it ends. ``path``: the state's file when the caller resolved ``state_id`` already
        (StateStore.usable). With the KV budget on, a completion without a state joins the batch with
        its older tokens coded (docs/kv-budget.md)."""
        from kite.serve.batcher import Preparation
        from kite.yoco.fused import finish

        if path is None and state_id is not None:
            path = self.store.usable(state_id)
        if path is None:
            if self.kv_budget is not None:
                return self._budgeted(prompt_ids, opts)
            gen, req = self.batcher.generate(prompt_ids, None, opts)
            return Answer(gen, wait_ms=req.wait_ms)
        ruleset = self.rules.current  # one read: the set that decides this request
        gen, req = self.batcher.generate(
            prompt_ids, None, opts, prepare=Preparation("decide", (query, state_id, path, ruleset), self._decide_together),
            finish=lambda result, prepared: finish(self.lm, prepared, prompt_ids, result, health=self.health))
        fused = req.finished
        own = fused.timings_ms.get("signals_and_decision", 0.0) + fused.timings_ms.get("load", 0.0)
        skipped = None if self.kv_budget is None else {
            "applied": False, "reason": "a state was named: its KV is loaded as the state's own compressed prefix"}
        return Answer(gen, fused, state_id, {"version": ruleset.version, "sha256": ruleset.sha256},
                      wait_ms=max(0.0, req.wait_ms - own), kv_budget=skipped)

    def _decide_together(self, items: list) -> list:
        """On the model's thread (a request's Preparation): the model's pass over the queries of every
        request that arrived since the last step, in one forward (kite.yoco.intent.query_signals), then
        for each request in arrival order YOCO's decision and the load it asks for (through the prefix
        cache); a Prepared (its ``prefix`` what the request joins the batch after) or the exception for
        each (a request's own error, a bad state, fails it alone)."""
        from kite.yoco.intent import query_signals

        t0 = time.perf_counter()
        signals = query_signals(self.lm, [query for query, *_ in items], self.tagger)
        ms = (time.perf_counter() - t0) * 1e3     # each request waited for the whole pass
        return _each([functools.partial(self._decide_and_load, *item, q, ms) for item, q in zip(items, signals)])

    def _decide_and_load(self, query: str, state_id: str, path, ruleset, signals, signals_ms: float = 0.0):
        """YOCO decides (kite.yoco.fused.decide_request); the engine loads what it chose through the
        prefix cache. The state's file is opened under the quarantine once per version of it
        (kite.serve.open_states: the next request about an unchanged file reuses its header) and loaded
        under it (a reader's refusal quarantines it: StateUnusable); one quarantined while this request
        waited is refused unread."""
        from kite.upcycle import StateFile, path_version
        from kite.yoco.fused import decide_request, load_args

        quarantine = self.store.quarantine
        quarantine.check(state_id)
        try:
            version = path_version(path)
        except OSError:
            self.open_states.forget(path)
            raise StateNotFound(f"no state {state_id!r} (list them with GET /v1/states)") from None

        def opened():
            with quarantine.reading(state_id, path, version):
                return StateFile(path)

        state = self.open_states.get(path, version, opened)
        try:
            prepared = decide_request(self.lm, self.tagger, ruleset, state, query, health=self.health,
                                      novelty=self.novelty, sampler=self.sampler,
                                      min_hit_gain=self.settings.min_hit_gain, state_id=state_id, signals=signals,
                                      signals_ms=signals_ms)
            if prepared.plan.loads and self.settings.fusion:
                t0 = time.perf_counter()
                with quarantine.reading(state_id, path, state.version):   # the version this open read
                    prefix, report = self.prefixes.load(state, self.lm,
                                                        **load_args(prepared.plan, prepared.query.query_label))
                prepared.loaded(prefix, report, (time.perf_counter() - t0) * 1e3)
        except Exception:
            self.open_states.forget(path)   # a state that failed is opened afresh next time
            raise
        return prepared

    def _budgeted(self, prompt_ids: list[int], opts: GenOptions) -> Answer:
        """A completion without a state under the KV budget: in the batch like any other, its row
        holding the sinks and the raw window, its older tokens coded in blocks (docs/kv-budget.md)."""
        from kite.upcycle import BudgetRow

        memory, _ = self.batcher.call(lambda: BudgetRow(self.lm.model, self.kv_budget))  # tensors: the model's thread
        gen, req = self.batcher.generate(prompt_ids, None, opts, memory)
        return Answer(gen, wait_ms=req.wait_ms, kv_budget={"applied": True, "batched": True, **memory.stats()})


def _each(calls: list) -> list:
    """Run each call in order (the work of several requests in one hand-over to the model's thread);
    a result or the exception for each: a request's own error fails it alone."""
    out = []
    for call in calls:
        try:
            out.append(call())
        except Exception as exc:  # noqa: BLE001 - a request's own error fails it alone
            out.append(exc)
    return out
