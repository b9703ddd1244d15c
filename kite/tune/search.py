"""Which points a sweep runs: the full grid (the default), or Optuna's samplers for spaces too
large for one (`--search optuna --trials N`): TPE for one objective, NSGA-II for two, both told
each point's constraint violations so they steer toward points that meet them.

Both give points one at a time (`next_point`) and hear back each point's figures (`tell`), so a
point measured before (--resume, or Optuna proposing one twice) is read, not run again.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

from kite.errors import BadInput
from kite.tune.space import Range, grid, point_problem

SEARCHES = ("grid", "optuna")


class GridSearch:
    """Every combination of the ranges' values, in order."""

    name = "grid"

    def __init__(self, ranges: list[Range], base: dict | None = None):
        self.points, self.skipped = grid(ranges, base)

    @property
    def total(self) -> int:
        return len(self.points)

    def __iter__(self) -> Iterator[dict]:
        yield from self.points

    def tell(self, point: dict, values: list[float] | None, violations: list[float]) -> None:
        pass


def optuna_module():
    """optuna, or BadInput saying how to install it."""
    try:
        import optuna
    except ImportError:
        raise BadInput("--search optuna needs optuna: pip install 'kite[tune]' (or pip install optuna)") from None
    return optuna


class OptunaSearch:
    """`trials` points proposed by TPE (one objective) or NSGA-II (two), seeded."""

    name = "optuna"

    def __init__(self, ranges: list[Range], objectives: list, trials: int, seed: int = 0,
                 base: dict | None = None):
        optuna = optuna_module()
        self.base = base
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna = optuna
        self.ranges, self.trials = ranges, trials
        self.skipped: list[tuple[dict, str]] = []
        self.distributions = {r.name: _distribution(optuna, r) for r in ranges}
        directions = [o.direction for o in objectives]
        with warnings.catch_warnings():  # constraints_func is marked experimental
            warnings.simplefilter("ignore")
            if len(objectives) > 1:
                sampler = optuna.samplers.NSGAIISampler(seed=seed, constraints_func=_violations,
                                                        population_size=max(4, min(50, trials // 2 or 1)))
            else:
                sampler = optuna.samplers.TPESampler(seed=seed, constraints_func=_violations,
                                                     n_startup_trials=max(1, min(10, trials // 3)))
        self.study = optuna.create_study(directions=directions, sampler=sampler)
        self._trial = None  # the live trial of the point given out last (one point runs at a time)
        self.asked = 0

    @property
    def total(self) -> int:
        return self.trials

    def add_known(self, point: dict, values: list[float] | None, violations: list[float]) -> bool:
        """Tell the sampler about a point measured before (--resume); False when it lies outside
        this search's space."""
        dist = self.distributions
        if set(point) != set(dist) or not all(_contains(dist[k], v) for k, v in point.items()):
            return False
        state = self.optuna.trial.TrialState
        self.study.add_trial(self.optuna.trial.create_trial(
            params=point, distributions=dist, values=values, user_attrs={"kite_violations": violations},
            system_attrs={"constraints": list(violations)},
            state=state.COMPLETE if values is not None else state.FAIL))
        self.asked += 1
        return True

    def __iter__(self) -> Iterator[dict]:
        while self.asked < self.trials:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trial = self.study.ask(self.distributions)
            self.asked += 1
            point = {k: _plain(v) for k, v in trial.params.items()}
            why = point_problem(point, self.base)
            if why:
                self.skipped.append((point, why))
                self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
                continue
            self._trial = trial
            yield point

    def tell(self, point: dict, values: list[float] | None, violations: list[float]) -> None:
        trial, self._trial = self._trial, None
        trial.set_user_attr("kite_violations", list(violations))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if values is None:
                self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
            else:
                self.study.tell(trial, values)


def _violations(trial) -> list[float]:
    return list(trial.user_attrs.get("kite_violations", []))


def _plain(v):
    return v.item() if hasattr(v, "item") else v


def _distribution(optuna, r: Range):
    d = optuna.distributions
    if r.explicit or r.param.kind == "choice":
        return d.CategoricalDistribution(list(r.values))
    if r.param.kind == "int":
        return d.IntDistribution(int(r.low), int(r.high), step=int(r.step or 1))
    return d.FloatDistribution(float(r.low), float(r.high), step=r.step)


def _contains(dist, value) -> bool:
    """Whether `value` is one `dist` can propose (a point of another space is not added)."""
    if hasattr(dist, "choices"):
        return value in dist.choices
    if isinstance(value, str) or not dist.low <= value <= dist.high:
        return False
    step = getattr(dist, "step", None)
    return step is None or abs((value - dist.low) / step - round((value - dist.low) / step)) < 1e-9


def check_search(kind: str, n_objectives: int, trials: int | None) -> None:
    """BadInput for an unknown kind, --trials without optuna, optuna without --trials (or with
    optuna not installed), or more than two objectives."""
    if kind not in SEARCHES:
        raise BadInput(f"--search {kind!r}: expected one of {', '.join(SEARCHES)}")
    if n_objectives > 2:
        raise BadInput(f"{n_objectives} objectives: give one (best point) or two (a Pareto front)")
    if kind == "grid" and trials is not None:
        raise BadInput("--trials sets how many points Optuna tries; the grid tries all of them "
                       "(give --search optuna, or leave --trials out)")
    if kind == "optuna":
        if trials is None:
            raise BadInput("--search optuna needs --trials N (how many points to run)")
        if trials < 1:
            raise BadInput(f"--trials {trials}: at least one")
        optuna_module()


def make_search(kind: str, ranges: list[Range], objectives: list, trials: int | None, seed: int,
                base: dict | None = None):
    """The search a command asked for (checked by :func:`check_search`)."""
    check_search(kind, len(objectives), trials)
    if kind == "grid":
        return GridSearch(ranges, base)
    return OptunaSearch(ranges, objectives, trials, seed, base)
