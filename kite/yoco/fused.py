"""The fused loop for one request: signals → rules → LoadPlan → partial load → generate → feedback.

Used by `kite yoco decide --state`, the server and the benchmark, so all three decide and load
the same way. Measured gain of a load: how much the state made the query's own words more
predictable, (N_without − N_with) / N_without, where N is the mean negative log-likelihood (bits)
of the prompt's tokens after its first, teacher-forced — without the state from the signals' own
pass over the query when the prompt is the query, else one short forward of the prompt; the side
with it comes from the generation's own prefill (`prompt_nll_bits`). Positive = the state told the model something about
the query (its document speaks of what the query asks).

Why the prompt's NLL and not its entropy (docs/rules-dsl.md "The measured gain", made by
`benchmarks/gain_proxy.py` on held-out contracts): a document often makes the model less sure of
the answer's first token (several candidates), so entropy cannot tell a useful load from a useless
one, while the NLL's sign follows whether the load helped the reference answer.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kite.config import DEFAULT_MIN_HIT_GAIN
from kite.runtime.generate import GenerationResult, generate
from kite.upcycle import LoadReport, StateFile, load_prefix
from kite.yoco.engine import StateInfo, decide
from kite.yoco.health import DEFAULT_GAIN_SCALE, DEFAULT_PRIOR_GAIN, health_from_gain
from kite.yoco.intent import QuerySignals, query_signals
from kite.yoco.plan import LoadPlan
from kite.yoco.signals import HardwareWatermark, Signals

if TYPE_CHECKING:
    from kite.model import LoadedModel


def state_id_of(path: str | Path) -> str:
    """A state's id in the health store: its file name without `.upc`."""
    return Path(path).name.removesuffix(".upc")


def state_info(state: StateFile, health=None, state_id: str | None = None) -> StateInfo:
    """What the rules engine knows of a state: labels with their health, tokens, layers."""
    tokens: dict[str, int] = {}
    for c in state.meta["clusters"]:
        tokens[c["label"]] = tokens.get(c["label"], 0) + c["n_tokens"]
    labels = sorted(tokens)
    sid = state_id or state_id_of(state.path)
    # no store: no evidence either way, so every cluster stands at the prior (as a new state does)
    prior = health_from_gain(DEFAULT_PRIOR_GAIN, DEFAULT_GAIN_SCALE)
    scores = health.scores(sid, labels) if health is not None else {lab: prior for lab in labels}
    return StateInfo(health=scores, n_layers=state.meta["model"]["geometry"]["n_layers"], tokens=tokens,
                     state_id=sid)


def build_signals(q: QuerySignals, novelty: float, info: StateInfo,
                  watermark: HardwareWatermark | None = None) -> Signals:
    return Signals(intent_entropy=q.intent_entropy, query_novelty=novelty, query_label=q.query_label,
                   label_entropy=q.label_entropy, state_health_score=info.health_score(),
                   hardware_watermark=watermark or HardwareWatermark())


def load_args(plan: LoadPlan, query_label: str) -> dict:
    """load_prefix keyword arguments for a plan (None when it loads nothing)."""
    clusters = None if plan.clusters == "all" else [query_label if c == "$query_label" else c
                                                     for c in plan.clusters]
    return {"clusters": clusters, "layers": plan.layers, "precision": plan.precision}


def prompt_nll(lm: LoadedModel, prompt_ids: list[int], prefix=None) -> float | None:
    """Mean negative log-likelihood (bits) of the prompt's tokens after its first, teacher-forced,
    after `prefix` (a loaded state) when given; None for a prompt of fewer than 2 tokens. The
    first token is left out on both sides: without a state nothing predicts it."""
    if len(prompt_ids) < 2:
        return None
    from kite.runtime.cache import new_cache
    from kite.runtime.decoding import nll_bits, prompt_nll_nats
    from kite.runtime.generate import forward_tokens

    start = prefix.next_position if prefix is not None else 0
    logits = forward_tokens(lm.model, prompt_ids[:-1], new_cache(lm.model, prefix), start)
    return nll_bits(prompt_nll_nats(logits, prompt_ids[1:]), len(prompt_ids))


def measured_gain(without: float | None, with_state: float | None) -> float | None:
    """Relative drop (without − with) / without of the prompt's NLL (`prompt_nll`); None when
    either is unknown (a one-token prompt), 0 when there was nothing to lower."""
    if without is None or with_state is None:
        return None
    if without <= 0:
        return 0.0
    return (without - with_state) / without


@dataclass
class FusedAnswer:
    signals: Signals
    plan: LoadPlan
    load: LoadReport | None
    generation: GenerationResult
    gain: float | None  # measured; None when nothing was loaded (or the prompt has one token)
    timings_ms: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"signals": self.signals.flat(), "plan": self.plan.to_dict(),
                "load": self.load.to_dict() if self.load else None,
                "generation": self.generation.to_dict(), "gain": self.gain, "timings_ms": self.timings_ms}


def plan_for(lm: LoadedModel, tagger, rules, state: StateFile, query: str, *, health=None, novelty=None,
             watermark: HardwareWatermark | None = None, min_hit_gain: float = DEFAULT_MIN_HIT_GAIN,
             state_id: str | None = None, timings: dict | None = None,
             signals: QuerySignals | None = None, signals_ms: float = 0.0
             ) -> tuple[Signals, LoadPlan, QuerySignals, StateInfo]:
    """Signals and the rules' decision for `query` against `state` (no loading). `timings`, when
    given, receives `model_signals` (the model's pass over the query) and `decide` (the rules), ms.
    ``signals``: the model's pass over `query` made already (several queries' in one forward), in
    ``signals_ms``."""
    t0 = time.perf_counter()
    q = signals if signals is not None else query_signals(lm, [query], tagger)[0]
    t1 = time.perf_counter()
    nov = novelty.observe(query) if novelty is not None else 1.0     # its novelty, then it is remembered
    info = state_info(state, health, state_id)
    signals = build_signals(q, nov, info, watermark)
    t2 = time.perf_counter()
    plan = decide(rules, signals, info, min_hit_gain)
    if timings is not None:
        timings["model_signals"] = round((t1 - t0) * 1e3 + signals_ms, 3)
        timings["decide"] = round((time.perf_counter() - t2) * 1e3, 4)
    return signals, plan, q, info


@dataclass
class Prepared:
    """A request's decision and load, before its generation (:func:`prepare`)."""

    signals: Signals
    plan: LoadPlan
    info: StateInfo
    prefix: object | None              # kite.runtime.cache.KVPrefix to generate after, or None
    load: LoadReport | None
    timings_ms: dict[str, float]
    query: QuerySignals | None = None  # the signals' pass over the query (its token ids and their NLL)

    def loaded(self, prefix, report: LoadReport, ms: float) -> None:
        """Record the load the plan asked for (its prefix, its report, the ms it took)."""
        self.prefix, self.load = prefix, report
        self.timings_ms["load"] = round(ms, 3)


def decide_request(lm: LoadedModel, tagger, rules, state: StateFile, query: str, *, health=None, novelty=None,
                   sampler=None, min_hit_gain: float = DEFAULT_MIN_HIT_GAIN, state_id: str | None = None,
                   signals: QuerySignals | None = None, signals_ms: float = 0.0) -> Prepared:
    """Signals and the rules' decision for ``query`` against the open ``state``; nothing loaded yet
    (the caller loads what ``plan`` says, :func:`load_args`, and records it with :meth:`Prepared.loaded`).
    ``signals``: the model's pass over ``query`` when made already (:func:`plan_for`), in
    ``signals_ms`` (counted in ``model_signals`` and ``signals_and_decision``: a pass shared by the
    queries of several requests took that long for each of them)."""
    t0 = time.perf_counter() - signals_ms / 1e3
    watermark = sampler.latest().watermark if sampler is not None else None
    parts: dict[str, float] = {}
    sig, plan, q, info = plan_for(lm, tagger, rules, state, query, health=health, novelty=novelty,
                                  watermark=watermark, min_hit_gain=min_hit_gain, state_id=state_id,
                                  timings=parts, signals=signals, signals_ms=signals_ms)
    if plan.enable_micro_sampling and sampler is not None:
        sampler.enable_micro_sampling()
    return Prepared(sig, plan, info, None, None,
                    {"signals_and_decision": round((time.perf_counter() - t0) * 1e3, 3), **parts, "load": 0.0}, query=q)


def prepare(lm: LoadedModel, tagger, rules, state_path: str | Path, query: str, *, health=None, novelty=None, sampler=None,
            min_hit_gain: float = DEFAULT_MIN_HIT_GAIN, fusion_enabled: bool = True,
            state_id: str | None = None, signals: QuerySignals | None = None) -> Prepared:
    """Signals, the rules' decision (:func:`decide_request`) and the load through ``load_prefix``
    (nothing loaded with fusion disabled). ``state_path``: the state's file, or a StateFile the caller
    opened (and closes)."""
    opened = contextlib.nullcontext(state_path) if isinstance(state_path, StateFile) else StateFile(state_path)
    with opened as state:
        prepared = decide_request(lm, tagger, rules, state, query, health=health, novelty=novelty, sampler=sampler,
                                  min_hit_gain=min_hit_gain, state_id=state_id, signals=signals)
        if prepared.plan.loads and fusion_enabled:
            t0 = time.perf_counter()
            prepared.loaded(*load_prefix(state, lm, **load_args(prepared.plan, prepared.query.query_label)),
                            ms=(time.perf_counter() - t0) * 1e3)
    return prepared


def without_state_nll(lm: LoadedModel, prepared: Prepared, prompt_ids: list[int]) -> float | None:
    """The gain's side without the state: the prompt's NLL from the signals' own pass over the query
    when the prompt is those very tokens (a completion whose prompt is the query), else one short
    forward (:func:`prompt_nll`)."""
    q = prepared.query
    if q is not None and q.ids == tuple(prompt_ids):
        return q.nll_bits
    return prompt_nll(lm, prompt_ids)


def finish(lm: LoadedModel, prepared: Prepared, prompt_ids: list[int], gen: GenerationResult, *, health=None) -> FusedAnswer:
    """The measured gain of a load (the prefill's own NLL with the state against the prompt's NLL
    without it, :func:`without_state_nll`), recorded in the health store per loaded label."""
    gain = None
    extra: dict[str, float] = {}
    if prepared.load is not None:
        t_gain = time.perf_counter()
        gain = measured_gain(without_state_nll(lm, prepared, prompt_ids), gen.prompt_nll_bits)
        extra["gain"] = round((time.perf_counter() - t_gain) * 1e3, 3)
        if health is not None and gain is not None:
            health.record_clusters(prepared.info.state_id, sorted(set(prepared.load.labels)), gain)
    return FusedAnswer(prepared.signals, prepared.plan, prepared.load, gen, gain,
                       timings_ms={**prepared.timings_ms, "generate": gen.total_ms, **extra})


def answer(lm: LoadedModel, tagger, rules, state_path: str | Path, query: str, prompt_ids: list[int], *,
           health=None, novelty=None, sampler=None, min_hit_gain: float = DEFAULT_MIN_HIT_GAIN,
           fusion_enabled: bool = True, state_id: str | None = None, **gen_kwargs) -> FusedAnswer:
    """Answer `prompt_ids` (the query, formatted) with whatever the rules load from the state:
    :func:`prepare`, generate, :func:`finish`.

    With fusion disabled (`features.upcycle_yoco_fusion: false`) nothing is loaded and plain
    generation runs; the decision is still reported.
    """
    prepared = prepare(lm, tagger, rules, state_path, query, health=health, novelty=novelty, sampler=sampler,
                       min_hit_gain=min_hit_gain, fusion_enabled=fusion_enabled, state_id=state_id)
    gen = generate(lm, prompt_ids, prefix=prepared.prefix, **gen_kwargs)
    return finish(lm, prepared, prompt_ids, gen, health=health)


__all__ = ["FusedAnswer", "Prepared", "answer", "decide_request", "finish", "prepare", "plan_for", "state_info", "build_signals", "load_args", "measured_gain",
           "state_id_of", "prompt_nll", "without_state_nll"]
