"""Order-0 entropy coder for the codes of one bit width: interleaved rANS in numpy.

An array of n codes of ``bits`` bits (values in [0, 2**bits), 1 <= bits <= 8) is coded with
one static frequency table (the codes' counts quantized to a total of 2**SCALE_BITS, every code
that occurs at least 1, the others 0) over K interleaved rANS streams: code i belongs to stream
i % K, so a step codes K codes at once with numpy operations on K-vectors (ceil(n / K) steps; the
last one may have fewer active streams). A stream's state is 32 bits, kept in [2**16, 2**32) by
16-bit renormalization words (at most one word per code). The encoder runs the steps backwards
from the state 2**16; the decoder starts from the encoder's final states, runs forwards, and must
end with every state at 2**16 and every stream's words read.

Blob layout (little-endian throughout):

    offset 0   u8    format (FORMAT)
           1   u8    bits b
           2   u8    scale s (the frequencies sum to 2**s)
           3   u8    log2 K (K streams)
           4   u16   frequencies [2**b]                   (all 0 when n == 0; not there in format
                                                        SHARED_TABLE: the caller keeps the table)
    then, unless n == 0 or one code holds all 2**s of the table (a constant array):
               u16 or u32   words per stream [K]         (u16 when ceil(n / K) < 2**16, else u32)
               u32   final encoder states [K]           (the decoder's initial states)
               u16   words: stream 0's, then stream 1's, ..., each stream's in decoding order

With the native runtime built (``make build-runtime``) the streams are coded in C++, a stream at a
time (csrc/rans.cpp: the same bytes); without it, in numpy.

n is not stored: the caller knows it (``decode`` takes it). A wrong n is caught by the end-state
and word-count checks, except for a constant array, which has no states.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FORMAT", "SHARED_TABLE", "MAX_STREAMS", "SCALE_BITS", "coded_size", "decode", "encode", "entropy_bits",
           "quantize_frequencies", "streams_for"]

FORMAT = 1             # the table stored in the blob
SHARED_TABLE = 2       # the table the caller's (encode's and decode's ``freq``), not stored
SCALE_BITS = 12
MAX_STREAMS = 4096
STEPS_PER_STREAM = 8192       # streams are added (up to MAX_STREAMS) to keep about this many steps
STATE_LOW = 1 << 16           # states live in [STATE_LOW, 2**32)
WORD_BITS = 16
HEADER_BYTES = 4

_U16, _U32 = np.dtype("<u2"), np.dtype("<u4")


def streams_for(n: int) -> int:
    """K, the number of interleaved streams for n codes: a power of two, about n / STEPS_PER_STREAM,
    at most MAX_STREAMS and at most n."""
    if n <= 1:
        return 1
    wanted = max(1, -(-n // STEPS_PER_STREAM))
    streams = 1 << (wanted - 1).bit_length()
    return min(streams, MAX_STREAMS, 1 << (n.bit_length() - 1))


def quantize_frequencies(counts: np.ndarray, scale_bits: int = SCALE_BITS) -> np.ndarray:
    """Counts per code quantized to frequencies (int64) summing to 2**scale_bits: proportional,
    at least 1 where the count is not 0, 0 where it is; the rounding excess is settled greedily
    where it costs the fewest coded bits. All zeros for all-zero counts."""
    counts = np.asarray(counts, dtype=np.int64)
    total, table = int(counts.sum()), 1 << scale_bits
    if total == 0:
        return np.zeros_like(counts)
    if np.count_nonzero(counts) > table:
        raise ValueError(f"{np.count_nonzero(counts)} distinct codes do not fit a table of {table}")
    present = counts > 0
    freq = np.where(present, np.maximum(1, np.rint(counts * (table / total)).astype(np.int64)), 0)
    weight = counts.astype(np.float64)
    while (excess := int(freq.sum()) - table) != 0:
        if excess > 0:      # take one from the code that loses the fewest bits by it
            above = np.maximum(freq, 2)
            loss = np.where(freq > 1, weight * np.log2(above / (above - 1)), np.inf)
            freq[np.argmin(loss)] -= 1
        else:               # give one to the code that gains the most bits by it
            gain = np.where(present, weight * np.log2((freq + 1) / np.maximum(freq, 1)), -np.inf)
            freq[np.argmax(gain)] += 1
    return freq


def entropy_bits(symbols: np.ndarray, bits: int) -> float:
    """The empirical order-0 entropy of the array, in bits for the whole array (n times the
    entropy per code), the bound ``encode``'s payload is compared with."""
    codes = _codes_of(symbols, bits)
    counts = np.bincount(codes, minlength=1 << bits).astype(np.float64)
    counts = counts[counts > 0]
    if counts.size == 0:
        return 0.0
    return float(-(counts * np.log2(counts / codes.size)).sum())


def coded_size(symbols: np.ndarray, bits: int) -> int:
    """The exact length in bytes of ``encode(symbols, bits)``."""
    return len(encode(symbols, bits))


def encode(symbols: np.ndarray, bits: int, freq: np.ndarray | None = None) -> bytes:
    """The blob (layout: the module docstring) of the codes ``symbols`` (any integer dtype and
    shape, flattened; values in [0, 2**bits)). ``freq``: a table of the caller's (2**bits
    frequencies summing to 2**SCALE_BITS, at least 1 for every code present, e.g. one
    :func:`quantize_frequencies` made for many arrays): the blob does not store it (format
    SHARED_TABLE), and :func:`decode` needs it back."""
    codes = _codes_of(symbols, bits)
    scale = SCALE_BITS
    shared = freq is not None
    if shared:
        freq = np.asarray(freq, dtype=np.int64)
        if freq.shape != (1 << bits,) or int(freq.sum()) != 1 << scale or (freq < 0).any():
            raise ValueError(f"a table for {bits}-bit codes has {1 << bits} frequencies summing to {1 << scale}")
        if codes.size and (freq[np.unique(codes)] == 0).any():
            raise ValueError("the table gives a code present in the array no slot")
    else:
        freq = quantize_frequencies(np.bincount(codes, minlength=1 << bits), scale)
    streams = streams_for(codes.size)
    head = bytes((SHARED_TABLE if shared else FORMAT, bits, scale, streams.bit_length() - 1))
    head += b"" if shared else freq.astype(_U16).tobytes()
    if codes.size == 0 or freq.max() == 1 << scale:
        return head
    states, counts, words = _encode_streams(codes, freq, streams, scale)
    count_dtype = _count_dtype(codes.size, streams)
    return b"".join((head, counts.astype(count_dtype).tobytes(), states.astype(_U32).tobytes(),
                     words.astype(_U16).tobytes()))


def decode(blob: bytes | bytearray | memoryview, n: int, bits: int, freq: np.ndarray | None = None) -> np.ndarray:
    """The n codes (uint8) of a blob ``encode`` made of codes of ``bits`` bits (with the same
    ``freq`` it was given, if any); ValueError ("entropy-coded block is damaged: ...") when the blob
    is truncated or inconsistent."""
    _check_bits(bits)
    if n < 0:
        raise ValueError(f"the number of codes must be >= 0, not {n}")
    raw = np.frombuffer(blob, dtype=np.uint8)
    scale, streams, stored = _read_header(raw, bits, freq is not None)
    if freq is None:
        freq, table_end = stored, HEADER_BYTES + 2 * (1 << bits)
    else:
        freq, table_end = np.asarray(freq, dtype=np.int64), HEADER_BYTES
        if freq.shape != (1 << bits,) or (freq < 0).any():
            raise ValueError(f"a table for {bits}-bit codes has {1 << bits} frequencies")
    if n == 0 or int(freq.max()) == 1 << scale:
        return _decode_trivial(raw, n, freq, scale, table_end)
    if int(freq.sum()) != 1 << scale:
        raise _damaged(f"the frequencies sum to {int(freq.sum())}, not {1 << scale}")
    count_dtype = _count_dtype(n, streams)
    states_at = table_end + streams * count_dtype.itemsize
    words_at = states_at + 4 * streams
    if raw.size < words_at:
        raise _damaged(f"{raw.size} bytes, shorter than its {words_at}-byte header for {streams} streams")
    counts = raw[table_end:states_at].view(count_dtype).astype(np.int64)
    states = raw[states_at:words_at].view(_U32).astype(np.uint64)
    if raw.size != words_at + 2 * int(counts.sum()):
        raise _damaged(f"{raw.size} bytes, not the {words_at + 2 * int(counts.sum())} its word counts give")
    if (states < STATE_LOW).any():
        raise _damaged(f"a stream's state is below {STATE_LOW}")
    words = raw[words_at:].view(_U16).astype(np.uint64)
    return _decode_streams(states, counts, words, freq, n, scale)


def _damaged(reason: str) -> ValueError:
    return ValueError(f"entropy-coded block is damaged: {reason}")


def _check_bits(bits: int) -> None:
    if not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, not {bits!r}")


def _codes_of(symbols: np.ndarray, bits: int) -> np.ndarray:
    """The codes as a flat uint8 array, after checking ``bits`` and the values' range."""
    _check_bits(bits)
    codes = np.asarray(symbols)
    if codes.dtype.kind not in "iu":
        raise ValueError(f"codes must have an integer dtype, not {codes.dtype}")
    codes = codes.reshape(-1)
    if codes.size and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {1 << bits}) for {bits} bits, "
                         f"found [{int(codes.min())}, {int(codes.max())}]")
    return codes.astype(np.uint8)


def _count_dtype(n: int, streams: int) -> np.dtype:
    """Each stream has at most one word per step: u16 counts suffice below 2**16 steps."""
    return _U16 if -(-n // streams) < 1 << 16 else _U32


def _cumulative(freq: np.ndarray) -> np.ndarray:
    """The start of each code's slot range in the table (uint64)."""
    return (np.cumsum(freq) - freq).astype(np.uint64)


def _step_grid(codes: np.ndarray, streams: int) -> tuple[np.ndarray, int]:
    """The codes laid out as [steps, K] (the tail padded with 0) and the active streams of the
    last step."""
    steps = -(-codes.size // streams)
    grid = np.zeros(steps * streams, dtype=np.uint8)
    grid[:codes.size] = codes
    return grid.reshape(steps, streams), codes.size - (steps - 1) * streams


def _native():
    """The native runtime's coder (the same bytes, a stream at a time in C++), or None."""
    from kite.kernels import native

    return native.cpu()


def _encode_streams(codes: np.ndarray, freq: np.ndarray, streams: int, scale: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rANS over K streams, steps backwards: the final states (uint64 [K]), the words per stream
    (int64 [K]) and the words (uint64), each stream's contiguous and in decoding order."""
    lib = _native()
    if lib is not None:
        codes = np.ascontiguousarray(codes, dtype=np.uint8)
        f32 = np.ascontiguousarray(freq, dtype=np.int32)
        states = np.empty(streams, dtype=np.uint32)
        counts = np.empty(streams, dtype=np.int64)
        words = np.empty(max(1, codes.size), dtype=np.uint16)
        rc = lib.kite_rans_encode(codes.ctypes.data, codes.size, f32.ctypes.data, f32.size, scale, streams,
                                  states.ctypes.data, counts.ctypes.data, words.ctypes.data, words.size)
        if rc:
            raise ValueError(f"the native rANS coder refused its codes (error {rc})")
        return states.astype(np.uint64), counts, words[:int(counts.sum())].astype(np.uint64)
    return _encode_numpy(codes, freq, streams, scale)


def _encode_numpy(codes: np.ndarray, freq: np.ndarray, streams: int, scale: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    grid, last_active = _step_grid(codes, streams)
    freq64 = freq.astype(np.uint64)
    slot_freq, slot_start = freq64[grid], _cumulative(freq)[grid]
    renorm_at = slot_freq << np.uint64(32 - scale)      # a state at or above it emits a word first
    shift, word_shift, word_mask = np.uint64(scale), np.uint64(WORD_BITS), np.uint64((1 << WORD_BITS) - 1)
    state = np.full(streams, STATE_LOW, dtype=np.uint64)
    emitted = np.zeros(streams, dtype=np.int64)
    chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for step in range(grid.shape[0] - 1, -1, -1):
        active = last_active if step == grid.shape[0] - 1 else streams
        x = state[:active]
        f = slot_freq[step, :active]
        over = np.flatnonzero(x >= renorm_at[step, :active])
        if over.size:
            chunks.append((over, emitted[over], x[over] & word_mask))
            emitted[over] += 1
            x[over] >>= word_shift
        x[:] = ((x // f) << shift) + x % f + slot_start[step, :active]
    return state, emitted, _words_in_decoding_order(chunks, emitted)


def _words_in_decoding_order(chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                             emitted: np.ndarray) -> np.ndarray:
    """The encoder's words (stream, rank in emission order, word) placed stream by stream, each
    stream's reversed: the decoder reads them in the opposite order to their emission."""
    if not chunks:
        return np.zeros(0, dtype=np.uint64)
    stream, rank, word = (np.concatenate(parts) for parts in zip(*chunks))
    offsets = np.cumsum(emitted) - emitted
    words = np.empty(word.size, dtype=np.uint64)
    words[offsets[stream] + emitted[stream] - 1 - rank] = word
    return words


def _read_header(raw: np.ndarray, bits: int, shared: bool = False) -> tuple[int, int, np.ndarray | None]:
    """Scale, stream count and frequencies (int64; None for a blob of a shared table) from a blob's
    header, checked."""
    table_end = HEADER_BYTES + (0 if shared else 2 * (1 << bits))
    if raw.size < table_end:
        raise _damaged(f"{raw.size} bytes, shorter than the {table_end}-byte header of {bits}-bit codes")
    version, coded_bits, scale, log_streams = (int(v) for v in raw[:HEADER_BYTES])
    want = SHARED_TABLE if shared else FORMAT
    if version != want:
        raise _damaged(f"format {version}, expected {want}")
    if coded_bits != bits:
        raise _damaged(f"header says {coded_bits}-bit codes, expected {bits}")
    if not bits <= scale <= 15:
        raise _damaged(f"scale {scale} outside {bits}..15")
    if (1 << log_streams) > MAX_STREAMS:
        raise _damaged(f"{1 << log_streams} streams, more than {MAX_STREAMS}")
    return scale, 1 << log_streams, None if shared else raw[HEADER_BYTES:table_end].view(_U16).astype(np.int64)


def _decode_trivial(raw: np.ndarray, n: int, freq: np.ndarray, scale: int, table_end: int) -> np.ndarray:
    """An empty or constant array: header and table only."""
    if raw.size != table_end:
        raise _damaged(f"{raw.size} bytes, expected {table_end} for an empty or constant block")
    if n == 0:
        if freq.any():
            raise _damaged("frequencies given for no codes")
        return np.zeros(0, dtype=np.uint8)
    if int(freq.sum()) != 1 << scale:
        raise _damaged(f"the frequencies sum to {int(freq.sum())}, not {1 << scale}")
    return np.full(n, int(np.argmax(freq)), dtype=np.uint8)


_NATIVE_ERRORS = {4: "a stream runs out of words", 5: "streams end with words unread",
                  6: "streams end off their initial state"}


def _decode_streams(states: np.ndarray, counts: np.ndarray, words: np.ndarray, freq: np.ndarray,
                    n: int, scale: int) -> np.ndarray:
    """rANS decoding of n codes over the K streams, steps forwards, with the end checks."""
    lib = _native()
    if lib is not None:
        st = np.ascontiguousarray(states, dtype=np.uint32)
        ct = np.ascontiguousarray(counts, dtype=np.int64)
        wd = np.ascontiguousarray(words, dtype=np.uint16)
        f32 = np.ascontiguousarray(freq, dtype=np.int32)
        out = np.empty(n, dtype=np.uint8)
        rc = lib.kite_rans_decode(st.ctypes.data, ct.ctypes.data, wd.ctypes.data if wd.size else None, st.size,
                                  f32.ctypes.data, f32.size, scale, n, out.ctypes.data)
        if rc:
            raise _damaged(_NATIVE_ERRORS.get(rc, f"its table is not one the coder makes (error {rc})"))
        return out
    return _decode_numpy(states, counts, words, freq, n, scale)


def _decode_numpy(states: np.ndarray, counts: np.ndarray, words: np.ndarray, freq: np.ndarray,
                  n: int, scale: int) -> np.ndarray:
    streams = states.size
    steps = -(-n // streams)
    last_active = n - (steps - 1) * streams
    code_of_slot = np.repeat(np.arange(freq.size, dtype=np.uint8), freq)
    freq64, start64 = freq.astype(np.uint64), _cumulative(freq)
    shift, word_shift = np.uint64(scale), np.uint64(WORD_BITS)
    slot_mask = np.uint64((1 << scale) - 1)
    read_at = np.cumsum(counts) - counts
    stream_end = read_at + counts
    out = np.empty((steps, streams), dtype=np.uint8)
    for step in range(steps):
        active = last_active if step == steps - 1 else streams
        x = states[:active]
        slot = x & slot_mask
        code = code_of_slot[slot]
        out[step, :active] = code
        x[:] = freq64[code] * (x >> shift) + (slot - start64[code])
        under = np.flatnonzero(x < STATE_LOW)
        if under.size:
            at = read_at[under]
            if (at >= stream_end[under]).any():
                raise _damaged(f"a stream runs out of words at step {step} of {steps}")
            x[under] = (x[under] << word_shift) | words[at]
            read_at[under] += 1
    if (read_at != stream_end).any():
        raise _damaged(f"{int((read_at != stream_end).sum())} streams end with words unread")
    if (states != STATE_LOW).any():
        raise _damaged(f"{int((states != STATE_LOW).sum())} streams end off their initial state")
    return out.reshape(-1)[:n]
