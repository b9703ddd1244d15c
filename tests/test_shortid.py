"""Two fingerprints or addresses in one message are cut where they differ, never to the same text."""

from __future__ import annotations

import pytest

from kite.shortid import apart

A = "kite-fp1:" + "3f4a7011d963aa" + "0" * 50
B = "kite-fp1:" + "3f4a7011d963aa" + "1" + "0" * 49


def test_cut_at_the_first_digit_that_differs():
    assert apart(A, B) == ("3f4a7011d963aa0", "3f4a7011d963aa1")
    assert apart(A, "kite-fp1:ff" + "0" * 62) == ("3f4a7011d963", "ff0000000000")   # never under 12
    assert apart("abc", "abd", least=2) == ("abc", "abd")
    assert apart(A, None) == ("3f4a7011d963", "none")
    assert apart(A, A) == ("3f4a7011d963", "3f4a7011d963")
    assert apart("a" * 64, "a" * 63 + "b", 16) == ("a" * 64, "a" * 63 + "b")


def test_a_fingerprint_mismatch_names_fingerprints_that_differ(tiny_contract_state, tmp_path):
    """A state whose tokenizer fingerprint shares its first 14 digits with the loaded model's: the
    error shows both up to the first digit that differs."""
    from kite.errors import FingerprintMismatch
    from kite.upcycle import StateFile, check_fingerprints
    from kite.upcycle.format import rewrite_header

    lm, _, path = tiny_contract_state
    ours = lm.fingerprints.tokenizer.removeprefix("kite-fp1:")
    near = ours[:14] + ("0" if ours[14] != "0" else "1") + ours[15:]
    with StateFile(path) as sf:
        meta = dict(sf.meta)
    meta["fingerprints"] = {**meta["fingerprints"], "tokenizer": "kite-fp1:" + near}
    meta.pop("address", None)
    rewrite_header(path, tmp_path / "near.upc", meta)
    with StateFile(tmp_path / "near.upc") as sf, pytest.raises(FingerprintMismatch) as err:
        check_fingerprints(sf, lm)
    assert f"tokenizer fingerprint {near[:15]} ≠ {ours[:15]} of the loaded model" in str(err.value)
