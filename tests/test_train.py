"""`kite upcycle train`'s parts: training pairs (read, checked, split by document) and the regenerator
(fitted in a stream, saved and read back, fingerprinted, refused for another model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kite.data.pairs import contract_pairs
from kite.errors import BadInput, FingerprintMismatch
from kite.upcycle.codec import Regenerator, RegeneratorFit
from kite.upcycle.train import read_pairs, split_pairs
from kite.upcycle.train.report import adapter_helps

from tests.waiting import wait_until


def _write(tmp_path, lines) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    return str(path)


def test_pairs_with_a_context_or_with_the_document_before_the_question(tmp_path):
    path = _write(tmp_path, [{"context": "Doc A.", "prompt": "Q?", "response": "A."},
                             {"prompt": "Doc B line 1.\n\nDoc B line 2.\n\nWho pays?", "response": "Bob."}])
    a, b = read_pairs(path)
    assert (a.context, a.prompt, a.response) == ("Doc A.", "Q?", "A.")
    assert b.context == "Doc B line 1.\n\nDoc B line 2." and b.prompt == "\n\nWho pays?"


@pytest.mark.parametrize("line,message", [
    ({"context": "D", "response": "A"}, ":1: expected a non-empty string \"prompt\""),
    ({"context": "D", "prompt": "Q", "response": " "}, ":1: expected a non-empty string \"response\""),
    ({"context": "D", "prompt": "Q", "response": "A", "answer": "x"}, ":1: unknown field 'answer'"),
    ({"prompt": "no blank line here", "response": "A"}, ":1: no \"context\""),
    ('{"prompt": "x", ', ":1:"),
])
def test_a_malformed_pair_is_one_line_with_file_and_line(tmp_path, line, message):
    with pytest.raises(BadInput, match=message.replace("?", r"\?")):
        read_pairs(_write(tmp_path, [line]))


def test_the_held_out_split_is_by_whole_documents_and_seeded(tmp_path):
    pairs = read_pairs(_write(tmp_path, [{"context": f"Doc {i // 3}", "prompt": f"Q{i}", "response": "A"}
                                         for i in range(30)]))
    train, held = split_pairs(pairs, 0.2, seed=1)
    assert {p.document_key for p in train}.isdisjoint({p.document_key for p in held})
    assert len({p.document_key for p in held}) == 2 and len(train) + len(held) == 30
    assert split_pairs(pairs, 0.2, seed=1) == (train, held)
    assert split_pairs(pairs, 0.0, seed=1) == (pairs, [])


def test_too_few_documents_for_a_held_out_split(tmp_path):
    pairs = read_pairs(_write(tmp_path, [{"context": "One doc", "prompt": f"Q{i}", "response": "A"} for i in range(5)]))
    with pytest.raises(BadInput, match="at least 2 documents"):
        split_pairs(pairs, 0.1, seed=0)


def test_contract_pairs_are_distinct_questions_whose_fact_the_document_holds():
    pairs = contract_pairs(2, tokens=1500, seed=3)
    assert len(pairs) >= 20
    assert len({(p["context"], p["prompt"], p["response"]) for p in pairs}) == len(pairs)
    single = [p for p in pairs if p["meta"]["family"] in ("qa", "needle")]
    assert single and all(p["response"].strip() in p["context"] for p in single)
    assert contract_pairs(2, tokens=1500, seed=3) == pairs


def _kv(seed, L=2, H=2, T=300, d=8):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(H * d, H * d, generator=torch.Generator().manual_seed(99))
    out = []
    for _ in range(L):
        x = torch.randn(T, H * d, generator=g) @ mix + 1.5
        out.append(x.view(T, H, d).permute(1, 0, 2).contiguous())
    return out


def test_a_regenerator_fitted_in_a_stream_is_the_pca_of_all_its_tokens():
    fit = RegeneratorFit(n_layers=2)
    keys, values = [_kv(1), _kv(2)], [_kv(3), _kv(4)]
    for k, v in zip(keys, values):
        fit.add(k, v)
    reg = fit.finish({"model_fingerprint": "kite-fp1:m"})
    mean, evals, U = reg.side(1, "v")
    X = torch.cat([v[1].permute(1, 0, 2).reshape(-1, 16) for v in values]).double()
    cov = torch.cov(X.T, correction=0)
    assert torch.allclose(mean[0].double(), X.mean(0), atol=1e-5)
    assert torch.allclose(evals[0].double(), torch.linalg.eigvalsh(cov).flip(0).clamp_min(0), rtol=1e-4, atol=1e-5)
    assert torch.allclose(U[0].T @ U[0], torch.eye(16), atol=1e-5)
    assert reg.meta["calibration"]["tokens"] == 600 and reg.meta["calibration"]["documents"] == 2


def test_a_regenerator_reads_back_with_its_fingerprint_and_refuses_edits(tmp_path):
    fit = RegeneratorFit(n_layers=2)
    fit.add(_kv(1), _kv(2))
    reg = fit.finish({"model_fingerprint": "kite-fp1:m"})
    reg.save(tmp_path / "r")
    back = Regenerator.load(tmp_path / "r")
    assert back.fingerprint == reg.fingerprint
    assert all(torch.equal(back.tensors[k], reg.tensors[k]) for k in reg.tensors)
    meta = json.loads((tmp_path / "r" / "regenerator.json").read_text())
    meta["joint_heads"] = False
    (tmp_path / "r" / "regenerator.json").write_text(json.dumps(meta))
    with pytest.raises(BadInput, match="do not match its recorded fingerprint"):
        Regenerator.load(tmp_path / "r")
    with pytest.raises(BadInput, match="not a regenerator"):
        Regenerator.load(tmp_path)


def test_a_regenerator_is_refused_for_another_model():
    fit = RegeneratorFit(n_layers=2)
    fit.add(_kv(1), _kv(2))
    reg = fit.finish({"model_fingerprint": "kite-fp1:aaaa"})

    class LM:
        class fingerprints:
            base = "kite-fp1:bbbb"

    with pytest.raises(FingerprintMismatch, match="made for model aaaa"):
        reg.check_model(LM)


# --- states coded on a regenerator, end to end (tiny Llama) --------------------------------------

@pytest.fixture(scope="module")
def tiny_lm(tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models["llama"]), device="cpu")


@pytest.fixture(scope="module")
def tiny_regenerator(tiny_lm):
    from kite.upcycle.capture import capture
    from tests.tiny_models import CORPUS

    fit = RegeneratorFit(n_layers=tiny_lm.geometry.n_layers)
    for i in range(3):
        cap = capture(tiny_lm, CORPUS[i * 97:] + CORPUS[:i * 97])
        fit.add(cap.keys_pre, cap.values, cap.ids)
    return fit.finish({"model_fingerprint": tiny_lm.fingerprints.combined})


def test_the_reports_answers_are_generates_batched_and_in_order(tiny_lm, monkeypatch):
    """The held-out report's greedy answers, 3 rows at a time over 7 examples after states of their
    own lengths: each is generate()'s text after its state, in the examples' order."""
    from kite.runtime.cache import KVPrefix, cache_layers, new_cache
    from kite.runtime.generate import forward_tokens, generate
    from kite.upcycle.train.adapter import Example
    from kite.upcycle.train.report import greedy_answers

    g = torch.Generator().manual_seed(0)
    states = []
    for n in (40, 25, 60):
        doc = torch.randint(5, tiny_lm.model.config.vocab_size, (n,), generator=g).tolist()
        cache = new_cache(tiny_lm.model)
        forward_tokens(tiny_lm.model, doc, cache, 0)
        layers = cache_layers(cache)
        states.append(KVPrefix([k[0] for k, _ in layers], [v[0] for _, v in layers], n))
    examples = [Example(doc=str(i % 3), prompt_ids=torch.randint(5, 300, (3 + i,), generator=g).tolist(),
                        response_ids=list(range(5 + i)), teacher_idx=None, teacher_logp=None) for i in range(7)]
    prefixes = [states[i % 3] for i in range(7)]
    want = [generate(tiny_lm, ex.prompt_ids, max_new_tokens=len(ex.response_ids) + 8, prefix=p).text
            for ex, p in zip(examples, prefixes)]
    assert greedy_answers(tiny_lm, prefixes, examples, rows=3) == want
    # a row the batch refuses (as past a sliding window) is decoded alone, in its place
    from kite.errors import BadInput
    from kite.runtime.batch_decode import BatchDecoder

    add = BatchDecoder.add

    def refuse_the_fifth(self, prompt_ids, **kw):
        if prompt_ids == examples[4].prompt_ids:
            raise BadInput("batched decoding does not apply the model's sliding window")
        return add(self, prompt_ids, **kw)

    monkeypatch.setattr(BatchDecoder, "add", refuse_the_fifth)
    assert greedy_answers(tiny_lm, prefixes, examples, rows=3) == want


def _compress_regenerated(lm, reg, out, ratio=8):
    from kite.upcycle import CompressSettings, codec_settings, compress_document
    from tests.tiny_models import CORPUS

    return compress_document(lm, CORPUS.replace(". ", ".\n\n", 5), out,
                             CompressSettings(codec=codec_settings(ratio), n_clusters=3, min_span_tokens=8,
                                              max_span_tokens=24), regenerator=reg)


def test_a_regenerated_state_records_its_regenerator_and_loads_only_with_it(tiny_lm, tiny_regenerator, tmp_path,
                                                                             monkeypatch):
    from kite.upcycle import StateFile, load_prefix
    from kite.upcycle.codec import regenerator as R

    made = _compress_regenerated(tiny_lm, tiny_regenerator, tmp_path / "s.upc")
    with StateFile(made.path) as sf:
        rec = sf.meta["regenerator"]
    assert rec["fingerprint"] == tiny_regenerator.fingerprint and rec["sides"] > 0
    monkeypatch.setattr(R, "_LOADED", {})
    with pytest.raises(FingerprintMismatch, match=f"regenerator {tiny_regenerator.fingerprint[9:21]}"):
        load_prefix(made.path, tiny_lm)                             # neither given nor kept under KITE_HOME
    given, _ = load_prefix(made.path, tiny_lm, regenerator=tiny_regenerator)
    R.install(tiny_regenerator)                                     # kept by fingerprint: found without being given
    kept, _ = load_prefix(made.path, tiny_lm)
    assert all(torch.equal(a, b) for a, b in zip(given.keys + given.values, kept.keys + kept.values))


def test_the_staged_load_of_a_regenerated_state_matches_the_host_decode(tiny_lm, tiny_regenerator, tmp_path):
    from kite.upcycle import load, load_prefix, rope_cos_sin
    from kite.upcycle.format import StateFile

    made = _compress_regenerated(tiny_lm, tiny_regenerator, tmp_path / "s.upc", ratio=4)
    ref, _ = load_prefix(made.path, tiny_lm, regenerator=tiny_regenerator)
    geo = tiny_lm.geometry
    with StateFile(made.path) as state:
        sel = load.select(state, None)
        hot = load.stage_state(state, sel.parts, sel.part_positions, list(range(geo.n_layers)), n_layers=geo.n_layers,
                               H=geo.n_kv_heads, d=geo.head_dim, threads=1, regenerator=tiny_regenerator)
    cos, sin = rope_cos_sin(tiny_lm.model, hot.positions)
    keys, values = load.load_staged(hot, device="cpu", dtype=torch.float32, cos=cos, sin=sin, n_layers=geo.n_layers)
    for layer in range(geo.n_layers):
        for got, want in ((keys[layer], ref.keys[layer]), (values[layer], ref.values[layer])):
            assert torch.allclose(got, want, atol=1e-4 * float(want.abs().max()), rtol=1e-4)


def test_the_pipeline_takes_the_configs_regenerator(tiny_lm, tiny_regenerator, tmp_path):
    from kite.upcycle import StateFile, UpcycleConfig, open_pipeline

    tiny_regenerator.save(tmp_path / "reg")
    cfg = tmp_path / "upcycle.yaml"
    cfg.write_text("regenerator: reg\ncompression: {svd_ratio: 0.125, cluster_num: 2}\n"
                   "semantic_tagging: {generated_examples_per_label: 0}\n")
    pipe = open_pipeline(lm=tiny_lm, upcycle_config=cfg, tagger=False)
    assert pipe.regenerator.fingerprint == tiny_regenerator.fingerprint
    made = pipe.compress("The parties agree. " * 40, tmp_path / "p.upc")
    with StateFile(made.path) as sf:
        assert sf.meta["regenerator"]["fingerprint"] == tiny_regenerator.fingerprint
    other = RegeneratorFit(n_layers=tiny_lm.geometry.n_layers)
    other.add(*[[torch.randn(2, 40, 16)] * tiny_lm.geometry.n_layers] * 2)
    other.finish({"model_fingerprint": "kite-fp1:another"}).save(tmp_path / "other")
    with pytest.raises(FingerprintMismatch, match="made for model another"):
        open_pipeline(lm=tiny_lm, upcycle_config=UpcycleConfig(), regenerator=tmp_path / "other", tagger=False)


# --- kite upcycle train, end to end on the tiny Llama ---------------------------------------------

def _pairs_file(folder, docs=5, per_doc=4):
    from tests.tiny_models import CORPUS

    words = CORPUS.split()
    lines = [{"context": " ".join(words[d * 7:d * 7 + 120]) + f" The code of document {d} is {d * 11}.",
              "prompt": f"\nCode number {q} of this document is", "response": f" {d * 11 + q}."}
             for d in range(docs) for q in range(per_doc)]
    path = folder / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def _train(tiny_models, tmp_path, out, *extra, json_out=True):
    from typer.testing import CliRunner

    from kite.cli.main import app

    return CliRunner().invoke(app, ["upcycle", "train", "--model", str(tiny_models["llama"]), "--data-path",
                                    str(_pairs_file(tmp_path)), "--output-dir", str(out), "--eval-fraction", "0.2",
                                    *(["--json"] if json_out else []), *extra])


def test_train_writes_a_regenerator_a_peft_adapter_and_a_report(tiny_models, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.conftest import parse_json

    out = tmp_path / "run"
    res = _train(tiny_models, tmp_path, out, "--epochs", "1")
    assert res.exit_code == 0, res.output
    rep = parse_json(res.output)
    assert rep["train_documents"] == 4 and rep["held_out_documents"] == 1
    assert Regenerator.load(out / "regenerator").fingerprint == rep["regenerator"]["fingerprint"]
    assert rep["adapter"]["settings"]["chosen_by"].startswith("auto:")
    assert rep["training"]["8"]["steps"] == 16 and len(rep["loss"]["8"]) == 16
    assert rep["adapter"]["folders"] == {"8": str(out / "adapter")}
    held = rep["held_out"]["8"]
    assert held["pairs"] == 4 and held["ppl_full"] > 0 and held["f1_state"] is not None
    assert held["adapter_helps"] == adapter_helps(held) and isinstance(held["adapter_helps"], bool)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "train_report.json").read_text())["regenerator"] == rep["regenerator"]
    # what each stage cost, counted in what it did: 5 documents (the 4 calibrated on prefilled once, for
    # everything), the two layer groupings of the tiny model's 3 layers measured, one state each, 20 pairs'
    # teacher, 16 steps, one checkpoint (every 25, and the last), 4 held-out pairs reported
    st = rep["stages"]
    assert list(st) == ["calibrate_capture", "calibrate_fit", "calibrate_choose", "capture", "compress", "load",
                        "teacher", "adapter_steps", "checkpoints", "report", "write"]
    assert {k: v["count"] for k, v in st.items() if k != "write"} == {
        "calibrate_capture": 4, "calibrate_fit": 4, "calibrate_choose": 2, "capture": 1, "compress": 5, "load": 5,
        "teacher": 20, "adapter_steps": 16, "checkpoints": 1, "report": 4}
    assert [r["layer_group"] for r in rep["regenerator"]["layer_group_choice"]["candidates"]] == [1, 3]
    assert st["compress"]["unit"] == "state" and st["teacher"]["unit"] == "pair"
    assert all(v["per_unit_s"] == pytest.approx(v["seconds"] / v["count"], abs=1e-3) for v in st.values() if v["count"])
    sp = rep["speed"]
    assert sp["states"] == 5 and sp["pair_epochs"] == 16
    assert sp["seconds_per_state"] == pytest.approx(sum(st[k]["seconds"] for k in list(st)[:6]) / 5, rel=1e-2, abs=1e-3)
    assert rep["prefix_loads"] == {"8": 5}             # each state decoded once, for every step that reads it
    base = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    PeftModel.from_pretrained(base, out / "adapter")            # the standard peft format


def test_a_run_of_several_ratios_trains_one_adapter_per_ratio_as_a_run_of_that_ratio_alone(tiny_models, tmp_path):
    from safetensors.torch import load_file

    from tests.conftest import parse_json

    both, alone = tmp_path / "both", tmp_path / "alone"
    res = _train(tiny_models, tmp_path, both, "--epochs", "1", "--ratio", "4", "--ratio", "8")
    assert res.exit_code == 0, res.output
    rep = parse_json(res.output)
    assert rep["adapter"]["folders"] == {"4": str(both / "adapter-r4"), "8": str(both / "adapter-r8")}
    assert set(rep["held_out"]) == {"4", "8"} and set(rep["training"]) == {"4", "8"}
    assert (both / "r4" / "checkpoints" / "latest.json").exists() and (both / "r8" / "checkpoints").is_dir()
    assert not (both / "adapter").exists()
    res = _train(tiny_models, tmp_path, alone, "--epochs", "1", "--ratio", "8", json_out=False)
    assert res.exit_code == 0, res.output
    assert f"at 8x: {alone / 'adapter'}" in " ".join(res.output.split()) and "held out at 8x" in res.output
    assert "s per state" in res.output and "per training pair and epoch" in res.output
    assert "adapter_steps" in res.output and "s per step" in res.output
    r4, r8 = (load_file(both / f"adapter-r{r}" / "adapter_model.safetensors") for r in (4, 8))
    a8 = load_file(alone / "adapter" / "adapter_model.safetensors")
    assert r8.keys() == a8.keys() and all(torch.allclose(r8[k], a8[k], atol=1e-6) for k in a8)
    assert not all(torch.allclose(r4[k], r8[k]) for k in r8)       # each learned its own ratio's states
    assert json.loads((alone / "train_report.json").read_text())["held_out"]["8"] == rep["held_out"]["8"]


def test_a_run_that_captures_documents_together_trains_as_one_that_captures_each_alone(tiny_models, tiny_lm,
                                                                                      tmp_path, monkeypatch,
                                                                                      capture_batches):
    """On a GPU the run prefills several documents a forward, and runs several states' recomputed
    tails a forward when it loads them (kite.runtime.batch.BATCH_TOKENS); given a budget on the CPU
    here, the run counts the same stages and makes the same states and adapter."""
    from safetensors.torch import load_file

    from kite.runtime import batch
    from kite.upcycle.format import StateFile
    from kite.upcycle.load.prefix import load_prefix
    from tests.conftest import parse_json

    batches = capture_batches
    alone, together = tmp_path / "alone", tmp_path / "together"
    cfg = tmp_path / "upcycle.yaml"
    cfg.write_text("compression:\n  recompute_tokens: 6\n")        # each load runs a tail through the model
    flags = ("--epochs", "1", "--layer-group", "1", "--config", str(cfg))
    res = _train(tiny_models, tmp_path, alone, *flags)
    assert res.exit_code == 0, res.output
    assert set(batches) == {1}
    batches.clear()
    monkeypatch.setitem(batch.BATCH_TOKENS, "cpu", 4096)
    res = _train(tiny_models, tmp_path, together, *flags)
    assert res.exit_code == 0, res.output
    assert batches == [4, 1]          # the 4 training documents calibrated together, the held-out one alone
    a, b = parse_json(res.output), json.loads((alone / "train_report.json").read_text())
    assert {k: v["count"] for k, v in a["stages"].items()} == {k: v["count"] for k, v in b["stages"].items()}
    regs = [Regenerator.load(run / "regenerator") for run in (alone, together)]
    assert all(torch.allclose(regs[0].tensors[k], regs[1].tensors[k], atol=1e-5) for k in regs[0].tensors)
    for state in sorted((alone / "states").iterdir()):
        with StateFile(state) as sf:
            assert sf.meta["recompute"]["tokens"] == 6
        p, q = (load_prefix(run / "states" / state.name, tiny_lm, regenerator=reg)[0]
                for run, reg in zip((alone, together), regs))
        assert all(torch.allclose(u, v, atol=1e-4) for u, v in zip(p.keys + p.values, q.keys + q.values)), state.name
    x, y = (load_file(run / "adapter" / "adapter_model.safetensors") for run in (together, alone))
    # the same to the rounding of the products: a forward of one document and one of four may take
    # different products (kite.model.cpu_products), and training carries their last bits along
    assert x.keys() == y.keys() and all(torch.allclose(x[k], y[k], atol=1e-4) for k in y)


@pytest.mark.parametrize("gap, f1_off, f1_on, helps", [
    (0.5, 0.20, 0.21, True),       # recovers half the gap, answers no worse
    (0.5, 0.19, 0.16, False),      # lower PPL, worse answers
    (-0.55, 0.2, 0.2, False),      # reads the states worse (an 8x adapter on GPL-3)
    (0.0, 0.2, 0.2, False),
    (None, 0.2, 0.2, None),        # no gap to recover: nothing measured
])
def test_the_report_says_whether_the_adapter_helps_at_a_ratio(gap, f1_off, f1_on, helps):
    assert adapter_helps({"gap_recovered": gap, "f1_state": f1_off, "f1_state_adapter": f1_on}) is helps


def test_a_folder_holding_a_run_is_refused_unless_resumed_or_overwritten(tiny_models, tmp_path):
    out = tmp_path / "run"
    assert _train(tiny_models, tmp_path, out, "--regenerator-only").exit_code == 0
    again = _train(tiny_models, tmp_path, out, "--regenerator-only")
    assert again.exit_code == 2 and "holds this run already" in again.output
    other = _train(tiny_models, tmp_path, out, "--regenerator-only", "--seed", "5")
    assert other.exit_code == 2 and "holds another run (its seed differs)" in other.output
    assert _train(tiny_models, tmp_path, out, "--regenerator-only", "--seed", "5", "--overwrite").exit_code == 0


def test_train_reads_a_given_regenerator_instead_of_fitting_one(tiny_models, tiny_regenerator, tmp_path):
    """--regenerator DIR: the training states are coded on it (the pairing the adapter will read),
    none is fitted, and a regenerator of another model is refused with its fingerprint named."""
    from typer.testing import CliRunner

    from kite.cli.main import app
    from kite.model.fingerprint import short
    from kite.upcycle import StateFile
    from tests.conftest import parse_json

    given = tiny_regenerator.save(tmp_path / "given")
    out = tmp_path / "run"
    res = _train(tiny_models, tmp_path, out, "--epochs", "1", "--regenerator", str(given))
    assert res.exit_code == 0, res.output
    rep = parse_json(res.output)
    assert rep["regenerator"]["fingerprint"] == tiny_regenerator.fingerprint
    assert Regenerator.load(out / "regenerator").fingerprint == tiny_regenerator.fingerprint
    states = sorted((out / "states").glob("*.upc"))
    assert len(states) == 5
    for path in states:
        with StateFile(path) as sf:
            assert sf.meta["regenerator"]["fingerprint"] == tiny_regenerator.fingerprint
    assert rep["training"]["8"]["steps"] == 16 and rep["held_out"]["8"]["ppl_state_adapter"] > 0
    # the same folder without it is another run
    moved = _train(tiny_models, tmp_path, out, "--regenerator-only")
    assert moved.exit_code == 2 and "holds another run" in moved.output
    res = CliRunner().invoke(app, ["upcycle", "train", "--model", str(tiny_models["qwen2"]), "--data-path",
                                   str(tmp_path / "pairs.jsonl"), "--output-dir", str(tmp_path / "q"),
                                   "--regenerator", str(given)])
    assert res.exit_code == 2 and short(tiny_regenerator.fingerprint) in res.output, res.output
    both = _train(tiny_models, tmp_path, tmp_path / "b", "--regenerator", str(given), "--regenerator-only")
    assert both.exit_code == 2 and "--regenerator-only --regenerator" in both.output


def test_custom_mode_trains_the_configs_shape_at_its_learning_rate(tiny_models, tmp_path):
    from tests.conftest import parse_json

    cfg = tmp_path / "u.yaml"
    cfg.write_text("adapter: {target_modules: [q_proj, v_proj], r: 4, lora_alpha: 8, learning_rate: 0.0001}\n")
    res = _train(tiny_models, tmp_path, tmp_path / "run", "--mode", "custom", "--config", str(cfg), "--epochs", "1")
    assert res.exit_code == 0, res.output
    s = parse_json(res.output)["adapter"]["settings"]
    assert (s["target_modules"], s["r"], s["lora_alpha"], s["learning_rate"]) == (["q_proj", "v_proj"], 4, 8, 1e-4)
    bad = tmp_path / "bad.yaml"
    bad.write_text("adapter: {learning_rate: 0}\n")
    res = _train(tiny_models, tmp_path, tmp_path / "run2", "--mode", "custom", "--config", str(bad))
    assert res.exit_code == 2 and "learning_rate" in res.output, res.output


def test_custom_target_modules_that_do_not_exist_are_named_with_those_that_do(tiny_models, tmp_path):
    cfg = tmp_path / "u.yaml"
    cfg.write_text("adapter: {target_modules: [self_attn.nope]}\n")
    res = _train(tiny_models, tmp_path, tmp_path / "run", "--mode", "custom", "--config", str(cfg))
    assert res.exit_code == 2
    assert "'self_attn.nope' is no module of this model" in res.output and "self_attn.q_proj" in res.output


def test_train_bad_input_fails_before_the_model_loads(tiny_models, tmp_path, monkeypatch):
    import kite.model

    monkeypatch.setattr(kite.model, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    from typer.testing import CliRunner

    from kite.cli.main import app

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "x", "prompt": "q"}\n')
    run = CliRunner().invoke
    res = run(app, ["upcycle", "train", "--model", str(tiny_models["llama"]), "--data-path", str(bad),
                    "--output-dir", str(tmp_path / "o")])
    assert res.exit_code == 2 and f"{bad}:1: expected a non-empty string \"response\"" in res.output
    one = tmp_path / "one.jsonl"
    one.write_text('{"context": "x", "prompt": "q", "response": "a"}\n')
    res = run(app, ["upcycle", "train", "--model", str(tiny_models["llama"]), "--data-path", str(one),
                    "--output-dir", str(tmp_path / "o")])
    assert res.exit_code == 2 and "at least 2 documents" in res.output
    good = tmp_path / "good.jsonl"
    good.write_text("".join(f'{{"context": "doc {d}", "prompt": "q", "response": "a"}}\n' for d in range(4)))
    res = run(app, ["upcycle", "train", "--model", str(tiny_models["llama"]), "--data-path", str(good),
                    "--output-dir", str(tmp_path / "o"), "--eval-fraction", "0.25", "--regenerator",
                    str(tmp_path / "nowhere")])
    assert res.exit_code == 2 and "not a regenerator" in res.output, res.output
    for ratio in ("1", "nan", "inf"):
        res = run(app, ["upcycle", "train", "--model", str(tiny_models["llama"]), "--data-path", str(good),
                        "--output-dir", str(tmp_path / "o"), "--ratio", ratio])
        assert res.exit_code == 2 and "each training ratio is a finite number > 1" in res.output, res.output


@pytest.mark.slow   # three `kite upcycle train` processes: 40-80 s
def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(tiny_models, tmp_path):
    """SIGKILL after the first checkpoint, then --resume: the same adapter as a run never stopped."""
    import os
    import signal
    import subprocess
    import sys

    from safetensors.torch import load_file

    pairs = _pairs_file(tmp_path)
    # bitwise equal weights from two processes need the BLAS to take the same path in both: one thread
    # (no split of the sums that load can change) and MKL's reproducible mode (none that the memory's
    # alignment picks); once, in a full suite on a loaded 2-core box, the weights differed without them
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "MKL_CBWR": "COMPATIBLE"}

    def cmd(out, *extra):
        return [sys.executable, "-m", "kite.cli.main", "upcycle", "train", "--model", str(tiny_models["llama"]),
                "--data-path", str(pairs), "--output-dir", str(out), "--eval-fraction", "0.2", "--epochs", "6",
                "--checkpoint-every", "10", *extra]

    whole = tmp_path / "whole"
    subprocess.run(cmd(whole), env=env, check=True, capture_output=True)
    cut = tmp_path / "cut"
    proc = subprocess.Popen(cmd(cut), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = cut / "checkpoints" / "latest.json"
    wait_until(lambda: latest.exists() or proc.poll() is not None, 120, 0.02, "the first checkpoint")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert latest.exists() and not (cut / "adapter").exists(), "the run ended before it could be killed"
    res = subprocess.run(cmd(cut, "--resume", "--json"), env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout[res.stdout.index("{"):])
    assert 0 < report["training"]["8"]["resumed_from"] < report["training"]["8"]["steps"] == 6 * 16
    assert "compress" not in report["stages"] and report["stages"]["capture"]["count"] == 5   # the teacher's only
    assert report["loss"] == json.loads((whole / "train_report.json").read_text())["loss"]
    a = load_file(whole / "adapter" / "adapter_model.safetensors")
    b = load_file(cut / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- the reader adapter: on exactly while a state made for it is read -----------------------------

@pytest.fixture(scope="module")
def reader_dir(tiny_models, tmp_path_factory):
    """A LoRA on q_proj/o_proj with random (non-zero) weights: it changes what the model says."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                                                 init_lora_weights=False))
    out = tmp_path_factory.mktemp("reader") / "adapter"
    peft_model.save_pretrained(out)
    return out


def _state(lm, out):
    from kite.upcycle import CompressSettings, codec_settings, compress_document
    from tests.tiny_models import CORPUS

    compress_document(lm, CORPUS, out, CompressSettings(codec=codec_settings("exact"), n_clusters=2,
                                                        min_span_tokens=8, max_span_tokens=24))
    return out


def test_the_reader_adapter_is_on_only_after_a_state_made_for_it(tiny_models, reader_dir, tmp_path):
    from kite.model import load_model
    from kite.runtime.generate import generate
    from kite.upcycle import StateFile, load_prefix

    base = load_model(str(tiny_models["llama"]), device="cpu")
    reader = load_model(str(tiny_models["llama"]), adapter=reader_dir, device="cpu")
    prompt = base.tokenizer(" The parties agree", add_special_tokens=False)["input_ids"]
    # no state: the reader is off, the answer is the base model's
    a, b = generate(base, prompt, max_new_tokens=6), generate(reader, prompt, max_new_tokens=6)
    assert (a.text, a.reader_adapter, b.reader_adapter) == (b.text, False, False)
    # a state made for the reader: on while it is read (the KV stays the base model's)
    made = _state(reader, tmp_path / "for-reader.upc")
    with StateFile(made) as sf:
        assert sf.meta["fingerprints"]["adapter"] == reader.fingerprints.adapter
    prefix, _ = load_prefix(made, reader)
    on = generate(reader, prompt, max_new_tokens=6, prefix=prefix)
    assert prefix.reader and on.reader_adapter
    plain = _state(base, tmp_path / "plain.upc")
    ref, _ = load_prefix(plain, base)
    assert all(torch.equal(x, y) for x, y in zip(prefix.keys + prefix.values, ref.keys + ref.values))
    assert generate(base, prompt, max_new_tokens=6, prefix=ref).reader_adapter is False
    # a state made for no reader loads on the reader's model, with the reader off
    other, _ = load_prefix(plain, reader)
    off = generate(reader, prompt, max_new_tokens=6, prefix=other)
    assert not other.reader and not off.reader_adapter
    assert off.text == generate(base, prompt, max_new_tokens=6, prefix=ref).text
    # a state made for the reader is refused by a model without it
    with pytest.raises(FingerprintMismatch, match="made for reader adapter"):
        load_prefix(made, base)


def test_compress_and_eval_take_a_regenerator_folder(tiny_models, tiny_lm, tiny_regenerator, tmp_path):
    from typer.testing import CliRunner

    from kite.cli.main import app
    from kite.upcycle import StateFile
    from tests.conftest import parse_json
    from tests.tiny_models import CORPUS

    tiny_regenerator.save(tmp_path / "reg")
    doc = tmp_path / "d.txt"
    doc.write_text(CORPUS)
    run = CliRunner().invoke
    base = ["--model", str(tiny_models["llama"]), "--input", str(doc)]
    res = run(app, ["upcycle", "compress", *base, "--output", str(tmp_path / "d.upc"), "--regenerator",
                    str(tmp_path / "reg"), "--ratio", "8", "--json"])
    assert res.exit_code == 0, res.output
    with StateFile(tmp_path / "d.upc") as sf:
        assert sf.meta["regenerator"]["fingerprint"] == tiny_regenerator.fingerprint
    res = run(app, ["upcycle", "eval", *base, "--regenerator", str(tmp_path / "reg"), "--ratio", "8",
                    "--context-tokens", "150", "--continuation-tokens", "40", "--json"])
    assert res.exit_code == 0, res.output
    assert parse_json(res.output)["regenerator"] == tiny_regenerator.fingerprint
    res = run(app, ["upcycle", "compress", *base, "--output", str(tmp_path / "e.upc"), "--regenerator",
                    str(tmp_path / "nope")])
    assert res.exit_code == 2 and "not a regenerator" in res.output


def test_training_states_are_coded_with_the_layer_weights_states_of_the_model_get_outside_training(tiny_models,
                                                                                                tmp_path):
    """The adapter learns to read the states it will meet: a run's states take the layer weights the
    config names (else those KITE ships for the model; this one has none), the report and the run's
    key say which, and a folder made with other weights is another run."""
    from kite.upcycle import codec
    from kite.upcycle.format import StateFile
    from tests.conftest import parse_json

    n_layers = json.loads((Path(tiny_models["llama"]) / "config.json").read_text())["num_hidden_layers"]
    w = codec.LayerWeights((1.0,) * n_layers, (2.0,) + (1.0,) * (n_layers - 1))
    w.save(tmp_path / "w.json")
    cfg = tmp_path / "u.yaml"
    cfg.write_text(f"layer_weights: {tmp_path / 'w.json'}\n")
    for out, extra, want in ((tmp_path / "plain", [], None),
                             (tmp_path / "weighted", ["--config", str(cfg)], w.fingerprint)):
        res = _train(tiny_models, tmp_path, out, "--regenerator-only", "--layer-group", "1", *extra)
        assert res.exit_code == 0, res.output
        assert parse_json(res.output)["layer_weights"] == want
        states = sorted((out / "states").glob("*.upc"))
        assert len(states) == 5
        for path in states:
            with StateFile(path) as sf:
                assert (sf.meta.get("layer_weights") or {}).get("fingerprint") == want
    res = _train(tiny_models, tmp_path, tmp_path / "plain", "--regenerator-only", "--layer-group", "1", "--config",
                 str(cfg), "--resume")
    assert res.exit_code != 0 and "holds another run (its config, layer-weights differ)" in res.output


@pytest.mark.slow     # (a benchmark script in its own Python: a torch import)
@pytest.mark.parametrize("flag", ["--pairs-per-document", "--capture-batch-tokens"])
def test_the_speed_benchmark_refuses_a_negative_count_in_one_line_before_loading_a_model(flag):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "train_speed.py"), flag, "-1"],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "take a number >= 0" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.slow     # (a benchmark script in its own Python: a torch import)
@pytest.mark.parametrize("flag", ["--epochs", "--tokens", "--correction-lr"])
def test_the_recovery_study_refuses_a_setting_of_zero_in_one_line_before_loading_a_model(flag):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "restore_tokens.py"), flag, "0"],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and f"{flag} must be positive" in run.stderr
    assert "Traceback" not in run.stderr and "regenerator" not in run.stderr


@pytest.mark.slow     # (a benchmark script in its own Python: a torch import)
def test_the_recovery_study_refuses_a_continuation_too_short_for_a_window():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "restore_tokens.py"), "--train-continuation", "8"],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--train-continuation must be at least 16" in run.stderr
