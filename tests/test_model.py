"""Model sources, geometry, fingerprints and `kite model info` on tiny random models."""

from __future__ import annotations

import shutil

import pytest
import torch
from typer.testing import CliRunner

from kite.cli.main import app
from kite.model.fingerprint import fingerprints, short
from tests.conftest import parse_json

runner = CliRunner()


@pytest.mark.parametrize("arch,model_type", [("llama", "llama"), ("qwen2", "qwen2"), ("mistral", "mistral")])
def test_model_info_json(tiny_models, arch, model_type):
    result = runner.invoke(app, ["model", "info", "--model", str(tiny_models[arch]), "--json"])
    assert result.exit_code == 0, result.output
    info = parse_json(result.stdout)
    assert info["model_type"] == model_type
    assert (info["n_layers"], info["n_heads"], info["n_kv_heads"], info["head_dim"]) == (3, 4, 2, 16)
    assert info["context_length"] == 512
    assert info["rope"]["rope_theta"] > 0
    # 2 (K and V) × layers × kv heads × head_dim × bytes
    assert info["kv_bytes_per_token"]["fp16"] == 2 * 3 * 2 * 16 * 2
    assert info["kv_bytes_per_token"]["int4"] == 2 * 3 * 2 * 16 * 0.5
    assert info["fingerprint"].startswith("kite-fp1:") and len(info["fingerprint"]) == 9 + 64


def test_fingerprint_stable_across_loads_and_copies(tiny_models, tmp_path):
    folder = tiny_models["llama"]
    first, second = fingerprints(folder), fingerprints(folder)
    assert first == second
    copy = shutil.copytree(folder, tmp_path / "copy")
    assert fingerprints(copy) == first
    assert len(short(first.combined)) == 12


def test_fingerprint_changes_with_one_weight(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_models["llama"], tmp_path / "changed")
    weights = load_file(folder / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] += 1e-3
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    before, after = fingerprints(tiny_models["llama"]), fingerprints(folder)
    assert after.model != before.model and after.combined != before.combined
    assert after.tokenizer == before.tokenizer


def test_fingerprint_changes_with_tokenizer(tiny_models, tmp_path):
    from transformers import AutoTokenizer

    folder = shutil.copytree(tiny_models["llama"], tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens(["<clause>"])
    tok.save_pretrained(folder)
    before, after = fingerprints(tiny_models["llama"]), fingerprints(folder)
    assert after.tokenizer != before.tokenizer and after.combined != before.combined
    assert after.model == before.model


def test_fingerprint_changes_with_adapter(tiny_models, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    plain = fingerprints(tiny_models["llama"])
    with_adapter = fingerprints(tiny_models["llama"], tmp_path / "adapter")
    assert plain.adapter is None and with_adapter.adapter is not None
    assert with_adapter.combined != plain.combined and with_adapter.model == plain.model
    result = runner.invoke(app, ["model", "info", "--model", str(tiny_models["llama"]),
                                 "--adapter", str(tmp_path / "adapter"), "--json"])
    assert result.exit_code == 0, result.output
    assert parse_json(result.stdout)["fingerprint"] == with_adapter.combined


def test_model_folder_without_config_is_bad_input(tmp_path):
    (tmp_path / "empty").mkdir()
    result = runner.invoke(app, ["model", "info", "--model", str(tmp_path / "empty")])
    assert result.exit_code == 2 and "config.json" in result.output


def test_not_a_gguf_file_is_bad_input(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    result = runner.invoke(app, ["model", "info", "--model", str(bad)])
    assert result.exit_code == 2 and "GGUF" in result.output


def test_load_model_geometry_and_kite_attention(tiny_models):
    from kite.model import load_model

    lm = load_model(str(tiny_models["qwen2"]), device="cpu")
    assert lm.geometry.model_type == "qwen2" and lm.geometry.n_kv_heads == 2
    assert lm.model.config._attn_implementation == "kite"
    assert lm.dtype == torch.float32
