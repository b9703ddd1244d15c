"""`kite gguf embed` on the embedded model's own GGUF (98 MB), the round trip for real: the output
is the same model to `gguf`'s reader, to transformers (weights, tokenizer, logits) and to KITE
(`kite model info`, `kite generate --upc ID`), and the state comes back byte for byte."""

from __future__ import annotations

import shutil

import pytest
import torch
from typer.testing import CliRunner

from kite.cli.main import app
from kite.model import cpu_products
from tests.conftest import parse_json

pytestmark = pytest.mark.slow
runner = CliRunner()
PROMPT = "The parties agree that the supplier shall"


@pytest.fixture(scope="module")
def embedded_out(embedded, tmp_path_factory):
    """(state, out.gguf): a small int4 state of the embedded model, embedded in a copy of its GGUF."""
    from kite.upcycle import codec
    from kite.upcycle.compress import CompressSettings, compress_document

    root = tmp_path_factory.mktemp("gguf")
    text = open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8").read()[:600]
    state = root / "apache.upc"
    compress_document(embedded, text, state, CompressSettings(codec=codec.settings_for("int4"), n_clusters=2))
    out = root / "smollm2+states.gguf"
    result = runner.invoke(app, ["gguf", "embed", "smollm2-135m", f"apache={state}", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert parse_json(result.output)["model_fingerprint"] == embedded.fingerprints.combined
    return state, out


def test_the_output_is_the_same_model_to_the_gguf_reader_and_gives_the_state_back(embedded, embedded_out):
    from kite.model.gguf import copy_gguf, is_kite_key, open_gguf
    from kite.store import read_state

    state, out = embedded_out
    original, copy = open_gguf(embedded.source.path), open_gguf(out)
    fields = {n: (f.types, f.contents()) for n, f in copy.fields.items() if not n.startswith(("GGUF.", "kite."))}
    assert fields == {n: (f.types, f.contents()) for n, f in original.fields.items() if not n.startswith("GGUF.")}
    assert [k for k in copy.fields if k.startswith("kite.")] == ["kite.upc.apache", "kite.upc_meta.apache"]
    assert len(copy.tensors) == len(original.tensors) == 272
    for a, b in zip(original.tensors, copy.tensors):
        assert (a.name, a.tensor_type, a.data_offset - original.data_offset) == \
               (b.name, b.tensor_type, b.data_offset - copy.data_offset)
        assert a.data.tobytes() == b.data.tobytes()
    # without KITE's keys it is the model file again, byte for byte (what KITE converts)
    stripped = out.with_name("stripped.gguf")
    copy_gguf(copy, stripped, drop=is_kite_key)
    assert stripped.read_bytes() == embedded.source.path.read_bytes()
    stripped.unlink()

    # what `kite gguf extract` writes (tested through the command in test_gguf.py)
    assert read_state(out, "apache", reader=copy)[1] == state.read_bytes()


def test_the_output_loads_in_transformers_as_the_same_model(embedded, embedded_out, tmp_path, monkeypatch):
    """transformers reads the GGUF with the states in it (not a copy without them): the same weights,
    tokenizer and config (the fingerprint of what it saves) and the same logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kite.model.fingerprint import fingerprints

    monkeypatch.setenv("KITE_CACHE", str(tmp_path / "cache"))  # the fingerprints' file hashes
    _, out = embedded_out
    tok = AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
    model = AutoModelForCausalLM.from_pretrained(out.parent, gguf_file=out.name, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    ids = torch.tensor([embedded.tokenizer(PROMPT)["input_ids"]])
    assert tok(PROMPT)["input_ids"] == ids[0].tolist()
    # the same weights, to the last bit: KITE's few-row CPU products (another rounding) set aside
    monkeypatch.setattr(cpu_products, "ENABLED", False)
    with torch.no_grad():
        a, b = model(ids).logits, embedded.model(ids).logits
    assert torch.equal(a, b) or (a - b).abs().max() < 1e-5
    model.hf_quantizer = None  # saved as KITE's conversion saves it (kite.model.sources)
    del model.config.quantization_config
    try:
        model.save_pretrained(tmp_path / "hf", safe_serialization=True)
        tok.save_pretrained(tmp_path / "hf")
        fps = fingerprints(tmp_path / "hf")
    finally:
        shutil.rmtree(tmp_path / "hf", ignore_errors=True)   # 517 MB
    assert (fps.model, fps.tokenizer) == (embedded.fingerprints.model, embedded.fingerprints.tokenizer)


def test_kite_reads_the_output_as_the_same_model_and_offers_its_state_by_id(embedded, embedded_out):
    """`kite model info --model OUT.gguf` prints the embedded model's fingerprint: OUT's model bytes
    (without its states) are the model file's, so OUT gets the folder that file converted to, with
    no second conversion; `kite generate --upc apache` loads the state OUT embeds (the same bytes as
    the file: test_gguf.py's state_path test)."""
    from kite.model.convert import converted_gguf_folder
    from kite.upcycle import StateFile

    state, out = embedded_out
    folder = converted_gguf_folder(out)
    try:
        assert folder.is_symlink() and folder.resolve() == embedded.folder.resolve()
        info = runner.invoke(app, ["model", "info", "--model", str(out), "--json"])
        assert info.exit_code == 0, info.output
        assert parse_json(info.output)["fingerprint"] == embedded.fingerprints.combined
        result = runner.invoke(app, ["generate", "--model", str(out), "--upc", "apache", "--prompt",
                                     "\nWho may grant a license?", "--max-new-tokens", "4", "--json"])
        assert result.exit_code == 0, result.output
        with StateFile(state) as sf:
            n_tokens = sf.meta["n_tokens"]
        loaded = parse_json(result.output)["state"]
        assert loaded["tokens"] == n_tokens and loaded["layers"] == list(range(embedded.geometry.n_layers))
    finally:   # what this test's file left in the shared cache: the link, the extracted state
        from kite.store import cached_state

        folder.unlink(missing_ok=True)
        cached_state(out, "apache").unlink()
