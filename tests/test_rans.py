"""The order-0 rANS coder of quantized codes: exact round trips, sizes against the entropy, the
blob layout, and damaged blobs and bad arguments refused with ValueError."""

import numpy as np
import pytest

from kite.upcycle.format import entropy_blob, rans

DAMAGED = "entropy-coded block is damaged"


@pytest.fixture
def many_streams(monkeypatch):
    """Few steps per stream, so that small arrays already run on many streams."""
    monkeypatch.setattr(rans, "STEPS_PER_STREAM", 64)


def _peaked(rng, n, bits, sigma=1.0):
    top = (1 << bits) - 1
    return np.clip(np.rint(rng.normal(top / 2, sigma, n)), 0, top).astype(np.int64)


def _uniform(rng, n, bits):
    return rng.integers(0, 1 << bits, n)


def _round_trip(codes, bits):
    blob = rans.encode(codes, bits)
    out = rans.decode(blob, np.asarray(codes).size, bits)
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, np.asarray(codes).reshape(-1))
    return blob


@pytest.mark.usefixtures("many_streams")
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("draw", [_uniform, _peaked])
def test_round_trip_bit_widths(bits, draw):
    rng = np.random.default_rng(bits)
    codes = draw(rng, 10_001, bits)
    blob = _round_trip(codes, bits)
    assert rans.streams_for(codes.size) == 256 and codes.size % 256 != 0
    assert blob[3] == 8    # log2 of 256 streams


@pytest.mark.usefixtures("many_streams")
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.int32, np.int64, np.uint64])
def test_any_integer_dtype_and_shape(dtype):
    codes = _peaked(np.random.default_rng(1), 3000, 4).astype(dtype).reshape(30, 100)
    out = rans.decode(rans.encode(codes, 4), codes.size, 4)
    np.testing.assert_array_equal(out, codes.reshape(-1))


@pytest.mark.parametrize("bits, value", [(1, 0), (1, 1), (3, 5), (8, 255)])
def test_one_symbol_is_header_and_table_only(bits, value):
    codes = np.full(50_000, value)
    blob = _round_trip(codes, bits)
    assert len(blob) == rans.HEADER_BYTES + 2 * (1 << bits)
    freq = np.frombuffer(blob, "<u2", offset=rans.HEADER_BYTES)
    assert freq[value] == 1 << rans.SCALE_BITS and freq.sum() == 1 << rans.SCALE_BITS


def test_two_symbols():
    rng = np.random.default_rng(2)
    codes = np.where(rng.random(7777) < 0.03, 6, 1)
    _round_trip(codes, 3)
    assert rans.coded_size(codes, 3) * 8 < 0.3 * codes.size


@pytest.mark.parametrize("bits", [1, 8])
def test_empty(bits):
    blob = _round_trip(np.zeros(0, dtype=np.uint8), bits)
    assert len(blob) == rans.HEADER_BYTES + 2 * (1 << bits)
    assert rans.entropy_bits(np.zeros(0, dtype=np.int64), bits) == 0.0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 100])
def test_few_codes_on_several_streams(monkeypatch, n):
    monkeypatch.setattr(rans, "STEPS_PER_STREAM", 1)
    codes = np.arange(n) % 5
    blob = _round_trip(codes, 3)
    streams = 1 << blob[3]
    assert streams <= n and (n == 1 or streams > 1)


@pytest.mark.usefixtures("many_streams")
def test_random_lengths_and_widths():
    rng = np.random.default_rng(1234)
    for _ in range(40):
        bits = int(rng.integers(1, 9))
        n = int(rng.integers(0, 6000))
        probs = rng.dirichlet(np.full(1 << bits, 0.3))
        codes = rng.choice(1 << bits, size=n, p=probs)
        _round_trip(codes, bits)


def test_default_streams_not_a_multiple():
    codes = _peaked(np.random.default_rng(3), 3 * 8192 + 17, 3)
    blob = _round_trip(codes, 3)
    assert 1 << blob[3] == rans.streams_for(codes.size) == 4


def test_streams_for_policy():
    assert rans.streams_for(0) == rans.streams_for(1) == 1
    assert rans.streams_for(2_000_000) == 256
    assert rans.streams_for(10**9) == rans.MAX_STREAMS
    for n in (2, 3, 100, 8193, 123_457):
        k = rans.streams_for(n)
        assert k & (k - 1) == 0 and k <= n


def test_size_close_to_entropy():
    rng = np.random.default_rng(4)
    codes = _peaked(rng, 300_000, 3, sigma=0.9)
    blob = rans.encode(codes, 3)
    assert rans.coded_size(codes, 3) == len(blob)
    entropy_bytes = rans.entropy_bits(codes, 3) / 8
    streams = 1 << blob[3]
    overhead = rans.HEADER_BYTES + 2 * 8 + streams * (2 + 4)
    assert entropy_bytes < 0.75 * codes.size * 3 / 8          # the test data is peaked
    assert abs(len(blob) - overhead - entropy_bytes) < 0.01 * entropy_bytes


def test_entropy_bits_exact():
    codes = np.repeat(np.arange(4), 250)
    assert rans.entropy_bits(codes, 2) == pytest.approx(2.0 * codes.size)
    assert rans.entropy_bits(np.repeat([0, 1, 1, 1], 10), 1) == pytest.approx(
        -40 * (0.25 * np.log2(0.25) + 0.75 * np.log2(0.75)))


@pytest.mark.usefixtures("many_streams")
def test_layout():
    codes = _peaked(np.random.default_rng(5), 5000, 4)
    blob = rans.encode(codes, 4)
    assert tuple(blob[:4]) == (rans.FORMAT, 4, rans.SCALE_BITS, 7)
    streams = 128
    freq = np.frombuffer(blob, "<u2", count=16, offset=4)
    np.testing.assert_array_equal(freq, rans.quantize_frequencies(np.bincount(codes, minlength=16)))
    at = 4 + 32
    counts = np.frombuffer(blob, "<u2", count=streams, offset=at)
    states = np.frombuffer(blob, "<u4", count=streams, offset=at + 2 * streams)
    assert (states >= rans.STATE_LOW).all()
    assert len(blob) == at + 6 * streams + 2 * int(counts.sum())


@pytest.mark.parametrize("seed", range(5))
def test_quantize_frequencies(seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 1000, 256) * (rng.random(256) < 0.7)
    counts[0] = 10**7
    freq = rans.quantize_frequencies(counts, 12)
    assert freq.sum() == 4096
    assert ((freq >= 1) == (counts > 0)).all()
    assert (freq[counts == 0] == 0).all()


@pytest.fixture
def coded(many_streams):
    codes = _peaked(np.random.default_rng(6), 20_000, 3)
    return codes, rans.encode(codes, 3)


@pytest.mark.parametrize("keep", [0, 3, 19, 20, 100, -2, -1])
def test_truncated(coded, keep):
    codes, blob = coded
    with pytest.raises(ValueError, match=DAMAGED):
        rans.decode(blob[:keep], codes.size, 3)


@pytest.mark.parametrize("field, value", [(0, 2), (1, 4), (2, 13), (2, 2), (2, 16), (3, 8), (3, 10), (3, 13)])
def test_flipped_header_field(coded, field, value):
    codes, blob = coded
    broken = bytearray(blob)
    broken[field] = value
    with pytest.raises(ValueError, match=DAMAGED):
        rans.decode(bytes(broken), codes.size, 3)


@pytest.mark.parametrize("where", ["frequency", "count", "state", "word"])
def test_flipped_body(coded, where):
    codes, blob = coded
    streams = 1 << blob[3]
    at = {"frequency": 4 + 2 * 3, "count": 4 + 16 + 2 * 5,
          "state": 4 + 16 + 2 * streams + 4 * 7, "word": len(blob) - 2 * 50}[where]
    broken = bytearray(blob)
    broken[at] ^= 0x04
    with pytest.raises(ValueError, match=DAMAGED):
        rans.decode(bytes(broken), codes.size, 3)


@pytest.mark.parametrize("delta", [-1, 1, 5, -300, 300])
def test_wrong_n(coded, delta):
    codes, blob = coded
    with pytest.raises(ValueError, match=DAMAGED):
        rans.decode(blob, codes.size + delta, 3)


def test_wrong_n_of_nonempty_as_empty(coded):
    codes, blob = coded
    with pytest.raises(ValueError, match=DAMAGED):
        rans.decode(blob, 0, 3)


def test_buffer_types(coded):
    codes, blob = coded
    for buf in (memoryview(blob), bytearray(blob), memoryview(b"xx" + blob)[2:]):
        np.testing.assert_array_equal(rans.decode(buf, codes.size, 3), codes)


@pytest.mark.parametrize("bits, bad", [(3, 8), (3, -1), (1, 2), (8, 256)])
def test_out_of_range_codes(bits, bad):
    codes = np.array([0, 1, bad, 0])
    with pytest.raises(ValueError, match=r"must lie in \[0, ") as info:
        rans.encode(codes, bits)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("bits", [0, 9, -1, 2.0])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="bits must be an integer in 1..8"):
        rans.encode(np.zeros(4, dtype=np.int64), bits)
    with pytest.raises(ValueError, match="bits must be an integer in 1..8"):
        rans.decode(b"", 4, bits)


def test_bad_arguments():
    with pytest.raises(ValueError, match="integer dtype"):
        rans.encode(np.zeros(4), 3)
    with pytest.raises(ValueError, match=">= 0"):
        rans.decode(rans.encode(np.zeros(4, dtype=np.int64), 3), -1, 3)


def test_a_shared_table_is_not_stored_and_decodes_the_same_codes():
    rng = np.random.default_rng(3)
    codes = np.clip(np.rint(rng.normal(3.5, 1.2, 20_000)), 0, 7).astype(np.uint8)
    table = rans.quantize_frequencies(np.bincount(codes, minlength=8) + 1)    # every code a slot
    own, shared = rans.encode(codes, 3), rans.encode(codes, 3, table)
    assert shared[0] == rans.SHARED_TABLE and own[0] == rans.FORMAT
    assert len(shared) < len(own)         # no table in it
    assert np.array_equal(rans.decode(shared, codes.size, 3, table), codes)
    with pytest.raises(ValueError, match="damaged"):      # read as a blob with its own table
        rans.decode(shared, codes.size, 3)
    with pytest.raises(ValueError, match="damaged"):      # the other way round
        rans.decode(own, codes.size, 3, table)


def test_a_shared_table_must_give_every_present_code_a_slot():
    codes = np.array([0, 1, 2, 3] * 100, dtype=np.uint8)
    table = np.array([2048, 2048, 0, 0])
    with pytest.raises(ValueError, match="no slot"):
        rans.encode(codes, 2, table)
    with pytest.raises(ValueError, match="summing"):
        rans.encode(codes, 2, np.array([1, 1, 1, 1]))


@pytest.mark.parametrize("section", [None, {}, {"scale": 12, "tables": {"3": [1, 2]}},
                                     {"scale": 12, "tables": {"9": [4096]}}, {"scale": 11, "tables": {}}])
def test_a_damaged_table_section_is_refused(section):
    with pytest.raises(ValueError):
        entropy_blob.tables_from(section)


def test_codes_pack_and_unpack_at_every_width():
    rng = np.random.default_rng(0)
    for bw in range(1, 9):
        codes = rng.integers(0, 1 << bw, size=101).astype(np.uint8)
        nbytes = (101 * bw + 7) // 8
        packed = entropy_blob.pack_codes(codes, bw, nbytes)
        assert len(packed) == nbytes
        assert np.array_equal(entropy_blob.unpack_codes(packed, bw, 101), codes)


def test_the_native_coder_and_packer_give_numpys_bytes(monkeypatch):
    from kite.kernels import native

    if native.cpu() is None:
        pytest.skip("native runtime not built (make build-runtime)")
    rng = np.random.default_rng(5)
    cases = [(bw, rng.integers(0, 1 << bw, size=n).astype(np.uint8)) for bw in range(1, 9) for n in (0, 1, 9, 5000)]
    cases.append((3, np.clip(np.rint(rng.normal(3.5, 1.0, 300_000)), 0, 7).astype(np.uint8)))   # several streams
    fast = [(rans.encode(c, bw), entropy_blob.pack_codes(c, bw, (c.size * bw + 7) // 8 + 1)) for bw, c in cases]
    monkeypatch.setattr(native, "cpu", lambda: None)
    for (bw, c), (blob, packed) in zip(cases, fast):
        assert rans.encode(c, bw) == blob and entropy_blob.pack_codes(c, bw, (c.size * bw + 7) // 8 + 1) == packed
        assert np.array_equal(rans.decode(blob, c.size, bw), c)
