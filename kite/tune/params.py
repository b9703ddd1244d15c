"""Every tunable parameter of a setup: the fixed ones (kite.tune.space) and the thresholds of
the rule file in use (kite.tune.rule_params), each with the value in force now."""

from __future__ import annotations

from pathlib import Path

from kite.tune.rule_params import rule_params
from kite.tune.space import Param, builtin_params


def tunable_params(rules: str | Path | None = None, upcycle_config: str | Path | None = None,
                   kite_cfg=None) -> list[Param]:
    """The parameters `kite tune auto --param` takes with these files (None: the defaults,
    rules/yoco_rules.yaml and configs/upcycle_config.yaml of the checkout)."""
    from kite.upcycle import load_upcycle_config
    from kite.yoco.rules import default_rules_path

    cfg, _ = load_upcycle_config(upcycle_config)
    return builtin_params(cfg, kite_cfg) + rule_params(Path(rules) if rules else default_rules_path())
