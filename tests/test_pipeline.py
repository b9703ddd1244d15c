"""The pipeline assembled in one place: the settings precedence, its checks, and every command
taking the config's span bounds and cluster count from it."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kite.cli.main import app
from kite.errors import BadInput
from kite.upcycle import UpcycleConfig, compress_settings, open_pipeline
from tests.conftest import parse_json
from tests.tiny_models import CORPUS

runner = CliRunner()


def _cfg(**compression) -> UpcycleConfig:
    return UpcycleConfig.model_validate({"compression": compression})


def test_flag_beats_kite_config_fraction_beats_config_precision_beats_svd_ratio():
    cfg = _cfg(svd_ratio=0.125, precision="int8")
    assert compress_settings(cfg, precision="int4", kept_fraction=0.5).codec.name == "int4"
    assert compress_settings(cfg, ratio=2, kept_fraction=0.125).codec.name == "ratio=2"
    assert compress_settings(cfg, kept_fraction=0.5).codec.name == "ratio=2"   # ratio = 1 / fraction
    assert compress_settings(cfg).codec.name == "int8"
    assert compress_settings(_cfg(svd_ratio=0.125)).codec.name == "ratio=8"
    assert compress_settings(_cfg(svd_ratio=0.125), kept_fraction=0.25).codec.name == "ratio=4"


def test_the_default_is_unchanged_a_ratio_4_state():
    from kite import config as C

    assert C.DEFAULTS["features.upcycle_compression_ratio"] is None
    assert compress_settings(UpcycleConfig(), kept_fraction=None).codec.name == "ratio=4"


def test_ratio_and_precision_together_are_refused():
    with pytest.raises(BadInput, match="use one of --ratio or --precision"):
        compress_settings(_cfg(), ratio=4, precision="int8")
    # a precision beats the config's fraction (a default, not a flag) without complaint
    assert compress_settings(_cfg(), precision="int8", kept_fraction=0.5).codec.name == "int8"


def test_span_bounds_and_clusters_come_from_the_config():
    s = compress_settings(_cfg(min_span_tokens=12, max_span_tokens=40, cluster_num=5))
    assert (s.min_span_tokens, s.max_span_tokens, s.n_clusters) == (12, 40, 5)
    assert compress_settings(_cfg(cluster_num=5), clusters=2).n_clusters == 2


@pytest.mark.parametrize("kw,message", [
    ({"ratio": 0.5}, "a compression ratio is ≥ 1"),
    ({"precision": "int5"}, "--precision int5: expected one of"),
    ({"precision": "ratio=4"}, "--precision ratio=4: expected one of"),
    ({"clusters": 0}, "at least one cluster"),
    ({"ratio": 0.25}, "the fraction kept 0.25 is --ratio 4"),
    ({"kept_fraction": 1.5}, "features.upcycle_compression_ratio 1.5"),
    ({"ratio": float("nan")}, "--ratio nan: a compression ratio is a finite number"),
    ({"ratio": float("inf")}, "--ratio inf: a compression ratio is a finite number"),
])
def test_bad_flags_are_bad_input(kw, message):
    with pytest.raises(BadInput, match=message):
        compress_settings(_cfg(), **kw)


def test_bad_flags_fail_before_the_model_loads(monkeypatch):
    import kite.model

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kite.model, "load_model", no_model)
    with pytest.raises(BadInput):
        open_pipeline("anything", ratio=0.5)


def _compress_with(compression: str, model: str, tmp_path):
    """`kite upcycle compress --json` of the tiny corpus into tmp_path/d.upc under an upcycle config
    whose compression section is ``compression`` (YAML lines): (its result, the config, the input)."""
    cfg = tmp_path / "upcycle.yaml"
    cfg.write_text(f"compression:\n{compression}semantic_tagging:\n  generated_examples_per_label: 0\n")
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS.replace(". ", ".\n\n"))
    made = runner.invoke(app, ["upcycle", "compress", "--model", model, "--input", str(doc), "--output",
                               str(tmp_path / "d.upc"), "--config", str(cfg), "--json"])
    assert made.exit_code == 0, made.output
    return made, cfg, doc


def test_compress_and_eval_take_span_bounds_from_the_config(tiny_models, tmp_path):
    model = str(tiny_models["llama"])
    made, cfg, doc = _compress_with("  svd_ratio: 0.25\n  cluster_num: 2\n  min_span_tokens: 6\n  max_span_tokens: 14\n",
                                    model, tmp_path)
    evald = runner.invoke(app, ["upcycle", "eval", "--model", model, "--input", str(doc), "--config", str(cfg),
                                "--context-tokens", "200", "--continuation-tokens", "40", "--json"])
    assert evald.exit_code == 0, evald.output
    for out in (parse_json(made.output), parse_json(evald.output)):
        assert (out["spans"]["min_tokens"], out["spans"]["max_tokens"]) == (6, 14)
        assert out["spans"]["count"] > 0
    assert len(parse_json(made.output)["clusters"]) == 2


def test_per_head_bases_come_from_the_config_for_ratios_only():
    assert compress_settings(_cfg()).codec.joint_heads
    per_head = compress_settings(_cfg(joint_heads=False), ratio=8).codec
    assert not per_head.joint_heads and per_head.name == "ratio=8"
    assert compress_settings(_cfg(joint_heads=False), precision="int8").codec.name == "int8"


def test_a_state_compressed_with_per_head_bases_has_a_basis_per_kv_head(tiny_models, tmp_path):
    """compression.joint_heads: false through `kite upcycle compress` gives a state whose staged layers
    hold a PCA basis per KV head (blocks of head_dim dims), recorded in its codec settings."""
    from kite.model import load_model
    from kite.upcycle import SINK_TOKENS, StateFile
    from kite.upcycle.load import HotTier, select, stage_state

    model = str(tiny_models["llama"])
    _compress_with("  joint_heads: false\n  cluster_num: 2\n  min_span_tokens: 6\n  max_span_tokens: 14\n",
                   model, tmp_path)
    geo = load_model(model, device="cpu").geometry
    with StateFile(tmp_path / "d.upc") as state:
        assert state.meta["codec"]["joint_heads"] is False
        sel = select(state, None, SINK_TOKENS)
        layers = list(range(geo.n_layers))
        hot = stage_state(state, sel.parts, sel.part_positions, layers, n_layers=geo.n_layers, H=geo.n_kv_heads,
                          d=geo.head_dim, verify=True, tier=HotTier(), key=("per-head",), wait=True)
        plans = [hot.wait(layer) for layer in layers]
    assert all(p is not None for p in plans)
    assert {(p.sides[s].B, p.sides[s].D) for p in plans for s in ("k", "v")} == {(geo.n_kv_heads, geo.head_dim)}


@pytest.mark.parametrize("command", ["compress", "eval"])
def test_ratio_with_precision_is_refused_before_the_model_loads(command, tmp_path, monkeypatch, tiny_models):
    import kite.model

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kite.model, "load_model", no_model)
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS)
    args = ["upcycle", command, "--model", str(tiny_models["llama"]), "--input", str(doc), "--ratio", "4",
            "--precision", "int8"]
    r = runner.invoke(app, args + (["--output", str(tmp_path / "d.upc")] if command == "compress" else []))
    assert r.exit_code == 2, r.output
    assert "use one of --ratio or --precision" in r.stderr and "model was loaded" not in r.output


def test_config_fraction_sets_the_ratio_of_compress(tiny_models, tmp_path):
    """`kite config set features.upcycle_compression_ratio 0.5` then `kite upcycle compress`: a
    ratio=2 state; unset, the upcycle config's svd_ratio 0.25 gives ratio=4; --ratio beats both."""
    cfg = tmp_path / "upcycle.yaml"
    cfg.write_text("compression:\n  svd_ratio: 0.25\n  cluster_num: 2\n  min_span_tokens: 6\n  max_span_tokens: 14\n"
                   "semantic_tagging:\n  generated_examples_per_label: 0\n")
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS.replace(". ", ".\n\n"))

    def codec_of(*extra: str) -> str:
        out = tmp_path / "d.upc"
        made = runner.invoke(app, ["upcycle", "compress", "--model", str(tiny_models["llama"]), "--input", str(doc),
                                   "--output", str(out), "--config", str(cfg), *extra])
        assert made.exit_code == 0, made.output
        shown = runner.invoke(app, ["upcycle", "inspect", str(out), "--json"])
        assert shown.exit_code == 0, shown.output
        return parse_json(shown.stdout)["codec"]["name"]

    assert codec_of() == "ratio=4"
    assert runner.invoke(app, ["config", "set", "features.upcycle_compression_ratio", "0.5"]).exit_code == 0
    assert codec_of() == "ratio=2"
    assert codec_of("--ratio", "8") == "ratio=8"


def test_a_ratio_the_document_cannot_be_coded_to_is_written_with_a_warning(tiny_models, tmp_path):
    """A short document at a ratio far past its floor: the state is written as small as it goes, and
    the command says so on stderr in one line (and in --json's ``warnings``), naming the ratio asked."""
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS)
    made = runner.invoke(app, ["upcycle", "compress", "--model", str(tiny_models["llama"]), "--input", str(doc),
                               "--output", str(tmp_path / "d.upc"), "--ratio", "1000", "--json"])
    assert made.exit_code == 0, made.output
    out = parse_json(made.output)
    assert out["ratio_asked"] == 1000 and out["compression_ratio"] < 100
    (line,) = out["warnings"]
    assert "not the 1000× asked" in line
    assert f"warning: {line[:40]}" in " ".join(made.output.split())
    plain = runner.invoke(app, ["upcycle", "compress", "--model", str(tiny_models["llama"]), "--input", str(doc),
                                "--output", str(tmp_path / "e.upc"), "--ratio", "4", "--json"])
    assert plain.exit_code == 0 and parse_json(plain.output)["warnings"] == []
