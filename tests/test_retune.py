"""Per-label ratios and the flywheel: parts coded at their own widths, `compress` honouring a
label map, `kite upcycle retune` moving the map from the health store and re-encoding states."""

from __future__ import annotations

import pytest
import torch
import yaml
from typer.testing import CliRunner

from kite.cli.main import app
from kite.errors import BadInput
from kite.upcycle import cluster_ratios, codec, compress_settings, load_upcycle_config
from kite.upcycle.codec.coders import PcaSide
from kite.upcycle.codec.part_widths import part_widths
from kite.upcycle.compress import CompressSettings, compress_document
from kite.upcycle.format.container import StateFile
from kite.upcycle.load.prefix import load_prefix
from kite.yoco.flywheel import retune
from kite.upcycle.settings import UpcycleConfig
from kite.yoco.health import HealthStore
from tests.conftest import parse_json
from tests.tiny_models import CORPUS

runner = CliRunner()


def _layer(T=300, ratio=4.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(3, 0.05, 16)
    K = torch.randn(2, T, 16, generator=g) * scale
    V = torch.randn(2, T, 16, generator=g) * scale.flip(0)
    return K, V, codec.fit_layer(K, V, codec.settings_for(ratio))


def test_part_widths_round_trip_and_cost_fewer_bytes():
    K, V, lc = _layer()
    pos = torch.arange(K.shape[1])
    plain = codec.encode(lc, K, V, pos)
    widths = {s: part_widths(lc, s, X, 12.0, from_ratio=4.0, positions=pos) for s, X in (("k", K), ("v", V))}
    for s in ("k", "v"):
        assert bool((widths[s] <= PcaSide.layer_widths(lc, s)).all())        # never above the layer's
    tight = codec.encode(lc, K, V, pos, widths)
    assert tight.k.meta["bits"] == widths["k"].tolist()
    assert codec.nbytes(tight) < 0.6 * codec.nbytes(plain)
    # a decoded part round-trips through bytes, and its error grows with the ratio, not wildly
    back = codec.decode(lc, codec.EncodedPart(codec.from_bytes(codec.to_bytes(tight.k)),
                                              codec.from_bytes(codec.to_bytes(tight.v))))
    err_plain = (codec.decode(lc, plain)[1] - V).pow(2).mean()
    err_tight = (back[1] - V).pow(2).mean()
    assert err_plain < err_tight < V.pow(2).mean()


def test_a_column_a_part_does_not_code_decodes_to_the_mean():
    K, V, lc = _layer()
    R = PcaSide.layer_widths(lc, "v").numel()
    part = codec.encode(lc, K, V, None, {"v": torch.zeros(R, dtype=torch.long)})
    _, v = codec.decode(lc, part)
    mean = lc.tensors["v.mean"].float().reshape(-1)      # joint heads: one block of H*d
    assert torch.allclose(v.permute(1, 0, 2).reshape(v.shape[1], -1), mean.expand(v.shape[1], -1), atol=1e-6)


def test_bad_part_widths_are_refused():
    K, V, lc = _layer()
    R = PcaSide.layer_widths(lc, "k").numel()
    with pytest.raises(ValueError, match="part widths"):
        codec.encode(lc, K, V, None, {"k": torch.full((R,), 9)})
    with pytest.raises(ValueError, match="part widths"):
        codec.encode(lc, K, V, None, {"k": torch.ones(R + 1, dtype=torch.long)})
    raw = codec.fit_layer(K, V, codec.settings_for("fp16"))
    with pytest.raises(ValueError, match="need a PCA side"):
        codec.encode(raw, K, V, None, {"k": torch.ones(3, dtype=torch.long)})
    with pytest.raises(ValueError, match="> 1"):
        part_widths(lc, "k", K, 1.0, from_ratio=4.0)
    # a lower ratio than the widths were made for cannot add what they do not hold
    assert torch.equal(part_widths(lc, "k", K, 2.0, from_ratio=4.0), PcaSide.layer_widths(lc, "k"))


def _settings(**kw):
    return CompressSettings(codec=codec.settings_for(4.0), n_clusters=3, min_span_tokens=8, max_span_tokens=24, **kw)


def _cluster_ratio(state: StateFile, c: int, lm) -> float:
    nbytes = sum(e.raw_length for k, e in state.index.items() if k.startswith(f"c{c}/"))
    return state.meta["clusters"][c]["n_tokens"] * lm.geometry.kv_bytes_per_token("fp16") / nbytes


@pytest.fixture(scope="module")
def lm(tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models["llama"]), device="cpu")


def test_compress_codes_each_label_at_its_ratio(lm, tmp_path):
    plain, tuned = tmp_path / "plain.upc", tmp_path / "tuned.upc"
    compress_document(lm, CORPUS, plain, _settings())
    compress_document(lm, CORPUS, tuned, _settings(label_ratios={"cluster-0": 12.0, "cluster-2": 2.5}))
    with StateFile(plain) as a, StateFile(tuned) as b:
        assert "label_ratios" not in a.meta and all("ratio" not in c for c in a.meta["clusters"])
        assert b.meta["label_ratios"] == {"default": 4.0, "labels": {"cluster-0": 12.0, "cluster-2": 2.5}}
        assert [c["ratio"] for c in b.meta["clusters"]] == [12.0, 4.0, 2.5]
        assert b.meta["codec"]["name"] == "ratio=2.5"          # layers fitted at the lowest ratio in play
        # each cluster's parts cost what they would at the layers' widths, times 2.5 / its ratio
        r2 = _cluster_ratio(b, 2, lm)
        assert _cluster_ratio(b, 1, lm) == pytest.approx(r2 * 4 / 2.5, rel=0.15)
        assert _cluster_ratio(b, 0, lm) == pytest.approx(r2 * 12 / 2.5, rel=0.15)
    # it loads (on the host: its parts carry their own widths) and keeps every token
    prefix, _ = load_prefix(tuned, lm)
    full, _ = load_prefix(plain, lm)
    assert prefix.tokens_per_layer() == full.tokens_per_layer()


def test_label_ratios_from_the_config_file_and_flags(tmp_path):
    (tmp_path / "ratios.yaml").write_text("Confidentiality: 12\nPayment: 3\n")
    cfg_file = tmp_path / "upcycle_config.yaml"
    cfg_file.write_text("compression:\n  svd_ratio: 0.125\n  label_ratios: ratios.yaml\n")
    cfg, path = load_upcycle_config(cfg_file)
    s = compress_settings(cfg, config_path=path, label_ratios={"Payment": 5.0})
    assert s.label_ratios == {"Confidentiality": 12.0, "Payment": 5.0}       # flags over the file
    (tmp_path / "ratios.yaml").write_text("Confidentiality: 0.5\n")
    with pytest.raises(BadInput, match=r"ratios.yaml: Confidentiality: ratio 0.5 must be > 1"):
        compress_settings(cfg, config_path=path)
    with pytest.raises(BadInput, match="need a compression ratio"):
        compress_settings(UpcycleConfig(compression={"label_ratios": {"Payment": 8}}), precision="int8")


def _state_dir(lm, tmp_path):
    folder = tmp_path / "states"
    folder.mkdir()
    compress_document(lm, CORPUS, folder / "contract.upc", _settings())
    return folder


def _record(store: HealthStore, label: str, gain: float, n: int, state="contract"):
    for _ in range(n):
        store.record(state, label, gain)


def test_retune_moves_ratios_and_reencodes_without_the_document(lm, tmp_path):
    folder = _state_dir(lm, tmp_path)
    path = folder / "contract.upc"
    before, _ = load_prefix(path, lm)
    with StateFile(path) as st:
        old_blobs = {k: st.read(k) for k in st.index}
        old_ratio0 = _cluster_ratio(st, 0, lm)
    size0 = path.stat().st_size
    with HealthStore(tmp_path / "h.sqlite") as store:
        _record(store, "cluster-0", 0.03, 6)      # its loads hold quality: compress further
        _record(store, "cluster-1", -0.01, 6)     # poor gain: more bytes (its state cannot get them back)
        _record(store, "cluster-2", 0.03, 2)      # too few loads to tell
        report = retune(folder, store, default_ratio=4.0)
        kept_records = {r.cluster: r.loads for r in store.records("contract")}
    by = {d.label: d for d in report.labels}
    assert (by["cluster-0"].ratio_after, by["cluster-1"].ratio_after, by["cluster-2"].ratio_after) == (6.0, pytest.approx(4 / 1.5, abs=1e-3), 4.0)
    assert "too few" in by["cluster-2"].why
    saved = yaml.safe_load((folder / "label_ratios.yaml").read_text())
    assert saved["label_ratios"] == {"cluster-0": 6.0, "cluster-1": pytest.approx(4 / 1.5, abs=1e-3)}
    st_report, = report.states
    assert st_report.action == "retuned" and st_report.retuned == {"cluster-0": 6.0}
    assert st_report.needs_document == {"cluster-1": pytest.approx(4 / 1.5, abs=1e-3)}
    assert st_report.bytes_after == path.stat().st_size < size0
    with StateFile(path) as st:
        assert cluster_ratios(st.meta) == [6.0, 4.0, 4.0]
        assert _cluster_ratio(st, 0, lm) == pytest.approx(1.5 * old_ratio0, rel=0.15)   # 4× → 6×
        for k in st.index:   # only cluster 0's parts changed, byte for byte
            assert (st.read(k) == old_blobs[k]) == (not k.startswith("c0/")), k
        assert st.meta["retuned"][0]["clusters"] == {"0": [4.0, 6.0]}
    after, _ = load_prefix(path, lm)
    for kb, ka in zip(before.keys, after.keys):   # the re-encoded keys stay close to what was stored
        assert (ka - kb).pow(2).mean() < 0.2 * kb.pow(2).mean()
    with HealthStore(tmp_path / "h.sqlite") as store:
        assert {r.cluster: r.loads for r in store.records("contract")} == kept_records   # same id, records kept
        # the same evidence does not move a ratio twice; new loads do
        again = retune(folder, store, default_ratio=4.0)
        assert {d.label: d.ratio_after for d in again.labels}["cluster-0"] == 6.0
        assert again.states[0].action == "unchanged"
        _record(store, "cluster-0", 0.03, 5)
        third = retune(folder, store, default_ratio=4.0)
        assert {d.label: d.ratio_after for d in third.labels}["cluster-0"] == 9.0
        assert third.states[0].retuned == {"cluster-0": 9.0}


def test_a_label_without_loads_keeps_its_ratio_and_reports_no_health():
    import json
    from dataclasses import asdict

    from kite.yoco.flywheel import RetunePolicy, decide

    d, = decide({}, {"payment": 6.0}, 4.0, RetunePolicy())
    assert (d.label, d.loads, d.health, d.ratio_before, d.ratio_after) == ("payment", 0, None, 6.0, 6.0)
    json.dumps(asdict(d), allow_nan=False)   # --json stays valid JSON


def test_retune_skips_a_state_made_with_a_preset(lm, tmp_path):
    folder = _state_dir(lm, tmp_path)
    exact = CompressSettings(codec=codec.settings_for("exact"), n_clusters=3, min_span_tokens=8, max_span_tokens=24)
    compress_document(lm, CORPUS, folder / "exact.upc", exact)
    data = (folder / "exact.upc").read_bytes()
    with HealthStore(tmp_path / "h.sqlite") as store:
        _record(store, "cluster-0", 0.03, 6, state="exact")
        report = retune(folder, store, default_ratio=4.0)
    skipped = {s.path: s for s in report.states}[str(folder / "exact.upc")]
    assert skipped.action == "skipped" and "exact preset" in skipped.reason
    assert (folder / "exact.upc").read_bytes() == data


def test_retune_dry_run_writes_nothing(lm, tmp_path):
    folder = _state_dir(lm, tmp_path)
    data = (folder / "contract.upc").read_bytes()
    with HealthStore(tmp_path / "h.sqlite") as store:
        _record(store, "cluster-0", 0.03, 6)
        report = retune(folder, store, default_ratio=4.0, dry_run=True)
    assert report.states[0].action == "retuned" and report.ratios_file is None
    assert (folder / "contract.upc").read_bytes() == data and not (folder / "label_ratios.yaml").exists()


def test_retune_cli(lm, tiny_models, tmp_path, monkeypatch):
    folder = _state_dir(lm, tmp_path)
    db = tmp_path / "h.sqlite"
    with HealthStore(db) as store:
        _record(store, "cluster-0", 0.03, 6)
    res = runner.invoke(app, ["upcycle", "retune", "--upcycle-dir", str(folder), "--health-db", str(db), "--json"])
    assert res.exit_code == 0, res.output
    out = parse_json(res.output)
    assert out["states"][0]["retuned"] == {"cluster-0": 6.0} and out["bytes_after"] < out["bytes_before"]
    res = runner.invoke(app, ["upcycle", "retune", "--upcycle-dir", str(folder), "--health-db", str(db)])
    assert res.exit_code == 0 and "cluster-0" in res.output
    # bad input: one line each, exit 2
    for args, message in (
            (["--health-db", str(tmp_path / "nope.sqlite")], "no such file"),
            (["--health-db", str(db), "--step", "1"], "--step 1"),
            (["--health-db", str(db), "--min-ratio", "8", "--max-ratio", "4"], "need 1 < min ≤ max")):
        res = runner.invoke(app, ["upcycle", "retune", "--upcycle-dir", str(folder), *args])
        assert res.exit_code == 2 and message in res.output, res.output
    empty = tmp_path / "empty"
    empty.mkdir()
    res = runner.invoke(app, ["upcycle", "retune", "--upcycle-dir", str(empty), "--health-db", str(db)])
    assert res.exit_code == 2 and "no .upc states" in res.output


def test_compress_cli_label_ratio_flag(tiny_models, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS)
    out = tmp_path / "d.upc"
    res = runner.invoke(app, ["upcycle", "compress", "-i", str(doc), "-o", str(out), "-m", str(tiny_models["llama"]),
                              "--ratio", "4", "--label-ratio", "Nope=10", "--json"])
    assert res.exit_code == 0, res.output
    with StateFile(out) as st:
        assert st.meta["label_ratios"]["labels"] == {"Nope": 10.0}
    res = runner.invoke(app, ["upcycle", "compress", "-i", str(doc), "-o", str(out), "-m", str(tiny_models["llama"]),
                              "--label-ratio", "Nope"])
    assert res.exit_code == 2 and "LABEL=RATIO" in res.output
