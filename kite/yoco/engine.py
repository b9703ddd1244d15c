"""`decide`: run a compiled rule set over one request's signals and turn the matched action into
a `LoadPlan`, skipping loads whose predicted gain is below `yoco_min_hit_gain`. A rule that
would load `$query_label` from a state with no cluster of that label passes the request on to the
next matching rule.

Predicted gain (documented in docs/rules-dsl.md): each cluster label c the plan loads has a
health h_c in [0, 1] from the health store, the squashed exponentially weighted gain measured
when it was loaded (`kite.yoco.health.health_from_gain`). Its expected gain is the inverse,
g_c = (2·h_c − 1)·gain_scale, and the plan's prediction is the token-weighted mean over the
clusters loaded: Σ w_c·g_c / Σ w_c (w_c = the cluster's token count when known, else 1).
Layers and precision do not enter it yet: no measurement says by how much they change the gain.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kite.yoco.health import DEFAULT_GAIN_SCALE, DEFAULT_PRIOR_GAIN, gain_from_health, health_from_gain
from kite.yoco.plan import LoadPlan
from kite.yoco.rules.ruleset import RuleSet
from kite.yoco.signals import Signals


@dataclass(slots=True)
class StateInfo:
    """What the engine knows of the state: its cluster labels with their health (0-1), token
    counts where known, and the model's layer count."""

    health: dict[str, float]
    n_layers: int | None = None
    tokens: dict[str, int] = field(default_factory=dict)
    state_id: str | None = None

    @property
    def labels(self) -> list[str]:
        return list(self.health)

    def health_score(self) -> float:
        """The state's health: token-weighted mean over its clusters (the prior when empty)."""
        if not self.health:
            return health_from_gain(DEFAULT_PRIOR_GAIN, DEFAULT_GAIN_SCALE)
        w = [max(1, self.tokens.get(c, 1)) for c in self.health]
        return sum(wi * h for wi, h in zip(w, self.health.values())) / sum(w)


def predict_gain(state: StateInfo, clusters: list[str],
                 gain_scale: float = DEFAULT_GAIN_SCALE) -> float:
    """Token-weighted mean expected gain of loading `clusters` (see the module docstring)."""
    if not clusters:
        return 0.0
    total = weight = 0.0
    for c in clusters:
        w = float(max(1, state.tokens.get(c, 1)))
        total += w * gain_from_health(state.health[c], gain_scale)
        weight += w
    return total / weight


def decide(ruleset: RuleSet, signals: Signals, state: StateInfo, min_hit_gain: float,
           gain_scale: float = DEFAULT_GAIN_SCALE) -> LoadPlan:
    """The plan for one request: first matching rule, resolved against the state's clusters.

    `signals.state_health_score=None` is filled from `state.health_score()`.
    """
    if signals.state_health_score is None:
        signals = replace(signals, state_health_score=state.health_score())
    # A rule that loads `$query_label` from a state without such a cluster passes the request on
    # to the next rule that matches (a state's clusters need not cover every clause type; loading
    # nothing instead lost the whole document on the bench). The default always matches.
    passed: list[str] = []
    for rule in ruleset.rules:
        if not rule.test(signals):
            continue
        if rule.action.load == "query_label" and signals.query_label not in state.health \
                and not rule.is_default:
            passed.append(f"rule {rule.name!r} passed on: query_label {signals.query_label!r} is "
                          "not a cluster label of this state")
            continue
        break
    action = rule.action
    why = "; ".join([_why(rule, signals), *passed])
    layers = None if action.layers is None else list(action.layers)

    def plan(clusters, gain=0.0, skip=None) -> LoadPlan:
        return LoadPlan(
            clusters=[] if skip else clusters, layers=layers, precision=action.precision,
            enable_micro_sampling=action.enable_micro_sampling, matched_rule=rule.name,
            reason=why if skip is None else f"{why}; skipped: {skip}", predicted_gain=gain,
            skipped=skip is not None, skip_reason=skip)

    if action.load == "skip":
        return plan([], skip=f"rule {rule.name!r} says skip")
    if action.load == "all":
        clusters = list(state.health)
        if not clusters:
            return plan([], skip="the state has no clusters")
        gain = predict_gain(state, clusters, gain_scale)
        chosen: list[str] | str = "all"
    else:
        clusters = [signals.query_label] if action.load == "query_label" else list(action.clusters)
        missing = [c for c in clusters if c not in state.health]
        if missing:
            what = "query_label " if action.load == "query_label" else ""
            return plan([], skip=f"{what}{missing[0]!r} is not a cluster label of this state")
        gain = predict_gain(state, clusters, gain_scale)
        chosen = clusters
    if gain < min_hit_gain:
        return plan([], gain, f"predicted gain {gain:.4g} < yoco_min_hit_gain {min_hit_gain:.4g}")
    return plan(chosen, gain)


def _why(rule, signals: Signals) -> str:
    if rule.is_default:
        return f"rule {rule.name!r} (default)"
    values = ", ".join(f"{f}={_fmt(g(signals))}" for f, g in zip(rule.fields, rule.getters))
    return f"rule {rule.name!r} matched: {rule.condition} ({values})"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return repr(v) if isinstance(v, str) else str(v).lower()

