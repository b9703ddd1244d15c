"""`kite upcycle train`'s parts: training pairs (read, checked, split by document) and the regenerator
(fitted in a stream, saved and read back, fingerprinted, refused for another model)."""

from __future__ import annotations

import json

import pytest
import torch

from kite.data.pairs import contract_pairs
from kite.errors import BadInput, FingerprintMismatch
from kite.upcycle.train import Regenerator, RegeneratorFit, read_pairs, split_pairs


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
            combined = "kite-fp1:bbbb"

    with pytest.raises(FingerprintMismatch, match="made for model aaaa"):
        reg.check_model(LM)
