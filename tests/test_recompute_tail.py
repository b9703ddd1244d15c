"""A state's recomputed tail (``compression.recompute_tokens``, ``--recompute-tokens``): the
document's last tokens kept as ids, the tokens before them coded with all of the state's bytes,
every load running the tail through the model after the rebuilt prefix."""

from __future__ import annotations


import pytest
import torch
from typer.testing import CliRunner

from kite.cli.main import app
from kite.errors import BadInput
from kite.runtime.cache import cache_layers
from kite.upcycle import codec
from kite.upcycle.capture import capture
from kite.upcycle.compress import CompressSettings, compress_document, recomputed_tail
from kite.upcycle.format import StateFile
from kite.upcycle.format.header import check_header
from kite.upcycle.load import load_prefix
from tests.conftest import parse_json
from tests.tiny_models import CORPUS

runner = CliRunner()
TAIL = 8


@pytest.fixture(scope="module")
def lm(tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models["llama"]), device="cpu")


def _settings(spec, tail: int) -> CompressSettings:
    return CompressSettings(codec=codec.settings_for(spec), n_clusters=3, min_span_tokens=8, max_span_tokens=32,
                            recompute_tokens=tail)


def _ids(lm, n: int = 160) -> list[int]:
    return lm.tokenizer(CORPUS, add_special_tokens=False)["input_ids"][:n]


def test_the_tail_is_kept_as_ids_and_the_clusters_cover_the_tokens_before_it(lm, tmp_path):
    ids = _ids(lm)
    made = compress_document(lm, "", tmp_path / "s.upc", _settings(4.0, TAIL), ids=ids)
    assert made.recomputed_tokens == TAIL and made.n_tokens == len(ids)
    with StateFile(tmp_path / "s.upc") as sf:
        meta = sf.meta
    assert meta["n_tokens"] == len(ids) and meta["recompute"] == {"tokens": TAIL, "ids": ids[-TAIL:]}
    covered = sorted(r for c in meta["clusters"] for r in c["token_ranges"])
    assert covered[0][0] == 0 and max(e for _, e in covered) == len(ids) - TAIL
    assert sum(c["n_tokens"] for c in meta["clusters"]) == len(ids) - TAIL
    # the ratio is over the whole document's raw KV: the file is the size asked
    assert abs(made.compression_ratio / 4.0 - 1) <= 0.03, made.compression_ratio


def test_the_tails_share_of_the_bytes_goes_to_the_first_coding(lm, tmp_path, monkeypatch):
    """The tail's tokens count in the ratio's base but are not coded: the state-wide allocation is
    handed their share from the first coding, so a state that fits at once is coded once (not a
    second time to spend what the first left), and the file is the size asked."""
    from kite.upcycle import codec as codec_mod

    within = codec_mod.within_budget
    codings = []

    def counted(code, size, budget):
        return within(lambda bonus: codings.append(bonus) or code(bonus), size, budget)

    monkeypatch.setattr(codec_mod, "within_budget", counted)
    ids = lm.tokenizer(CORPUS * 3, add_special_tokens=False)["input_ids"][:400]
    made = compress_document(lm, "", tmp_path / "s.upc", _settings(4.0, 32), ids=ids)
    assert codings == [0] and made.recomputed_tokens == 32
    assert abs(made.compression_ratio / 4.0 - 1) <= 0.01, made.compression_ratio


def test_a_load_recomputes_the_tail_after_the_prefix_as_the_model_would(lm, tmp_path):
    """With the tokens before the tail kept exactly, the loaded prefix is the document's own KV: the
    tail's keys and values are what a prefill of the whole document makes of them."""
    ids = _ids(lm)
    compress_document(lm, "", tmp_path / "s.upc", _settings("fp32", TAIL), ids=ids)
    prefix, report = load_prefix(tmp_path / "s.upc", lm)
    assert report.recomputed_tokens == TAIL and report.tokens == len(ids) and "recompute" in report.timings_ms
    assert prefix.tokens_per_layer() == [len(ids)] * lm.geometry.n_layers and prefix.next_position == len(ids)
    full = capture(lm, "", ids=ids, keep_cache=True).cache
    for layer, (k, v) in enumerate(cache_layers(full)):
        torch.testing.assert_close(prefix.keys[layer][:, -TAIL:], k[0, :, -TAIL:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(prefix.values[layer][:, -TAIL:], v[0, :, -TAIL:], rtol=1e-4, atol=1e-4)


def test_a_load_into_some_layers_recomputes_the_tail_into_those_alone(lm, tmp_path):
    ids = _ids(lm)
    compress_document(lm, "", tmp_path / "s.upc", _settings(4.0, TAIL), ids=ids)
    prefix, report = load_prefix(tmp_path / "s.upc", lm, layers=[0])
    assert prefix.tokens_per_layer()[0] == len(ids) and set(prefix.tokens_per_layer()[1:]) == {0}
    assert report.recomputed_tokens == TAIL


def test_the_tail_over_a_reserving_cache_is_the_tail_over_a_growing_one(lm):
    """The cache reserving the document (the prefix copied once) gives the tail the keys and values a
    cache growing by concatenation gives, in the layers asked for alone."""
    from kite.upcycle.load import recompute_tail

    ids = _ids(lm)
    full = capture(lm, "", ids=ids, keep_cache=True).cache
    head = len(ids) - TAIL
    got = {}
    for reserve in (True, False):
        keys = [k[0, :, :head].clone() for k, _ in cache_layers(full)]
        values = [v[0, :, :head].clone() for _, v in cache_layers(full)]
        recompute_tail(lm, keys, values, ids[head:], len(ids), {0, 1}, reserve=reserve)
        got[reserve] = keys, values
        assert [k.shape[1] for k in keys] == [len(ids)] * 2 + [head] * (len(keys) - 2)
    for a, b in zip(got[True][0] + got[True][1], got[False][0] + got[False][1]):
        assert torch.equal(a, b)


def test_tails_recomputed_together_are_each_recomputed_alone(lm, monkeypatch):
    """Where the device batches forwards, several prefixes' tails go through one forward (the shorter
    prefixes padded before, the shorter tails after): each gets the keys and values its own forward
    gives; a prefix loaded into some layers only goes alone."""
    from kite.runtime import batch
    from kite.upcycle.load import Tail, recompute_tail, recompute_tails

    docs = [(_ids(lm, 160), TAIL), (_ids(lm, 120)[7:], 3), (_ids(lm, 140)[20:], TAIL)]
    caches = [cache_layers(capture(lm, "", ids=ids, keep_cache=True).cache) for ids, _ in docs]

    def tails(layers=None):
        out = []
        for (ids, n), cache in zip(docs, caches):
            head = len(ids) - n
            keep = set(range(len(cache))) if layers is None else layers
            out.append(Tail([k[0, :, :head].clone() if i in keep else k[0, :, :0].clone() for i, (k, _) in enumerate(cache)],
                            [v[0, :, :head].clone() if i in keep else v[0, :, :0].clone() for i, (_, v) in enumerate(cache)],
                            ids[head:], len(ids), keep))
        return out

    alone = tails()
    for t in alone:
        recompute_tail(lm, t.keys, t.values, t.ids, t.n_tokens, t.layers)
    forwards = []
    real = lm.model.forward
    monkeypatch.setattr(lm.model, "forward", lambda *a, **kw: forwards.append(kw["input_ids"].shape) or real(*a, **kw))
    monkeypatch.setitem(batch.BATCH_TOKENS, "cpu", 3 * 160)
    together = tails()
    recompute_tails(lm, together)
    assert forwards == [(3, TAIL)]
    for a, b in zip(alone, together):
        assert [k.shape for k in a.keys] == [k.shape for k in b.keys] and [v.shape for v in a.values] == [v.shape for v in b.values]
        for x, y in zip(a.keys + a.values, b.keys + b.values):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)
            assert y.is_contiguous()
    forwards.clear()
    some = tails({0})
    recompute_tails(lm, some)
    assert forwards == [(1, TAIL), (1, 3), (1, TAIL)]
    assert [k.shape[1] for k in some[1].keys] == [len(docs[1][0])] + [0] * (len(some[1].keys) - 1)


def test_states_loaded_together_are_each_loaded_alone(lm, tmp_path, monkeypatch):
    """load_prefixes: every state whole, their tails in one forward where the device batches them; a
    state without a tail among them loads as it does alone."""
    from kite.runtime import batch
    from kite.upcycle.load import load_prefixes

    paths = []
    for i, (n, tail) in enumerate([(160, TAIL), (130, 5), (150, 0)]):
        paths.append(tmp_path / f"s{i}.upc")
        compress_document(lm, "", paths[-1], _settings(4.0, tail), ids=_ids(lm, n)[i:])
    alone = [load_prefix(path, lm) for path in paths]
    monkeypatch.setitem(batch.BATCH_TOKENS, "cpu", 4 * 160)
    together = load_prefixes(paths, lm)
    for (a, ra), (b, rb) in zip(alone, together):
        assert b.next_position == a.next_position and b.tokens_per_layer() == a.tokens_per_layer()
        assert (rb.recomputed_tokens, rb.tokens, rb.clusters) == (ra.recomputed_tokens, ra.tokens, ra.clusters)
        assert ("recompute" in rb.timings_ms) == bool(ra.recomputed_tokens) and rb.load_ms > 0
        for x, y in zip(a.keys + a.values, b.keys + b.values):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)
    assert load_prefixes([], lm) == []


def test_a_tail_as_long_as_the_document_leaves_one_token_coded_and_a_negative_one_is_refused():
    assert recomputed_tail(100, 64) == 64 and recomputed_tail(10, 64) == 9 and recomputed_tail(10, 0) == 0
    with pytest.raises(BadInput, match="recompute tokens -1"):
        recomputed_tail(10, -1)


def test_auto_keeps_256_tokens_at_16x_and_above_at_most_an_eighth_of_the_document_and_none_below():
    assert recomputed_tail(2048, "auto", 16.0) == 256 and recomputed_tail(2048, "auto", 20.0) == 256
    assert recomputed_tail(1000, "auto", 16.0) == 125            # an eighth of a shorter document
    assert recomputed_tail(2048, "auto", 15.9) == 0 and recomputed_tail(2048, "auto", 4.0) == 0
    assert recomputed_tail(2048, "auto", None) == 0               # a preset, or lossless
    assert recomputed_tail(2048, " AUTO ", 16.0) == 256 and recomputed_tail(2048, "64", 4.0) == 64
    for bad in ("some", 4097, 2.5, True, None):
        with pytest.raises(BadInput, match="'auto' or a count of the document's last tokens, 0 to 4096"):
            recomputed_tail(2048, bad, 16.0)


def test_by_default_a_16x_state_keeps_a_tail_and_a_4x_state_keeps_its_address(lm, tmp_path):
    """``auto`` is the default: a 16x state keeps its last tokens (an eighth of this short document),
    a 4x one none, under the address an explicit 0 gives (states made before ``auto`` keep theirs)."""
    from kite.upcycle.address import address_for

    ids = _ids(lm)
    made = compress_document(lm, "", tmp_path / "s16.upc", _settings(16.0, "auto"), ids=ids)
    assert made.recomputed_tokens == len(ids) // 8 and CompressSettings().recompute_tokens == "auto"
    made = compress_document(lm, "", tmp_path / "s4.upc", _settings(4.0, "auto"), ids=ids)
    assert made.recomputed_tokens == 0
    for ratio, same_as in ((4.0, 0), (16.0, len(ids) // 8)):
        auto = address_for("kite-fp1:aa", ids, _settings(ratio, "auto"), None, None).id
        assert auto == address_for("kite-fp1:aa", ids, _settings(ratio, same_as), None, None).id


@pytest.mark.parametrize("text, ok", [("auto", "auto"), ("12", 12), ("0", 0), ("lots", None), ("-1", None),
                                      ("5000", None)])
def test_the_config_takes_auto_or_a_count(tmp_path, text, ok):
    from kite.upcycle.settings import load_upcycle_config

    cfg = tmp_path / "upcycle.yaml"
    cfg.write_text(f"compression:\n  recompute_tokens: {text}\n")
    if ok is None:
        with pytest.raises(BadInput, match="recompute_tokens.*'auto' or a count"):
            load_upcycle_config(cfg)
    else:
        assert load_upcycle_config(cfg)[0].compression.recompute_tokens == ok


@pytest.mark.parametrize("tail, said", [
    ({"tokens": 2, "ids": [1]}, "recompute.ids is not a list of 2 token ids"),
    ({"tokens": 1, "ids": ["a"]}, "recompute.ids is not a list of 1 token ids"),
    ({"tokens": 0, "ids": []}, "recompute.tokens"),
    ("x", "recompute"),
])
def test_a_damaged_tail_is_named_in_one_line(lm, tmp_path, tail, said):
    ids = _ids(lm)
    compress_document(lm, "", tmp_path / "s.upc", _settings(4.0, TAIL), ids=ids)
    with StateFile(tmp_path / "s.upc") as sf:
        meta = dict(sf.meta)
    meta["recompute"] = tail
    with pytest.raises(BadInput, match="corrupt .upc header") as err:
        check_header(meta, "s.upc")
    assert said in str(err.value) and "\n" not in str(err.value)
    meta["recompute"] = {"tokens": len(ids), "ids": ids}       # no token left coded
    with pytest.raises(BadInput, match="not fewer than the state's"):
        check_header(meta, "s.upc")


def test_the_cli_keeps_a_tail_says_so_and_gives_it_another_address(tiny_models, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS)
    model = str(tiny_models["llama"])
    made = {}
    for tail in (0, TAIL):
        out = tmp_path / f"s{tail}.upc"
        res = runner.invoke(app, ["upcycle", "compress", "--model", model, "--input", str(doc), "--output", str(out),
                                  "--ratio", "4", "--recompute-tokens", str(tail), "--json"])
        assert res.exit_code == 0, res.output
        made[tail] = parse_json(res.output)
        shown = runner.invoke(app, ["upcycle", "inspect", str(out), "--json"])
        assert parse_json(shown.output)["recomputed_tokens"] == tail
    assert made[TAIL]["recomputed_tokens"] == TAIL and made[0]["recomputed_tokens"] == 0
    assert made[TAIL]["address"] != made[0]["address"]
    said = runner.invoke(app, ["upcycle", "inspect", str(tmp_path / f"s{TAIL}.upc")])
    assert f"the last {TAIL} tokens kept as ids" in said.output


def test_eval_measures_a_state_with_its_tail(tiny_models, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS)
    args = ["upcycle", "eval", "--model", str(tiny_models["llama"]), "--input", str(doc), "--context-tokens", "120",
            "--continuation-tokens", "40", "--ratio", "4", "--recompute-tokens", str(TAIL)]
    res = runner.invoke(app, args + ["--json"])
    assert res.exit_code == 0, res.output
    got = parse_json(res.output)
    assert got["recomputed_tokens"] == TAIL and got["context_tokens"] == 120
    said = runner.invoke(app, args)
    assert f"its last {TAIL} tokens recomputed by the load" in said.output


@pytest.mark.parametrize("command", ["compress", "eval"])
def test_a_bad_tail_is_refused_in_one_line_before_the_model_loads(tiny_models, tmp_path, command, monkeypatch):
    import kite.model

    monkeypatch.setattr(kite.model, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS)
    for bad in ("-3", "some"):
        args = ["upcycle", command, "--model", str(tiny_models["llama"]), "--input", str(doc), "--recompute-tokens", bad]
        res = runner.invoke(app, args + (["--output", str(tmp_path / "s.upc")] if command == "compress" else []))
        assert res.exit_code == 2 and f"--recompute-tokens {bad}: 'auto' or a count" in res.output, res.output


def test_the_config_sets_the_tail(tiny_models, tmp_path):
    cfg = tmp_path / "upcycle.yaml"
    cfg.write_text("compression:\n  recompute_tokens: 5\n")
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS)
    res = runner.invoke(app, ["upcycle", "compress", "--model", str(tiny_models["llama"]), "--input", str(doc),
                              "--output", str(tmp_path / "s.upc"), "--config", str(cfg), "--json"])
    assert res.exit_code == 0, res.output
    assert parse_json(res.output)["recomputed_tokens"] == 5


def test_the_vllm_connector_offers_the_coded_tokens_and_leaves_the_tail_to_the_engine(lm, tmp_path):
    """A KV connector rebuilds layer by layer without the model: it offers the prefix the clusters
    cover (kite.integrations.vllm's IndexedState.covered), and the engine computes the tail as part
    of the prompt."""
    from kite.serve.vllm_blocks import covered_prefix

    ids = _ids(lm)
    compress_document(lm, "", tmp_path / "s.upc", _settings(4.0, TAIL), ids=ids, address=True)
    with StateFile(tmp_path / "s.upc") as sf:
        meta = sf.meta
    ranges = [r for c in meta["clusters"] for r in c["token_ranges"]]
    assert covered_prefix(ranges, meta["n_tokens"]) == len(ids) - TAIL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_a_load_recomputes_the_tail_on_the_device(tiny_models, tmp_path):
    """The model on a GPU in bf16: an exact prefix's tail is the whole document's prefill to bf16's
    rounding, and a PCA-coded state (rebuilt on the device) gets its tail in every layer."""
    from kite.model import load_model

    gpu = load_model(str(tiny_models["llama"]), device="cuda")
    ids = _ids(gpu)
    compress_document(gpu, "", tmp_path / "exact.upc", _settings("fp32", TAIL), ids=ids)
    prefix, report = load_prefix(tmp_path / "exact.upc", gpu)
    full = capture(gpu, "", ids=ids, keep_cache=True).cache
    for layer, (k, v) in enumerate(cache_layers(full)):
        assert prefix.keys[layer].device.type == "cuda"
        torch.testing.assert_close(prefix.keys[layer][:, -TAIL:].float(), k[0, :, -TAIL:].float(), rtol=0.05, atol=0.05)
        torch.testing.assert_close(prefix.values[layer][:, -TAIL:].float(), v[0, :, -TAIL:].float(), rtol=0.05,
                                   atol=0.05)
    compress_document(gpu, "", tmp_path / "coded.upc", _settings(4.0, TAIL), ids=ids)
    prefix, report = load_prefix(tmp_path / "coded.upc", gpu)
    assert report.recomputed_tokens == TAIL and prefix.tokens_per_layer() == [len(ids)] * gpu.geometry.n_layers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_states_loaded_together_are_each_loaded_alone(tiny_models, tmp_path):
    """On a GPU (bf16, the device's own batch budget) several states' tails go through one forward,
    through the padded mask's attention: each state's keys and values are its own load's, to bf16's
    rounding."""
    from kite.model import load_model
    from kite.upcycle.load import load_prefixes

    gpu = load_model(str(tiny_models["llama"]), device="cuda")
    paths = []
    for i, n in enumerate((160, 130, 150)):
        paths.append(tmp_path / f"s{i}.upc")
        compress_document(gpu, "", paths[-1], _settings(4.0, TAIL), ids=_ids(gpu, n)[i:])
    alone = [load_prefix(path, gpu)[0] for path in paths]
    together = load_prefixes(paths, gpu)
    for a, (b, report) in zip(alone, together):
        assert report.recomputed_tokens == TAIL and b.tokens_per_layer() == a.tokens_per_layer()
        for x, y in zip(a.keys + a.values, b.keys + b.values):
            assert y.device.type == "cuda" and y.dtype == x.dtype
            torch.testing.assert_close(y.float(), x.float(), rtol=0.05, atol=0.05)


def test_training_codes_its_states_with_the_config_s_tail(tiny_models, tmp_path):
    """`kite upcycle train` codes its states as the config codes states outside training, so what the
    adapter and the report read is what a load of such a state gives."""
    from tests.test_train import _pairs_file

    cfg = tmp_path / "upcycle.yaml"
    cfg.write_text("compression:\n  recompute_tokens: 6\n")
    res = runner.invoke(app, ["upcycle", "train", "--model", str(tiny_models["llama"]), "--data-path",
                              str(_pairs_file(tmp_path, docs=3)), "--output-dir", str(tmp_path / "run"),
                              "--eval-fraction", "0.34", "--regenerator-only", "--layer-group", "1",
                              "--config", str(cfg), "--ratio", "4", "--json"])
    assert res.exit_code == 0, res.output
    states = sorted((tmp_path / "run" / "states").rglob("*.upc"))
    assert states
    for path in states:
        with StateFile(path) as sf:
            assert sf.meta["recompute"]["tokens"] == 6


def test_kite_serve_answers_from_a_state_with_a_tail_over_http(lm, tmp_path):
    """A server whose config keeps a tail: the uploaded document's state keeps it, and a completion
    over real HTTP loads it with the tail recomputed (the load's report in the response says so)."""
    import httpx

    from kite.serve import BackgroundServer, create_app
    from kite.upcycle import Pipeline, UpcycleConfig, compress_settings
    from tests.test_serve import DOC, _ask, _settings

    cfg = UpcycleConfig.model_validate({"compression": {"svd_ratio": 0.25, "cluster_num": 3, "min_span_tokens": 8,
                                                        "max_span_tokens": 24, "recompute_tokens": TAIL}})
    pipe = Pipeline(lm=lm, tagger=None, settings=compress_settings(cfg), config=cfg, config_path=None)
    server = BackgroundServer(create_app(pipe, _settings(tmp_path, fusion=True)))
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            up = c.post("/v1/states", json={"document": DOC})
            assert up.status_code == 201, up.text
            sid = up.json()["id"]
            with StateFile(next((tmp_path / "states").rglob("*.upc"))) as sf:
                assert sf.meta["recompute"]["tokens"] == TAIL
            r = _ask(c, sid)
            assert r.status_code == 200, r.text
            load = r.json()["kite"]["load"]
            assert load["recomputed_tokens"] == TAIL and load["tokens"] == up.json()["tokens"]
    finally:
        server.stop()


def test_a_regenerator_choosing_by_the_attention_probe_codes_the_tokens_before_the_tail(lm, tmp_path):
    """The probe reads the document's last queries at their own positions over the keys the codec
    codes (those before the tail), so a state with a tail is coded and loads as any other."""
    from kite.upcycle.train.data import Pair
    from kite.upcycle.train.run import fit_regenerator

    words = CORPUS.split()
    pairs = [Pair(context=" ".join(words[i * 9:i * 9 + 150]), prompt="Q", response=" A", line=i + 1) for i in range(3)]
    reg = fit_regenerator(lm, pairs, codec.settings_for(8.0), weighted=True)
    reg.choice = "probe"
    made = compress_document(lm, CORPUS, tmp_path / "p.upc", _settings(8.0, TAIL), regenerator=reg)
    assert made.recomputed_tokens == TAIL
    prefix, report = load_prefix(tmp_path / "p.upc", lm, regenerator=reg)
    assert report.recomputed_tokens == TAIL and prefix.tokens_per_layer()[0] == made.n_tokens
