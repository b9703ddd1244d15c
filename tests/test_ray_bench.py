"""`kite bench run --ray` and `kite tune auto --ray` on a local Ray cluster (127.0.0.1): the cases and
the grid's points spread over Ray's workers give the results a local run gives (answers, F1, PPL,
the fused pipeline's decisions; timings are the machine's)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kite.cli.main import app
from tests.conftest import parse_json
from tests.test_bench import bench_inputs
from tests.test_tune import RULES

runner = CliRunner()


def _timeless(obj):
    """`obj` without what measures time or memory (those are the machine's, run to run)."""
    if isinstance(obj, dict):
        return {k: _timeless(v) for k, v in obj.items()
                if not any(t in k for t in ("_ms", "ms_", "timings", "tokens_per_s", "memory", "qps", "latency",
                                            "wall", "ttft", "build"))}
    if isinstance(obj, list):
        return [_timeless(v) for v in obj]
    return obj


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One torch thread in this process (a loaded 2-core box)."""


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    pytest.importorskip("ray")
    import ray

    from kite.ray_session import connect

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KITE_HOME", str(tmp_path_factory.mktemp("ray-home")))
        assert connect(num_cpus=2) is True
        try:
            yield
        finally:
            ray.shutdown()


def test_shards_keep_each_record_whole_and_the_case_ids(tmp_path):
    from kite.bench.on_ray import shard_records
    from kite.bench.runner import BenchSettings

    cases, _, _ = bench_inputs(tmp_path)
    s = BenchSettings(cases=str(cases), output="", model="m", upcycle_dir=str(tmp_path))
    order, texts = shard_records(s, 2)
    assert order == ["a/q0", "b/q0"] and len(texts) == 2
    ids = [json.loads(t)["id"] for t in texts]
    assert ids == ["a", "b"]
    assert [q["id"] for t in texts for q in json.loads(t)["questions"]] == ["q0", "q0"]
    order, texts = shard_records(BenchSettings(cases=str(cases), output="", model="m", upcycle_dir="",
                                               max_cases=1), 4)
    assert order == ["a/q0"] and len(texts) == 1   # the run's case limit holds across shards


@pytest.mark.ray
def test_bench_run_on_ray_gives_the_local_runs_results(ray_cluster, tmp_path, tiny_models):
    cases, cfg, rules = bench_inputs(tmp_path)
    th = tmp_path / "bench.yaml"
    th.write_text("thresholds:\n  memory_peak_gb: {max: 1000, unit: GB}\n")

    def run(out, *extra):
        r = runner.invoke(app, ["bench", "run", "--model", str(tiny_models["llama"]), "--upcycle",
                                str(tmp_path / "states"), "--upcycle-config", str(cfg), "--yoco-rules", str(rules),
                                "--cases", str(cases), "--output", str(tmp_path / out), "--thresholds", str(th),
                                "--baselines", "full,window,state", "--max-new-tokens", "4", "--json", *extra],
                          prog_name="kite")
        assert r.exit_code == 0, r.output
        return parse_json(r.output)

    local = run("local.json")
    spread = run("ray.json", "--ray")
    assert spread["ray"]["shards"] == 2 and spread["complete"] and spread["passed"]
    assert [c["id"] for c in spread["cases"]] == [c["id"] for c in local["cases"]]
    for a, b in zip(local["cases"], spread["cases"]):
        assert _timeless(a["methods"]) == _timeless(b["methods"]), a["id"]
    assert _timeless(local["summary"]) == _timeless(spread["summary"])
    assert json.loads((tmp_path / "ray.json").read_text())["ray"]["workers"] == 2


@pytest.mark.ray
def test_tune_grid_on_ray_gives_the_local_sweeps_figures(ray_cluster, tmp_path, tiny_models):
    cases, cfg, rules = bench_inputs(tmp_path, RULES)
    common = ["tune", "auto", "--model", str(tiny_models["llama"]), "--cases", str(cases), "--upcycle-config",
              str(cfg), "--yoco-rules", str(rules), "--upcycle", str(tmp_path / "states"), "--mkdir",
              "--max-new-tokens", "3", "--param", "ratio", "--values", "2,4", "--objective", "bytes", "--json"]
    local = runner.invoke(app, [*common, "--output", str(tmp_path / "local" / "best.yaml")], prog_name="kite")
    spread = runner.invoke(app, [*common, "--output", str(tmp_path / "ray" / "best.yaml"), "--ray"], prog_name="kite")
    assert local.exit_code == 0, local.output
    assert spread.exit_code == 0, spread.output
    a, b = parse_json(local.output), parse_json(spread.output)
    assert [p["params"] for p in a["points"]] == [p["params"] for p in b["points"]]
    for pa, pb in zip(a["points"], b["points"]):
        assert _timeless(pa["figures"]) == _timeless(pb["figures"]), pa["params"]
    assert a["best"]["params"] == b["best"]["params"]


def test_tune_on_ray_refuses_optuna_before_anything_runs(tmp_path, tiny_models):
    cases, cfg, rules = bench_inputs(tmp_path, RULES)
    r = runner.invoke(app, ["tune", "auto", "--model", str(tiny_models["llama"]), "--cases", str(cases),
                            "--upcycle-config", str(cfg), "--yoco-rules", str(rules), "--upcycle",
                            str(tmp_path / "states"), "--mkdir", "--param", "ratio", "--values", "2,4",
                            "--objective", "bytes", "--search", "optuna", "--trials", "2", "--ray",
                            "--output", str(tmp_path / "best.yaml")], prog_name="kite")
    assert r.exit_code == 2, r.output
    assert "--ray" in r.output
