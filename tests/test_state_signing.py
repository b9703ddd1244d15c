"""The keyed digest of a `.upc` header (security.state_key / require_signed): a state KITE signed
opens with the key; a forged one with every unkeyed digest recomputed, a state signed under another
key, and (only when signatures are required) an unsigned one are refused with one line, through
every reader (StateFile, the store's whole-state check, the CLI)."""

from __future__ import annotations

import json
import struct

import pytest
from typer.testing import CliRunner

from kite.errors import BadInput
from kite.store import verify_state
from kite.upcycle.format import (SigningPolicy, StateFile, check_state_bytes, make_mutant, resealed, rewrite_header,
                                 use_policy)
from kite.upcycle.study import make_fuzz_state
from tests.tiny_models import CORPUS

KEY = SigningPolicy(b"a shared secret of the cluster", require=False)
KEY_REQUIRED = SigningPolicy(KEY.key, require=True)
OTHER_KEY = SigningPolicy(b"another cluster's shared secret", require=True)
DOC = CORPUS.replace(". ", ".\n\n", 3)


@pytest.fixture()
def policy():
    """Set the signing policy for the test (use_policy), back to the config's after."""
    yield use_policy
    use_policy(None)


def header(data: bytes) -> dict:
    (hlen,) = struct.unpack_from("<I", data, 12)
    return json.loads(data[32:32 + hlen])


@pytest.fixture(scope="module")
def states(tiny_models, tmp_path_factory):
    """(signed, unsigned) bytes of the same small addressed state of the tiny Llama."""
    folder = tmp_path_factory.mktemp("signing")
    use_policy(KEY)
    try:
        signed = make_fuzz_state(tiny_models["llama"], DOC, folder / "signed.upc").read_bytes()
    finally:
        use_policy(None)
    unsigned = make_fuzz_state(tiny_models["llama"], DOC, folder / "unsigned.upc").read_bytes()
    return signed, unsigned


def opens(path) -> dict:
    with StateFile(path) as sf:
        sf.verify()
        return sf.meta


def refusal(path) -> str:
    with pytest.raises(BadInput) as err:
        opens(path)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_writer_signs_only_with_a_key(states):
    signed, unsigned = states
    sig = header(signed)["signature"]
    assert sig["scheme"] == "kite-hmac1" and len(sig["hmac_sha256"]) == 64 and sig["key_id"] == KEY.key_id
    assert KEY.key.decode() not in signed.decode("latin-1")
    assert "signature" not in header(unsigned)
    assert struct.unpack_from("<H", signed, 8)[0] == 1   # the format version stays 1


def test_signed_state_opens_with_the_key_and_without_one(states, policy, tmp_path):
    path = tmp_path / "s.upc"
    path.write_bytes(states[0])
    for p in (KEY_REQUIRED, KEY, SigningPolicy()):
        policy(p)
        assert opens(path)["n_tokens"] > 0
        assert verify_state(states[0]).id == header(states[0])["address"]["id"]


def test_forged_state_with_every_unkeyed_digest_recomputed(states, policy, tmp_path):
    signed = states[0]
    # a part's value edited, every checksum, the content digest and the header checksum recomputed
    forged = next(m for m in (make_mutant(signed, i, seed=3, kinds=("blob",)) for i in range(40))
                  if "data byte" in m.name)
    path = tmp_path / "forged.upc"
    path.write_bytes(resealed(forged.data))
    policy(SigningPolicy())
    opens(path)   # self-consistent: without the key no reader can tell it from a state KITE wrote
    for p in (KEY, KEY_REQUIRED):
        policy(p)
        assert "its keyed digest does not match" in refusal(path)
        with pytest.raises(BadInput, match="keyed digest does not match"):
            check_state_bytes(path.read_bytes(), "forged")


def test_forged_header_field_is_refused(states, policy, tmp_path):
    from kite.upcycle.format import assemble

    signed = states[0]
    meta = header(signed)
    meta["clusters"][0]["label"], meta["clusters"][1]["label"] = meta["clusters"][1]["label"], meta["clusters"][0]["label"]
    start = 32 + struct.unpack_from("<I", signed, 12)[0]
    blobs = [[r[0], signed[start + r[1]:start + r[1] + r[2]], r[3], r[4]] for r in meta["blobs"]]
    path = tmp_path / "labels.upc"
    path.write_bytes(resealed(assemble(meta, blobs)))
    policy(SigningPolicy())
    opens(path)
    policy(KEY)
    assert "keyed digest does not match" in refusal(path)


def test_another_key_is_refused(states, policy, tmp_path):
    path = tmp_path / "s.upc"
    path.write_bytes(states[0])
    policy(OTHER_KEY)
    assert f"signed with another key (key id {KEY.key_id}" in refusal(path)
    policy(SigningPolicy(OTHER_KEY.key, require=False))
    assert "signed with another key" in refusal(path)


def test_unsigned_state_is_refused_only_when_required(states, policy, tmp_path):
    path = tmp_path / "u.upc"
    path.write_bytes(states[1])
    for p in (SigningPolicy(), KEY):
        policy(p)
        opens(path)
    policy(KEY_REQUIRED)
    assert "unsigned .upc state" in refusal(path)
    with pytest.raises(BadInput, match="unsigned .upc state"):
        verify_state(states[1])


def test_a_signature_cannot_be_moved_to_another_state(states, policy, tmp_path):
    signed, unsigned = states
    meta = header(unsigned)
    meta["signature"] = header(signed)["signature"]
    meta["created_at"] = "2000-01-01T00:00:00+00:00"
    start = 32 + struct.unpack_from("<I", unsigned, 12)[0]
    from kite.upcycle.format import assemble

    blobs = [[r[0], unsigned[start + r[1]:start + r[1] + r[2]], r[3], r[4]] for r in meta["blobs"]]
    path = tmp_path / "moved.upc"
    path.write_bytes(assemble(meta, blobs))
    policy(KEY)
    assert "keyed digest does not match" in refusal(path)


def test_rewrite_header_signs_again(states, policy, tmp_path):
    src, dest = tmp_path / "u.upc", tmp_path / "re.upc"
    src.write_bytes(states[1])
    policy(KEY)
    with StateFile(src) as sf:
        meta = dict(sf.meta)
    meta["source"] = {**meta["source"], "name": "renamed.txt"}
    rewrite_header(src, dest, meta)
    policy(KEY_REQUIRED)
    assert opens(dest)["source"]["name"] == "renamed.txt"
    # without a key, rewriting a signed state drops its (now stale) signature
    policy(SigningPolicy())
    rewrite_header(dest, tmp_path / "plain.upc", meta)
    assert "signature" not in header((tmp_path / "plain.upc").read_bytes())


def test_the_key_comes_from_the_config_and_is_never_printed(states, tmp_path, monkeypatch):
    from kite.cli.main import app

    runner = CliRunner()
    path = tmp_path / "u.upc"
    path.write_bytes(states[1])
    monkeypatch.setenv("KITE_SECURITY__STATE_KEY", OTHER_KEY.key.decode())
    monkeypatch.setenv("KITE_SECURITY__REQUIRE_SIGNED", "1")
    result = runner.invoke(app, ["upcycle", "inspect", str(path)])
    assert result.exit_code == 2, result.output
    assert "unsigned .upc state" in result.output and len(result.output.strip().splitlines()) == 1
    shown = runner.invoke(app, ["config", "show"])
    assert shown.exit_code == 0 and OTHER_KEY.key.decode() not in shown.output
    monkeypatch.delenv("KITE_SECURITY__STATE_KEY")
    result = runner.invoke(app, ["upcycle", "inspect", str(path)])
    assert result.exit_code == 2 and "security.require_signed is on but security.state_key is not set" in result.output
    monkeypatch.delenv("KITE_SECURITY__REQUIRE_SIGNED")
    assert runner.invoke(app, ["upcycle", "inspect", str(path)]).exit_code == 0
    signed = tmp_path / "s.upc"
    signed.write_bytes(states[0])
    shown = runner.invoke(app, ["upcycle", "inspect", str(signed), "--json"])
    assert json.loads(shown.output)["signature"] == {"scheme": "kite-hmac1", "key_id": KEY.key_id, "checked": False}
    monkeypatch.setenv("KITE_SECURITY__STATE_KEY", KEY.key.decode())
    shown = runner.invoke(app, ["upcycle", "inspect", str(signed)])
    assert f"signed with key {KEY.key_id} (checked)" in shown.output


def test_a_bad_key_in_the_config_is_refused_without_showing_it(monkeypatch):
    from kite.cli.main import app

    monkeypatch.setenv("KITE_SECURITY__STATE_KEY", "tooshort-secret")
    result = CliRunner().invoke(app, ["store", "ls", "--store", "mem://"])
    assert result.exit_code == 2 and "tooshort-secret" not in result.output
    assert ("KITE_SECURITY__STATE_KEY: security.state_key = *** is out of range; allowed: a string of 16 "
            "characters or more, or null") in result.output


def test_a_tenant_state_is_signed_over_its_tenant_tag(tiny_models, policy, tmp_path):
    """The keyed digest covers the address section's tenant tag: a tenant's state signs and verifies
    (in the tenant's store too), and one moved to another tenant with every unkeyed digest recomputed
    is refused with the key."""
    from kite.model import load_model
    from kite.store import CorruptState, open_store
    from kite.tenants import tenant_tag
    from kite.upcycle import open_pipeline

    pipe = open_pipeline(lm=load_model(str(tiny_models["llama"]), device="cpu"), tagger=False, ratio=4, clusters=2)
    path = tmp_path / "acme.upc"
    policy(KEY)
    made = pipe.compress(DOC, path, tenant="acme")
    data = path.read_bytes()
    meta = header(data)
    assert meta["address"]["tenant"] == tenant_tag("acme") and meta["signature"]["key_id"] == KEY.key_id
    policy(KEY_REQUIRED)
    info = verify_state(data)
    assert (info.id, info.tenant) == (made.address, tenant_tag("acme"))
    acme = open_store("mem://", tenant="acme")
    assert acme.put(data).tiers == {"mem": "stored"} and acme.get(made.address) == data
    # the same state claimed for beta: the tag edited, the address id and every checksum recomputed
    moved = json.loads(json.dumps(meta))
    moved["address"]["tenant"] = tenant_tag("beta")
    start = 32 + struct.unpack_from("<I", data, 12)[0]
    blobs = [[r[0], data[start + r[1]:start + r[1] + r[2]], r[3], r[4]] for r in meta["blobs"]]
    from kite.upcycle.format import assemble

    forged = resealed(assemble(moved, blobs))
    assert header(forged)["address"]["id"] != made.address
    policy(SigningPolicy())
    assert verify_state(forged).tenant == tenant_tag("beta")   # self-consistent without the key
    for p in (KEY, KEY_REQUIRED):
        policy(p)
        with pytest.raises(BadInput, match="keyed digest does not match"):
            verify_state(forged)
        with pytest.raises((BadInput, CorruptState), match="keyed digest does not match"):
            open_store("mem://", tenant="beta").put(forged)
