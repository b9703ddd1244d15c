"""`kite store ls|get|put|gc|stats` on a mem:// + file:// store (no services), and their errors."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kite.cli.main import app
from tests.conftest import parse_json
from tests.tiny_models import CORPUS

runner = CliRunner()


@pytest.fixture(scope="module")
def two_states(tiny_models, tmp_path_factory):
    from kite.model import load_model
    from kite.upcycle import open_pipeline

    pipe = open_pipeline(lm=load_model(str(tiny_models["llama"]), device="cpu"), tagger=False, ratio=4, clusters=2)
    folder = tmp_path_factory.mktemp("cli-states")
    out = []
    for i, doc in enumerate((CORPUS, CORPUS.replace(". ", ".\n\n", 2))):
        r = pipe.compress(doc, folder / f"{i}.upc")
        out.append((r.address, folder / f"{i}.upc"))
    return out


def kite(*args):
    return runner.invoke(app, list(args))


def test_put_ls_get_gc_stats(two_states, tmp_path):
    store = f"file://{tmp_path}/disk"
    put = kite("store", "put", *(str(p) for _, p in two_states), "--store", store, "--mkdir", "--json")
    assert put.exit_code == 0, put.output
    stored = parse_json(put.output)["stored"]
    assert [s["id"] for s in stored] == [a for a, _ in two_states]
    assert all(s["tiers"] == {"file": "stored"} for s in stored)
    listed = parse_json(kite("store", "ls", "--store", store, "--json").output)
    assert listed["states"] == [{"id": a, "tiers": ["file"]} for a, _ in sorted(two_states)]
    address, path = two_states[0]
    got = kite("store", "get", address[:10], "-o", str(tmp_path / "out.upc"), "--store", store)
    assert got.exit_code == 0, got.output
    assert (tmp_path / "out.upc").read_bytes() == path.read_bytes()
    stats = parse_json(kite("store", "stats", "--store", f"{store}?max=1", "--json").output)
    assert stats["tiers"][0]["objects"] == 2 and stats["tiers"][0]["max_bytes"] == 1
    gc = parse_json(kite("store", "gc", "--store", f"{store}?max=1", "--json").output)
    assert sorted(gc["evicted"]["file"]) == sorted(a for a, _ in two_states)
    assert parse_json(kite("store", "ls", "--store", store, "--json").output)["states"] == []


def test_the_config_names_the_store(two_states, tmp_path, monkeypatch):
    monkeypatch.setenv("KITE_STORE__URL", f"file://{tmp_path}/cfg")
    assert kite("store", "put", str(two_states[0][1]), "--mkdir").exit_code == 0
    assert two_states[0][0] in kite("store", "ls").output


@pytest.mark.parametrize("args,code,message", [
    (("store", "ls"), 2, "no store: pass --store URL"),
    (("store", "ls", "--store", "gopher://x"), 2, "scheme 'gopher'"),
    (("store", "get", "abc", "-o", "x.upc", "--store", "mem://"), 2, "expected a state address"),
    (("store", "get", "0123456789abcdef", "-o", "x.upc", "--store", "mem://"), 1, "no state with that address"),
])
def test_errors_are_one_line_with_their_exit_code(args, code, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = kite(*args)
    assert result.exit_code == code, result.output
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("command", [("ls",), ("stats",), ("gc",), ("get", "0123456789abcdef", "-o", "x.upc")])
def test_a_read_never_creates_a_missing_store_folder(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "missing"
    result = kite("store", *command, "--store", f"mem://,file://{missing}")
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: store tier file: folder {missing} does not exist"
    assert not missing.exists()


def test_put_creates_a_missing_folder_only_with_mkdir(two_states, tmp_path):
    missing = tmp_path / "new" / "store"
    result = kite("store", "put", str(two_states[0][1]), "--store", f"file://{missing}")
    assert result.exit_code == 2 and not missing.exists()
    assert "folder" in result.output and "does not exist (pass --mkdir to create it)" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert kite("store", "put", str(two_states[0][1]), "--store", f"file://{missing}", "--mkdir").exit_code == 0
    assert [p.name for p in missing.iterdir()] == [f"{two_states[0][0]}.upc"]
    # an existing folder needs no --mkdir; a file in its place is refused
    assert kite("store", "put", str(two_states[1][1]), "--store", f"file://{missing}").exit_code == 0
    (tmp_path / "plain").write_text("x")
    result = kite("store", "ls", "--store", f"file://{tmp_path / 'plain'}")
    assert result.exit_code == 2 and "is not a folder" in result.output


def test_put_refuses_a_damaged_or_unaddressed_file_before_storing_anything(two_states, tmp_path):
    bad = tmp_path / "bad.upc"
    data = two_states[1][1].read_bytes()
    bad.write_bytes(data[:-10])
    store = f"file://{tmp_path}/disk"
    result = kite("store", "put", str(two_states[0][1]), str(bad), "--store", store)
    assert result.exit_code == 2 and "truncated" in result.output
    assert list((tmp_path / "disk").glob("*.upc")) == []


def test_generate_answers_from_a_state_fetched_by_address(two_states, tiny_models, tmp_path):
    address, path = two_states[0]
    store = f"file://{tmp_path}/disk"
    assert kite("store", "put", str(path), "--store", store, "--mkdir").exit_code == 0
    common = ["generate", "--model", str(tiny_models["llama"]), "--prompt", " The supplier", "--max-new-tokens", "3",
              "--json"]
    by_address = kite(*common, "--store", store, "--upc", address[:12])
    by_file = kite(*common, "--upc", str(path))
    assert by_address.exit_code == 0, by_address.output
    got, want = parse_json(by_address.output), parse_json(by_file.output)
    assert got["prefix_tokens"] == want["prefix_tokens"] > 0
    assert got["text"] == want["text"]
    missing = kite(*common, "--store", store, "--upc", "f" * 64)
    assert missing.exit_code == 1 and "no tier of the store holds a good copy" in missing.output
    nowhere = kite(*common, "--store", f"file://{tmp_path}/nowhere", "--upc", address[:12])
    assert nowhere.exit_code == 2 and "folder" in nowhere.output and "does not exist" in nowhere.output
    assert not (tmp_path / "nowhere").exists()


def test_inspect_shows_the_checked_address(two_states, tmp_path):
    from kite.upcycle import StateFile
    from kite.upcycle.format import rewrite_header

    address, path = two_states[0]
    assert parse_json(kite("upcycle", "inspect", str(path), "--json").output)["address"] == address
    with StateFile(path) as sf:
        meta = dict(sf.meta)
    meta["address"] = {**meta["address"], "id": "0" * 64}
    rewrite_header(path, tmp_path / "forged.upc", meta)
    forged = kite("upcycle", "inspect", str(tmp_path / "forged.upc"))
    assert forged.exit_code == 2 and "not the hash of its fields" in forged.output
    del meta["address"]
    rewrite_header(path, tmp_path / "plain.upc", meta)
    assert parse_json(kite("upcycle", "inspect", str(tmp_path / "plain.upc"), "--json").output)["address"] is None
