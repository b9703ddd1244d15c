"""`kite report correlate`: regenerate rate against hit rate across bench runs, on synthetic
histories with a known relation (a clear knee at 0.85, one elsewhere, a straight line, a flat
one, too few runs), the statistics it rests on, and the command's inputs and outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kite.bench import stats
from kite.bench.correlate import collect, correlate
from kite.cli.main import app as cli
from tests.conftest import parse_json

runner = CliRunner()
FP = "kite-fp1:3f4a7011d96367304787803542aa"


def _record(i: int, x: float, y: float, loads: int = 100_000, **kw) -> dict:
    return {"run_id": f"run{i:08d}", "started_at": f"2026-11-30T10:{i:02d}:00+00:00", "status": "passed",
            "model": {"spec": "m", "fingerprint": FP}, "config": {"ratio": round(23.0 / x, 2)},
            "figures": {"fused": {"upcycle_regenerate_rate": x, "yoco_hit_rate": y, "loads": loads},
                        "full": {"f1": 0.6}}, **kw}


def _history(path, xs, ys, **kw):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(_record(i, float(x), float(y), **kw)) + "\n" for i, (x, y)
                            in enumerate(zip(xs, ys))))
    return path


def _points(xs, ys, tmp_path):
    return collect([], _history(tmp_path / "bench.jsonl", xs, ys))[0]


XS = np.linspace(0.2, 2.0, 14)
NOISE = np.random.default_rng(7).normal(0, 0.01, len(XS))


def _knee_at(k: float):
    return np.where(XS <= k, 0.3 + 0.5 * (XS - 0.2), 0.3 + 0.5 * (k - 0.2) + 0.02 * (XS - k)) + NOISE


def test_a_clear_knee_at_085_is_found_there(tmp_path):
    c = correlate(_points(XS, _knee_at(0.85), tmp_path))
    assert c.runs == 14 and c.knee["tested"]
    assert c.knee["p"] < 0.01 and abs(c.knee["knee"] - 0.85) < 0.1
    lo, hi = c.knee["interval"]
    assert lo <= 0.85 <= hi and c.knee["claim_inside"]
    assert c.knee["slope_below"] == pytest.approx(0.5, abs=0.1) and abs(c.knee["slope_above"]) < 0.1
    assert "a knee at" in c.knee["verdict"] and "0.85 lies inside it" in c.knee["verdict"]
    claim = c.knee["at_claim"]
    assert claim["p"] < 0.01 and claim["runs_below"] == 5 and claim["runs_above"] == 9
    assert c.pearson.value > 0 and c.pearson.interval[0] > 0 and "rises" in c.verdict
    assert "caveat" not in c.knee  # 100,000 loads a run: counting noise far below the scatter


def test_a_knee_finer_than_the_counting_noise_of_its_hit_rates_says_so(tmp_path):
    path = tmp_path / "bench.jsonl"
    path.write_text("".join(json.dumps(_record(i, float(x), float(y), loads=10)) + "\n"
                            for i, (x, y) in enumerate(zip(XS, _knee_at(0.85)))))
    c = correlate(collect([], path)[0])
    assert c.knee["tested"] and c.knee["scatter"] < c.knee["counting_noise"]
    assert "less than a hit rate counted over 10 loads is uncertain by" in c.knee["caveat"]


def test_a_knee_elsewhere_is_reported_where_it_is_not_at_085(tmp_path):
    c = correlate(_points(XS, _knee_at(1.5), tmp_path))
    assert c.knee["tested"] and c.knee["p"] < 0.01 and abs(c.knee["knee"] - 1.5) < 0.15
    assert not c.knee["claim_inside"] and "not where the seed puts it" in c.knee["verdict"]


def test_a_straight_line_has_no_knee(tmp_path):
    ys = 0.4 + 0.2 * XS + np.random.default_rng(3).normal(0, 0.03, len(XS))
    c = correlate(_points(XS, ys, tmp_path))
    assert c.knee["tested"] and c.knee["p"] > 0.05 and c.knee["verdict"].startswith("no knee")
    assert c.knee["at_claim"]["p"] > 0.05
    assert c.line["slope"] == pytest.approx(0.2, abs=0.05)
    assert c.pearson.interval[0] > 0 and c.spearman.value > 0.8


def test_unrelated_runs_show_no_correlation(tmp_path):
    ys = 0.7 + np.random.default_rng(11).normal(0, 0.05, len(XS))
    c = correlate(_points(XS, ys, tmp_path))
    assert c.pearson.interval[0] < 0 < c.pearson.interval[1] and "no correlation either way" in c.verdict


@pytest.mark.parametrize("n", [0, 1, 2])
def test_too_few_runs_for_a_correlation_say_so(tmp_path, n):
    c = correlate(_points(XS[:n], _knee_at(0.85)[:n], tmp_path))
    assert c.runs == n and c.pearson is None
    assert c.verdict.startswith(f"too few runs for a correlation: {n}") and not c.knee["tested"]


def test_too_few_runs_for_an_interval_or_a_knee_say_so(tmp_path):
    c3 = correlate(_points(XS[:3], _knee_at(0.85)[:3], tmp_path))
    assert c3.pearson.value is not None and c3.pearson.interval is None
    assert "too few runs for a confidence interval" in c3.verdict and "no conclusion" in c3.verdict
    c5 = correlate(_points(XS[::3], _knee_at(0.85)[::3], tmp_path))
    assert c5.runs == 5 and c5.pearson.interval is not None
    assert not c5.knee["tested"] and c5.knee["verdict"].startswith("too few runs to test for a knee: 5 runs")


def test_runs_all_on_one_side_of_the_claimed_knee_cannot_test_it(tmp_path):
    xs = np.linspace(1.0, 12.0, 8)  # the embedded model's states are all above 0.85 MB/1k tokens
    c = correlate(_points(xs, 0.5 + 0.01 * xs, tmp_path))
    claim = c.knee["at_claim"]
    assert "p" not in claim and claim["runs_below"] == 0 and "2 each side" in claim["why_not"]


def test_a_constant_hit_rate_gives_no_coefficient_and_says_why(tmp_path):
    c = correlate(_points(XS[:6], [1.0] * 6, tmp_path))  # 0.2 to 0.89: both sides of 0.85
    assert c.pearson is None and "the hit rate is 1 in every one of the 6 runs" in c.verdict
    assert c.knee["verdict"].startswith("none in these runs: the hit rate is flat (1) on both sides of 0.85 "
                                        "(5 runs at or below it, 1 above)")
    one_side = correlate(_points(XS[:4], [1.0] * 4, tmp_path))
    assert "every run lies at or below 0.85" in one_side.knee["verdict"]
    same_x = correlate(_points([2.0] * 4, [0.5, 0.6, 0.7, 0.8], tmp_path))
    assert same_x.pearson is None and "the same regenerate rate (2)" in same_x.verdict


def test_the_quality_hit_rate_can_be_read_instead(tmp_path):
    path = tmp_path / "bench.jsonl"
    recs = [_record(i, float(x), 1.0) for i, x in enumerate(XS[:6])]
    for r, helped in zip(recs, (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)):
        r["figures"]["fused"]["load_helped_rate"] = helped
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    points, _ = collect([], path, hit_rate="load_helped_rate")
    c = correlate(points, hit_rate="load_helped_rate")
    assert [p.hit_rate for p in points] == [0.5, 0.6, 0.7, 0.8, 0.9, 1.0] and c.pearson.value > 0.99
    assert c.hit_rate == "load_helped_rate"
    with pytest.raises(Exception, match="one of yoco_hit_rate, load_helped_rate"):
        collect([], path, hit_rate="f1")


def test_runs_that_did_not_finish_or_loaded_nothing_are_left_out_with_the_reason(tmp_path):
    path = _history(tmp_path / "bench.jsonl", XS[:4], _knee_at(0.85)[:4])
    extra = [_record(20, 1.0, 0.5, status="interrupted"), _record(21, 1.0, 0.5)]
    extra[1]["figures"]["fused"].update(yoco_hit_rate=None, loads=0)
    extra.append({**_record(22, 1.0, 0.5), "figures": {"full": {"f1": 0.5}}})
    with path.open("a") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in extra)
    points, skipped = collect([], path)
    assert len(points) == 4
    assert [s.why for s in skipped] == ["the run did not finish (interrupted)", "no yoco_hit_rate: no state was loaded",
                                        "no fused-pipeline figures"]


def _result(started: str, x: float, y: float) -> dict:
    return {"started_at": started, "status": "passed", "passed": True, "model": {"spec": "m", "fingerprint": FP},
            "config": {"ratio": 4.0}, "cases": [],
            "summary": {"overall": {"fused": {"upcycle_regenerate_rate": x, "yoco_hit_rate": y, "loads": 10}}}}


def test_result_files_and_the_history_each_count_a_run_once(tmp_path):
    hist = _history(tmp_path / "bench.jsonl", XS[:4], _knee_at(0.85)[:4])
    same = tmp_path / "same.json"  # the history's first run, as its result file
    same.write_text(json.dumps(_result("2026-11-30T10:00:00+00:00", float(XS[0]), 0.3)))
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_result("2026-12-01T10:00:00+00:00", 5.67, 1.0)))
    points, _ = collect([same, other, hist], hist)
    assert len(points) == 5 and points[-1].regenerate_rate == 5.67 and points[-1].ratio == 4.0


def test_the_command_reads_the_history_and_writes_its_plot(tmp_path, kite_home):
    _history(kite_home / "results" / "bench.jsonl", XS, _knee_at(0.85))
    res = runner.invoke(cli, ["report", "correlate", "--json"])
    assert res.exit_code == 0, res.output
    out = parse_json(res.output)
    assert out["runs"] == 14 and out["knee"]["tested"] and out["knee"]["claim_inside"]
    assert out["pearson"]["interval"][0] > 0
    assert out["plot"] == str(kite_home / "results" / "correlate.png")
    assert (kite_home / "results" / "correlate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = runner.invoke(cli, ["report", "correlate", "--plot", str(tmp_path / "c.png")])
    assert res.exit_code == 0, res.output
    assert "14 runs" in res.output and "a knee at" in res.output and "knee at 0.85" in res.output
    assert (tmp_path / "c.png").is_file()


def test_without_runs_the_command_says_so_and_writes_no_plot(tmp_path, kite_home):
    res = runner.invoke(cli, ["report", "correlate", "--plot", str(tmp_path / "c.png")])
    assert res.exit_code == 0 and "too few runs for a correlation: 0" in res.output, res.output
    assert "plot: none (no runs to plot)" in res.output and not (tmp_path / "c.png").exists()
    res = runner.invoke(cli, ["report", "correlate", "--json"])
    assert res.exit_code == 0 and parse_json(res.output)["plot"] is None


def test_the_command_takes_result_files_without_the_history(tmp_path, kite_home):
    _history(kite_home / "results" / "bench.jsonl", XS, _knee_at(0.85))
    f = tmp_path / "r.json"
    f.write_text(json.dumps(_result("2026-12-01T10:00:00+00:00", 5.67, 1.0)))
    res = runner.invoke(cli, ["report", "correlate", "--results", str(f), "--no-history", "--json",
                              "--plot", str(tmp_path / "c.png")])
    assert res.exit_code == 0, res.output
    out = parse_json(res.output)
    assert out["runs"] == 1 and out["verdict"].startswith("too few runs for a correlation: 1")


def test_the_command_refuses_bad_inputs_before_any_work(tmp_path):
    res = runner.invoke(cli, ["report", "correlate", "--results", str(tmp_path / "missing.json")])
    assert res.exit_code == 2 and "no such file" in res.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hello": 1}))
    res = runner.invoke(cli, ["report", "correlate", "--results", str(bad)])
    assert res.exit_code == 2 and "neither a bench result" in res.output
    res = runner.invoke(cli, ["report", "correlate", "--plot", str(tmp_path / "no" / "c.png")])
    assert res.exit_code == 2 and "--mkdir" in res.output
    res = runner.invoke(cli, ["report", "correlate", "--hit-rate", "f1"])
    assert res.exit_code == 2 and "one of yoco_hit_rate, load_helped_rate" in res.output


# -- the statistics -------------------------------------------------------------------------------

def test_f_and_t_tails_match_their_tables():
    assert stats.f_sf(3.0, 1, 10) == pytest.approx(0.11394, abs=1e-4)   # t = 1.732, 10 df, two-sided
    assert stats.f_ppf(0.95, 1, 10) == pytest.approx(4.9646, abs=1e-3)
    assert stats.f_ppf(0.95, 2, 5) == pytest.approx(5.7861, abs=1e-3)
    assert stats.betainc(2, 3, 0.4) == pytest.approx(0.5248, abs=1e-6)
    assert stats.r_pvalue(0.5, 20) == pytest.approx(0.0248, abs=1e-3)


def test_fisher_intervals_and_spearman_ranks():
    lo, hi = stats.fisher_interval(0.5, 20)
    assert (round(lo, 3), round(hi, 3)) == (0.074, 0.772)
    assert stats.fisher_interval(0.5, 3) is None
    assert list(stats.ranks([3, 1, 3, 2])) == [3.5, 1.0, 3.5, 2.0]
    assert stats.spearman([1, 2, 3, 4], [1, 4, 9, 16]) == pytest.approx(1.0)
    assert stats.pearson([1, 1, 1], [1, 2, 3]) is None


def test_the_knee_test_holds_its_level_on_lines():
    """Straight lines with noise: the sup-F test calls a knee in about 5 % of them, not more
    (a plain F-test at the best knee would call far more)."""
    rng = np.random.default_rng(0)
    x = np.linspace(0.2, 2.0, 12)
    calls = sum(stats.scan_knee(x, 0.3 + 0.2 * x + rng.normal(0, 0.05, len(x)), stats.knee_candidates(x),
                                boot=199, seed=i).p < 0.05 for i in range(40))
    assert calls <= 6  # 40 × 5 % = 2 expected; binomial 99.9th percentile ≈ 7


def test_a_perfect_hinge_is_found_exactly():
    x = np.linspace(0.2, 2.0, 10)
    y = np.where(x <= 0.85, x, 0.85)
    scan = stats.scan_knee(x, y, stats.knee_candidates(x), boot=99)
    assert scan.knee == pytest.approx(0.85, abs=0.02)
    assert scan.p <= 0.02 and scan.sup_f > 1e3
