"""Upcycle on tiny random models: exact reuse, positions, partial loads, CLI, bad input."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from typer.testing import CliRunner

from kite.cli.main import app
from kite.errors import BadInput, FingerprintMismatch
from kite.runtime.cache import cache_layers, new_cache
from kite.runtime.generate import forward_tokens
from kite.upcycle import codec
from kite.upcycle.capture import tokenize_document
from kite.upcycle.compress import CompressSettings, compress_document
from kite.upcycle.load import load_prefix
from kite.upcycle.format import StateFile
from tests.conftest import parse_json
from tests.tiny_models import CORPUS, make_tiny_model

runner = CliRunner()
DOC = CORPUS.replace(". ", ".\n\n", 3)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lm(request, tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models[request.param]), device="cpu")


def _exact(n_clusters=3, **kw):
    return CompressSettings(codec=codec.settings_for("exact"), n_clusters=n_clusters, min_span_tokens=8,
                            max_span_tokens=24, **kw)


def test_exact_reuse_matches_full_prefill(lm, tmp_path):
    """Invariant 1: every cluster, no truncation, fp32 → same logits as document + query."""
    out = tmp_path / "doc.upc"
    result = compress_document(lm, DOC, out, _exact())
    assert len(result.clusters) > 1
    ids, _ = tokenize_document(lm.tokenizer, DOC)
    query = lm.tokenizer(" What is the capital of France?", add_special_tokens=False)["input_ids"]
    full = forward_tokens(lm.model, ids + query, new_cache(lm.model), 0)[-len(query):]
    prefix, report = load_prefix(out, lm)
    got = forward_tokens(lm.model, query, new_cache(lm.model, prefix), prefix.next_position)
    assert (full - got).abs().max() <= 1e-4
    assert report.tokens == len(ids) and prefix.next_position == len(ids)


def test_partial_load_keeps_positions(lm, tmp_path):
    """Invariant 2: a cluster's tokens come back exactly, at their own positions, nothing else."""
    out = tmp_path / "doc.upc"
    compress_document(lm, DOC, out, _exact())
    ids, _ = tokenize_document(lm.tokenizer, DOC)
    cache = new_cache(lm.model)
    forward_tokens(lm.model, ids, cache, 0)
    meta = StateFile(out).meta
    cluster = meta["clusters"][1]
    idx = torch.cat([torch.arange(s, e) for s, e in cluster["token_ranges"]])
    prefix, report = load_prefix(out, lm, clusters=[str(cluster["id"])], layers=[0, 2], sink_tokens=0)
    assert report.tokens == idx.numel() and report.layers == [0, 2]
    layers = cache_layers(cache)
    for layer in (0, 2):
        assert torch.allclose(prefix.keys[layer], layers[layer][0][0][:, idx], atol=1e-5)
        assert torch.allclose(prefix.values[layer], layers[layer][1][0][:, idx], atol=1e-6)
    assert prefix.keys[1].shape[1] == 0  # a layer left out holds nothing
    assert prefix.next_position == len(ids)  # the query still follows the whole document


def test_partial_load_brings_the_attention_sinks(lm, tmp_path):
    out = tmp_path / "doc.upc"
    compress_document(lm, DOC, out, _exact())
    meta = StateFile(out).meta
    other = next(c for c in meta["clusters"] if c["token_ranges"][0][0] > 0)
    idx = torch.cat([torch.arange(s, e) for s, e in other["token_ranges"]])
    ids, _ = tokenize_document(lm.tokenizer, DOC)
    cache = new_cache(lm.model)
    forward_tokens(lm.model, ids, cache, 0)
    prefix, report = load_prefix(out, lm, clusters=[str(other["id"])])
    assert report.sink_tokens == 4 and report.tokens == idx.numel() + 4
    want = torch.cat([torch.arange(4), idx]).sort().values
    assert torch.allclose(prefix.keys[1], cache_layers(cache)[1][0][0][:, want], atol=1e-5)
    everything, report = load_prefix(out, lm)
    assert report.sink_tokens == 0  # nothing extra when every cluster is loaded


@pytest.mark.parametrize("layers", [[0], [0, 2], [1, 2]])
def test_a_load_into_some_layers_stays_causal(lm, tmp_path, layers):
    """A query token never sees the tokens after it, whichever layers hold the state (the mask
    made for layer 0's prefix was cut from the left for layers holding less, which let every
    query token see the whole query)."""
    out = tmp_path / "doc.upc"
    compress_document(lm, DOC, out, _exact())
    first, second = [5, 6, 7, 8, 9, 10], [5, 6, 7, 99, 98, 97]
    logits = []
    for query in (first, second):
        prefix, _ = load_prefix(out, lm, layers=layers)
        logits.append(forward_tokens(lm.model, query, new_cache(lm.model, prefix), prefix.next_position))
    assert torch.equal(logits[0][:3], logits[1][:3])
    assert not torch.equal(logits[0][3:], logits[1][3:])


def test_clusters_partition_the_document(lm, tmp_path):
    result = compress_document(lm, DOC, tmp_path / "d.upc", _exact(n_clusters=4))
    covered = sorted(t for c in result.clusters for s, e in c.token_ranges for t in range(s, e))
    assert covered == list(range(result.n_tokens))


def test_precision_on_load_is_lossy_but_close(lm, tmp_path):
    out = tmp_path / "doc.upc"
    compress_document(lm, DOC, out, _exact())
    exact, _ = load_prefix(out, lm)
    int8, _ = load_prefix(out, lm, precision="int8")
    rel = (exact.values[0] - int8.values[0]).norm() / exact.values[0].norm()
    assert 0 < rel < 0.02
    with pytest.raises(BadInput, match="precision"):
        load_prefix(out, lm, precision="int9")


def test_unknown_cluster_label_is_bad_input(lm, tmp_path):
    out = tmp_path / "doc.upc"
    compress_document(lm, DOC, out, _exact())
    with pytest.raises(BadInput, match="not in this state"):
        load_prefix(out, lm, clusters=["no_such_label"])


def test_other_model_is_refused_with_migrate_hint(tiny_models, tmp_path):
    from kite.model import load_model

    a = load_model(str(tiny_models["llama"]), device="cpu")
    b = load_model(str(make_tiny_model(tmp_path / "other", "llama", seed=5)), device="cpu")
    out = tmp_path / "doc.upc"
    compress_document(a, DOC, out, _exact())
    with pytest.raises(FingerprintMismatch, match="model fingerprint.*kite upcycle migrate"):
        load_prefix(out, b)


# ------------------------------------------------------------------ damaged files

@pytest.fixture(scope="module")
def good_state(tiny_models, tmp_path_factory):
    from kite.model import load_model

    lm = load_model(str(tiny_models["llama"]), device="cpu")
    out = tmp_path_factory.mktemp("state") / "good.upc"
    compress_document(lm, DOC, out, _exact())
    return out


def _damaged(good_state, tmp_path, how: str):
    data = bytearray(good_state.read_bytes())
    (hlen,) = struct.unpack("<I", bytes(data[12:16]))
    if how == "magic":
        data[:8] = b"NOTAUPC\0"
    elif how == "truncated_header":
        data = data[: 40]
    elif how == "truncated_blob":
        data = data[:-10]
    elif how == "checksum":
        data[32 + hlen + 5] ^= 0xFF
    elif how == "newer":
        data[8:10] = struct.pack("<H", 99)
    elif how == "header":
        data[32 + 3] ^= 0xFF
    bad = tmp_path / f"{how}.upc"
    bad.write_bytes(bytes(data))
    return bad


@pytest.mark.parametrize("how,message", [
    ("magic", "wrong magic"), ("truncated_header", "truncated"), ("newer", "newer than this KITE"),
    ("header", "header checksum"), ("truncated_blob", "truncated .upc state"),
])
def test_damaged_header_is_one_clear_error(good_state, tmp_path, how, message):
    bad = _damaged(good_state, tmp_path, how)
    result = runner.invoke(app, ["upcycle", "inspect", str(bad)])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.parametrize("how,message", [("checksum", "checksum mismatch")])
def test_damaged_blob_found_by_verify(good_state, tmp_path, how, message):
    bad = _damaged(good_state, tmp_path, how)
    result = runner.invoke(app, ["upcycle", "inspect", str(bad), "--verify", "--json"])
    assert result.exit_code == 1
    report = parse_json(result.stdout)
    assert report["checksums"]["failed"] and message in json.dumps(report["checksums"]["errors"])


def test_damaged_blob_refused_on_load(good_state, tiny_models, tmp_path):
    bad = _damaged(good_state, tmp_path, "checksum")
    result = runner.invoke(app, ["generate", "--model", str(tiny_models["llama"]), "--upc", str(bad),
                                 "--prompt", "x"])
    assert result.exit_code == 2 and "checksum mismatch" in result.output


def test_missing_state_file(tiny_models):
    result = runner.invoke(app, ["upcycle", "inspect", "/no/such.upc"])
    assert result.exit_code == 2 and "no such state file" in result.output


# ------------------------------------------------------------------ CLI

def _write_config(tmp_path, **compression):
    cfg = tmp_path / "upcycle.yaml"
    comp = {"cluster_num": 3, "min_span_tokens": 8, "max_span_tokens": 24, **compression}
    cfg.write_text("compression:\n" + "".join(f"  {k}: {v}\n" for k, v in comp.items()) +
                   "semantic_tagging:\n  generated_examples_per_label: 2\n")
    return cfg


def test_compress_inspect_generate_cli(tiny_models, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    out = tmp_path / "doc.upc"
    model = str(tiny_models["llama"])
    result = runner.invoke(app, ["upcycle", "compress", "--model", model, "--input", str(doc), "--output",
                                 str(out), "--config", str(_write_config(tmp_path)), "--precision", "exact",
                                 "--json"])
    assert result.exit_code == 0, result.output
    made = parse_json(result.stdout)
    assert made["n_tokens"] > 50 and made["clusters"] and made["state_bytes"] == out.stat().st_size
    result = runner.invoke(app, ["upcycle", "inspect", str(out), "--verify", "--json"])
    assert result.exit_code == 0, result.output
    info = parse_json(result.stdout)
    assert info["checksums"]["failed"] == [] and info["fingerprints"]["combined"].startswith("kite-fp1:")
    assert {c["label"] for c in info["clusters"]} <= {
        "breach", "jurisdiction", "confidentiality", "intellectual_property", "force_majeure", "payment",
        "termination", "warranty"}
    label = info["clusters"][0]["label"]
    result = runner.invoke(app, ["generate", "--model", model, "--upc", str(out), "--clusters", label,
                                 "--layers", "0-1", "--prompt", " The parties", "--max-new-tokens", "3", "--json"])
    assert result.exit_code == 0, result.output
    gen = parse_json(result.stdout)
    assert gen["state"]["labels"] and set(gen["state"]["labels"]) == {label}
    assert gen["state"]["layers"] == [0, 1]


@pytest.mark.parametrize("content,message", [(b"   \n", "empty"), (b"caf\xe9", "UTF-8")])
def test_compress_bad_document_writes_nothing(tiny_models, tmp_path, content, message):
    doc = tmp_path / "doc.txt"
    doc.write_bytes(content)
    out = tmp_path / "out.upc"
    result = runner.invoke(app, ["upcycle", "compress", "--model", str(tiny_models["llama"]), "--input",
                                 str(doc), "--output", str(out)])
    assert result.exit_code == 2 and message in result.output
    assert not out.exists() and not list(tmp_path.glob(".out.upc.*"))


def test_compress_document_past_context(tiny_models, tmp_path):
    doc = tmp_path / "long.txt"
    doc.write_text(DOC * 20)  # far past the tiny models' 512-token context
    out = tmp_path / "out.upc"
    result = runner.invoke(app, ["upcycle", "compress", "--model", str(tiny_models["llama"]), "--input",
                                 str(doc), "--output", str(out), "--config", str(_write_config(tmp_path))])
    assert result.exit_code == 2 and "past the model's context" in result.output
    assert not out.exists()


def test_config_with_unknown_key(tiny_models, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("compression:\n  cluster_nums: 4\n")
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    result = runner.invoke(app, ["upcycle", "compress", "--model", str(tiny_models["llama"]), "--input",
                                 str(doc), "--output", str(tmp_path / "o.upc"), "--config", str(cfg)])
    assert result.exit_code == 2
    assert "bad.yaml:2" in result.output and "did you mean 'cluster_num'" in result.output


def test_restrictions_need_a_state(tiny_models):
    result = runner.invoke(app, ["generate", "--model", str(tiny_models["llama"]), "--prompt", "x",
                                 "--layers", "0-1"])
    assert result.exit_code == 2 and "--upc" in result.output
