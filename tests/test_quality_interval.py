"""The PPL delta's interval over resamples of the continuation (kite.upcycle.quality.delta_interval):
what a reader of `kite upcycle eval` and the quality benchmarks needs to tell a state's loss from the
text's noise."""

from __future__ import annotations

import math

import pytest
import torch

from kite.upcycle.quality import compare_logits, delta_interval


def _nll(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 4


def test_the_same_losses_give_a_zero_interval():
    nll = _nll(511)
    assert delta_interval(nll, nll.clone()) == (0.0, 0.0)


def test_a_loss_higher_at_every_token_lies_wholly_above_zero_and_holds_the_delta():
    full = _nll(511)
    other = full + 0.05
    lo, hi = delta_interval(full, other)
    delta = math.exp(other.double().mean()) - math.exp(full.double().mean())
    assert 0 < lo <= delta <= hi


def test_noise_of_mean_zero_gives_an_interval_across_zero_and_wider_with_more_noise():
    full = _nll(511)
    noise = torch.randn(511, generator=torch.Generator().manual_seed(1))
    narrow = delta_interval(full, full + 0.1 * (noise - noise.mean()))
    wide = delta_interval(full, full + 0.5 * (noise - noise.mean()))
    assert narrow[0] < 0 < narrow[1] and wide[0] < narrow[0] and wide[1] > narrow[1]


def test_the_interval_is_reproducible_and_takes_a_continuation_shorter_than_a_block():
    full, other = _nll(511), _nll(511, seed=2)
    assert delta_interval(full, other) == delta_interval(full, other)
    lo, hi = delta_interval(full[:5], other[:5])
    assert lo <= hi


@pytest.mark.parametrize("a, b", [(3, 4), (0, 0)])
def test_losses_of_two_lengths_or_none_are_refused(a, b):
    with pytest.raises(ValueError, match="two NLLs of one continuation"):
        delta_interval(_nll(a), _nll(b))


def test_compare_logits_reports_the_interval_around_its_delta_when_asked():
    g = torch.Generator().manual_seed(3)
    full = torch.randn(200, 50, generator=g)
    other = full + 0.3 * torch.randn(200, 50, generator=g)
    targets = torch.randint(50, (200,), generator=g)
    m = compare_logits(full, other, targets, interval=True)
    lo, hi = m["ppl_delta_interval"]
    assert lo <= m["ppl_other"] - m["ppl_full"] <= hi
    assert "ppl_delta_interval" not in compare_logits(full, other, targets)


def test_a_tails_recovery_counts_regens_gap_above_the_fp16_states_kl():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from harness import Result
    from regenerator_quality import recovery_rows

    def doc(regen, tail, fp16=None):
        r = {"regen": {"kl": regen}, "regen+tail64": {"kl": tail}}
        return r if fp16 is None else {**r, "fp16": {"kl": fp16}}

    res = Result("regenerator_quality")
    recovery_rows(res, [doc(0.005, 0.003, 0.001), doc(0.003, 0.003, 0.001)], 16, ["fp16", "regen", "regen+tail64"])
    (row,) = res.rows
    assert row["value"] == pytest.approx(1 / 3, abs=1e-4)       # a third of the gap above 0.001
    assert row["kl_fp16"] == pytest.approx(0.001) and "fp16 state" in row["gap_above"]
    plain = Result("regenerator_quality")
    recovery_rows(plain, [doc(0.004, 0.001)], 20, ["regen", "regen+tail64"])    # no fp16 column: the gap above 0
    assert plain.rows[0]["value"] == pytest.approx(0.75) and plain.rows[0]["gap_above"].startswith("0 ")
    none = Result("regenerator_quality")
    recovery_rows(none, [doc(0.001, 0.001, 0.002)], 16, ["fp16", "regen", "regen+tail64"])   # no gap: no row
    assert not none.rows


def test_the_mean_row_holds_the_largest_delta_to_twice_the_mean_and_to_twice_the_ratios_target():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from harness import Result
    from regenerator_quality import TARGET_MEANS, mean_rows

    def doc(delta, lo, kl):
        return {"regen": {"ppl_delta": delta, "ppl_delta_interval": [lo, delta + 0.1], "kl": kl}}

    # small deltas: the largest is above twice the mean (0.04), far within twice the 16x target (1.0)
    at = [doc(0.01, -0.05, 0.001), doc(0.01, -0.05, 0.001), doc(0.01, -0.05, 0.001), doc(0.09, 0.05, 0.003)]
    res = Result("regenerator_quality")
    mean_rows(res, at, 16.0, ["fp16", "regen"])     # a method no document has gives no row
    (row,) = res.rows
    assert row["value"] == pytest.approx(0.03) and row["largest"] == pytest.approx(0.09)
    assert row["within_twice_the_mean"] is False and row["above_twice_the_mean_beyond_noise"] == 0
    assert row["target_mean"] == TARGET_MEANS[16] == 0.5 and row["within_twice_the_target"] is True
    assert row["kl"] == pytest.approx(0.0015)
    over = Result("regenerator_quality")
    mean_rows(over, [doc(0.02, 0.0, 0.001), doc(0.07, 0.065, 0.002)], 4, ["regen"])   # 0.07 > 2 x 0.03
    assert over.rows[0]["within_twice_the_target"] is False
    assert over.rows[0]["above_twice_the_mean_beyond_noise"] == 0      # 0.065 is not above 2 x 0.045
    free = Result("regenerator_quality")
    mean_rows(free, [doc(0.5, 0.4, 0.01)], 12, ["regen"])     # no target at 12x: no bound given
    assert "target_mean" not in free.rows[0] and "within_twice_the_target" not in free.rows[0]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_eval_of_a_low_precision_model_says_its_rounding_moves_the_figures(tiny_models, dtype):
    from kite.model import load_model
    from kite.upcycle import CompressSettings, evaluate
    from kite.upcycle.codec import settings_for
    from tests.tiny_models import CORPUS

    lm = load_model(str(tiny_models["llama"]), device="cpu", dtype=dtype)
    r = evaluate(lm, CORPUS, context_tokens=60, continuation_tokens=20, settings=CompressSettings(codec=settings_for("fp16")))
    said = [w for w in r.warnings if "rounding noise" in w]
    assert bool(said) == (dtype == "bf16")
    assert not said or "the model runs in bf16" in said[0] and "--precision fp16" in said[0]


@pytest.mark.slow     # (a benchmark script in its own Python: a torch import)
def test_the_quality_benchmark_refuses_a_tail_of_no_tokens_before_any_work():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "regenerator_quality.py"), "--methods", "regen+tail",
                          "--recompute-tokens", "64", "0"], cwd=root, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--recompute-tokens: tails of 1 token or more" in run.stderr
    assert "Traceback" not in run.stderr and "calibration 1/" not in run.stderr
