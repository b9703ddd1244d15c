"""`kite tune`: sweeps of KITE's knobs (compression, clusters, spans, the minimum gain, the rules'
thresholds) measured by the bench, judged against objectives and constraints.

`run_tune(TuneSettings)` runs a sweep (grid or Optuna) and returns its judged results;
`tunable_params` lists what can be tuned; `write_best_config` and `pareto_png` write the outputs.
Docs: docs/tuning.md.
"""

from kite.tune.best_config import write_best_config
from kite.tune.constraints import Constraint, parse_constraint, parse_metric
from kite.tune.objective import Objective, metrics, parse_objective
from kite.tune.params import tunable_params
from kite.tune.judge import judge
from kite.tune.report import pareto_png, points_table, reuse_line
from kite.tune.runner import TuneSettings, run_tune
from kite.tune.space import Param, Range, RangeSpec, parse_ranges

__all__ = [
    "Constraint", "Objective", "Param", "Range", "RangeSpec", "TuneSettings", "judge", "metrics", "pareto_png",
    "parse_constraint", "parse_metric", "parse_objective", "parse_ranges", "points_table", "reuse_line",
    "run_tune", "tunable_params", "write_best_config",
]
