"""What a `.upc` header must say, checked whenever a state is opened or written.

Every field is checked against the others (docs/upc-format.md, "Header"): the geometry and the
token count are positive integers, each cluster's token ranges lie inside ``0..n_tokens`` and the
clusters together cover every token once, the blob index names exactly the parts the geometry's
layers and the clusters call for, its rows lie back to back from offset 0, and the codec section
names modes a reader has. A reader can then index by these fields without looking again. The
size of the file against the blob index is the container's check (it knows the file).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import operator
import re

from kite.errors import BadInput
from kite.upcycle.format.names import blob_key, group_leads

# The side coders' modes a version-1 file may name (kite.upcycle.codec registers one coder per mode;
# a test keeps the two lists equal: a new mode is a new thing a file can say, so readers learn it here).
CODEC_MODES = ("pca", "quant", "raw", "rpca")
_HEX = re.compile(r"[0-9a-f]*")

# how a blob may be stored: as it is, zstd-compressed, or a part with its codes entropy coded
# (kite.upcycle.format.entropy_blob)
BLOB_CODECS = frozenset({"raw", "zstd", "rans"})
# an entropy-coded part gives back at most this many times its stored bytes (+ RANS_SLACK): a part's
# group scales and minimums stay as they are, so even codes that vanish leave a fifth of it or more
RANS_EXPANSION, RANS_SLACK = 64, 4096


CONTENT_SCHEME = "kite-content1"


def content_digest(meta: dict, rows: list) -> dict:
    """The header's ``content`` section for the header ``meta`` and its blob index ``rows``: sha256 of
    the canonical JSON (sorted keys, compact, ASCII) of the scheme, ``n_tokens``, each cluster's
    ``[id, label, token_ranges]`` in table order and each blob's ``[key, length, raw_length, codec,
    checksum]`` in index order. It binds the parts (by their checksums) to the keys they are stored
    under and to the clusters whose tokens they hold: an edit of any of them that leaves it as it was
    is refused (docs/upc-format.md, "What a reader detects")."""
    body = {"scheme": CONTENT_SCHEME, "n_tokens": meta.get("n_tokens"),
            "clusters": [[c.get("id"), c.get("label"), c.get("token_ranges")] for c in meta.get("clusters") or []],
            "blobs": [[r[0], r[2], r[3], r[4], r[5]] for r in rows]}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return {"scheme": CONTENT_SCHEME, "sha256": hashlib.sha256(text.encode()).hexdigest()}


class _Bad(Exception):
    """One thing wrong with the header (its text says what)."""


def check_header(meta: dict, path) -> int:
    """BadInput (one line naming `path`) unless the header `meta` (blob index included) is
    consistent; returns the bytes its blobs take, from the end of the header."""
    try:
        return _check(meta)
    except _Bad as exc:
        raise BadInput(f"{path}: corrupt .upc header: {exc}") from None


def _check(meta) -> int:
    if not isinstance(meta, dict):
        raise _Bad("not a JSON object")
    if meta.get("format", "kite-upc") != "kite-upc":
        raise _Bad(f"format {meta['format']!r}, expected 'kite-upc'")
    n_tokens = _int(meta.get("n_tokens"), "n_tokens", 1)
    n_layers = _geometry(meta.get("model"))
    _fingerprints(meta.get("fingerprints", {}))
    _codec(meta.get("codec"))
    for key in ("source", "spans", "tagger"):
        if meta.get(key) is not None:
            _object(meta[key], key)
    if meta.get("regenerator") is not None:
        fp = _object(meta["regenerator"], "regenerator").get("fingerprint")
        if not isinstance(fp, str):
            raise _Bad(f"regenerator.fingerprint is {_show(fp)}, expected a string")
    if "raw_kv_bytes_fp16" in meta:
        _int(meta["raw_kv_bytes_fp16"], "raw_kv_bytes_fp16", 0)
    ids = _clusters(meta.get("clusters"), n_tokens - _recompute(meta.get("recompute"), n_tokens))
    try:
        leads = group_leads(meta, n_layers)
    except BadInput as exc:
        raise _Bad(str(exc)) from None
    size = _blobs(meta.get("blobs"), leads, ids, n_layers)
    if "content" in meta:
        content = meta["content"]
        if not isinstance(content, dict) or content.get("scheme") != CONTENT_SCHEME:
            raise _Bad(f"content section of unknown scheme {_show(content)}")
        if content != content_digest(meta, meta["blobs"]):
            raise _Bad("its content digest does not match its cluster table and blob index (a part, a key or a "
                       "cluster changed after the state was written)")
    return size


def _int(value, what: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(f"{what} is {_show(value)}, expected a whole number")
    if value < least:
        raise _Bad(f"{what} is {value}, expected {least} or more")
    return value


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Bad(f"{what} is {_show(value)}, expected a number")
    return value


def _show(value) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _object(value, what: str) -> dict:
    if not isinstance(value, dict):
        raise _Bad(f"{what} is {'missing' if value is None else _show(value)}, expected an object")
    return value


def _geometry(model) -> int:
    geo = _object(_object(model, "model").get("geometry"), "model.geometry")
    n_layers = _int(geo.get("n_layers"), "model.geometry.n_layers", 1)
    for key in ("n_kv_heads", "head_dim"):
        _int(geo.get(key), f"model.geometry.{key}", 1)
    for key in ("n_heads", "hidden_size", "vocab_size", "context_length"):
        if key in geo:
            _int(geo[key], f"model.geometry.{key}", 1)
    if "rope" in geo:
        _object(geo["rope"], "model.geometry.rope")
    return n_layers


def _fingerprints(fps) -> None:
    for key, value in _object(fps, "fingerprints").items():
        if value is not None and not isinstance(value, str):
            raise _Bad(f"fingerprints.{key} is {_show(value)}, expected a string or null")


def _codec(codec) -> None:
    codec = _object(codec, "codec")
    if not isinstance(codec.get("name", ""), str):
        raise _Bad(f"codec.name is {_show(codec['name'])}, expected a string")
    for side in ("k", "v"):
        mode = codec.get(f"{side}_mode")
        if mode not in CODEC_MODES:
            raise _Bad(f"codec.{side}_mode is {_show(mode)}, expected one of {', '.join(CODEC_MODES)}")
        bits = f"{side}_bits"
        if bits in codec and _number(codec[bits], f"codec.{bits}") <= 0:
            raise _Bad(f"codec.{bits} is {codec[bits]}, expected more than 0")
    for key in ("group_size", "v_group_size", "max_bits"):
        if key in codec:
            _int(codec[key], f"codec.{key}", 1)
    for key in ("k_fmt", "v_fmt", "basis_fmt", "range_mode"):
        if key in codec and not isinstance(codec[key], str):
            raise _Bad(f"codec.{key} is {_show(codec[key])}, expected a string")


def _clusters(clusters, n_tokens: int) -> list[int]:
    # Whole columns are checked with C-level calls (map, zip, sort): a header of 30 layers x 64
    # clusters has ~4,000 blob rows and up to one token range per token. A check that fails goes
    # through the rows one by one to say which is wrong.
    if not isinstance(clusters, list) or not clusters:
        raise _Bad("clusters is missing or empty, expected a list of clusters")
    ids: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    for i, c in enumerate(clusters):
        c = _object(c, f"clusters[{i}]")
        cid = _int(c.get("id"), f"clusters[{i}].id", 0)
        if cid in ids:
            raise _Bad(f"cluster id {cid} appears twice")
        ids.append(cid)
        if not isinstance(c.get("label"), str):
            raise _Bad(f"cluster {cid}'s label is {_show(c.get('label'))}, expected a string")
        if "confidence" in c:
            _number(c["confidence"], f"cluster {cid}'s confidence")
        rows = c.get("token_ranges")
        if not isinstance(rows, list):
            raise _Bad(f"cluster {cid}'s token_ranges is {_show(rows)}, expected a list of [start, end]")
        count = 0
        if rows:
            if set(map(type, rows)) != {list} or set(map(len, rows)) != {2}:
                _explain_ranges(cid, rows, n_tokens)
            s, e = zip(*rows)
            # type() is int: a bool is not a token number
            if set(map(type, s)) | set(map(type, e)) != {int} or min(s) < 0 or max(e) > n_tokens \
                    or any(map(operator.ge, s, e)):
                _explain_ranges(cid, rows, n_tokens)
            count = sum(e) - sum(s)
            starts.extend(s)
            ends.extend(e)
        if _int(c.get("n_tokens"), f"cluster {cid}'s n_tokens", 0) != count:
            raise _Bad(f"cluster {cid}'s n_tokens is {c['n_tokens']}, its token ranges hold {count}")
    # The clusters partition 0..n_tokens: with start < end in every range, that is when the sorted
    # starts are 0 and the sorted ends but the last, and the last end is n_tokens.
    starts.sort()
    ends.sort()
    if not starts or starts[0] != 0 or ends[-1] != n_tokens or starts[1:] != ends[:-1]:
        _explain_partition(clusters, n_tokens)
    return ids


def _recompute(tail, n_tokens: int) -> int:
    """The document's last tokens kept as ids for loads to recompute (the clusters cover the others)."""
    if tail is None:
        return 0
    tail = _object(tail, "recompute")
    ids = tail.get("ids")
    count = _int(tail.get("tokens"), "recompute.tokens", 1)
    if not isinstance(ids, list) or set(map(type, ids)) != {int} or min(ids) < 0 or len(ids) != count:
        raise _Bad(f"recompute.ids is not a list of {count} token ids")
    if count >= n_tokens:
        raise _Bad(f"recompute.tokens is {count}, not fewer than the state's {n_tokens} tokens")
    return count


def _explain_ranges(cid: int, rows: list, n_tokens: int):
    for row in rows:
        if type(row) is not list or len(row) != 2 or type(row[0]) is not int or type(row[1]) is not int:
            raise _Bad(f"cluster {cid}'s token range {_show(row)} is not [start, end]")
        s, e = row
        if not 0 <= s < e <= n_tokens:
            raise _Bad(f"cluster {cid}'s token range [{s}, {e}] is not inside 0..n_tokens ({n_tokens})")
    raise _Bad(f"cluster {cid}'s token ranges are not [start, end] pairs")


def _explain_partition(clusters: list, n_tokens: int):
    ranges = sorted((s, e, c["id"]) for c in clusters for s, e in c["token_ranges"])
    at, last = 0, None
    for s, e, cid in ranges:
        if s < at:
            raise _Bad(f"token {s} is in cluster {last} and in cluster {cid}; clusters must not overlap")
        if s > at:
            raise _Bad(f"tokens {at}-{s - 1} are in no cluster; the clusters must cover every token")
        at, last = e, cid
    raise _Bad(f"tokens {at}-{n_tokens - 1} are in no cluster; the clusters must cover every token")


def _blobs(rows, leads: list[int], ids: list[int], layers: int) -> int:
    """The blob index checked against the parts the layers (or groups: ``leads``, the layers their
    blobs are under) and clusters call for; returns the bytes the blobs take."""
    n_layers = len(leads)
    if not isinstance(rows, list):
        raise _Bad(f"blobs is {_show(rows)}, expected the blob index (a list)")
    if not rows:
        raise _Bad(f"the blob index has no part L0 ({n_layers * (1 + 2 * len(ids))} missing for {n_layers} layers "
                   f"and {len(ids)} clusters)")
    if set(map(type, rows)) != {list} or set(map(len, rows)) != {6}:
        _explain_blobs(rows)
    keys, offsets, lengths, raws, codecs, sums = zip(*rows)
    ints = set(map(type, offsets)) | set(map(type, lengths)) | set(map(type, raws))
    ends = list(itertools.accumulate(lengths))
    if (set(map(type, keys)) != {str} or len(set(keys)) != len(keys) or ints != {int}
            or min(lengths) < 0 or min(raws) < 0 or offsets[0] != 0 or list(offsets[1:]) != ends[:-1]
            or not set(codecs) <= BLOB_CODECS or ("raw", False) in set(zip(codecs, map(operator.eq, raws, lengths)))
            or any(c == "rans" and r > RANS_EXPANSION * n + RANS_SLACK for c, r, n in zip(codecs, raws, lengths))
            or set(map(type, sums)) != {str} or set(map(len, sums)) != {32} or not _HEX.fullmatch("".join(sums))):
        _explain_blobs(rows)
    if n_layers * (1 + 2 * len(ids)) > 4 * len(keys):   # never build a set of keys far larger than the index
        raise _Bad(f"the blob index has {len(keys)} parts; {n_layers} layers and {len(ids)} clusters call for "
                   f"{n_layers * (1 + 2 * len(ids))}")
    want = {blob_key(None, layer) for layer in leads}
    for c in ids:
        for layer in leads:
            want.add(blob_key(c, layer, "K"))
            want.add(blob_key(c, layer, "V"))
    if set(keys) != want:
        _explain_keys(set(keys), leads, ids, layers)
    return ends[-1]


def _explain_blobs(rows: list):
    at = 0
    keys = set()
    for row in rows:
        if type(row) is not list or len(row) != 6 or type(row[0]) is not str:
            raise _Bad(f"blob index row {_show(row)} is not [key, offset, length, raw_length, codec, checksum]")
        key, offset, length, raw_length, codec, checksum = row
        if key in keys:
            raise _Bad(f"part {key} appears twice in the blob index")
        keys.add(key)
        if type(offset) is not int or type(length) is not int or type(raw_length) is not int \
                or length < 0 or raw_length < 0:
            raise _Bad(f"part {key}'s offset, length and raw length are {offset!r}, {length!r}, {raw_length!r}, "
                       f"expected whole numbers, 0 or more")
        if offset != at:
            raise _Bad(f"part {key} starts at offset {offset}, expected {at} (parts lie back to back in "
                       f"index order)")
        if codec not in BLOB_CODECS:
            raise _Bad(f"part {key}'s codec is {_show(codec)}, expected raw, zstd or rans")
        if codec == "raw" and raw_length != length:
            raise _Bad(f"part {key} is stored raw but its raw length {raw_length} is not its length {length}")
        if codec == "rans" and raw_length > RANS_EXPANSION * length + RANS_SLACK:
            raise _Bad(f"part {key} is entropy coded in {length} bytes but its raw length is {raw_length}")
        if type(checksum) is not str or len(checksum) != 32 or not _HEX.fullmatch(checksum):
            raise _Bad(f"part {key}'s checksum is {_show(checksum)}, expected 32 hex digits")
        at += length
    raise _Bad("the blob index is malformed")


def _explain_keys(keys: set, leads: list[int], ids: list[int], n_layers: int):
    layers = f"{n_layers} layers" if len(leads) == n_layers else f"{len(leads)} layer groups"
    want = {blob_key(None, layer) for layer in leads}
    want.update(blob_key(c, layer, side) for c in ids for layer in leads for side in ("K", "V"))
    missing = sorted(want - keys, key=_key_order)
    if missing:
        raise _Bad(f"the blob index has no part {missing[0]} ({len(missing)} missing for "
                   f"{layers} and {len(ids)} clusters)")
    extra = sorted(keys - want, key=_key_order)
    raise _Bad(f"the blob index has a part {extra[0]} that {layers} and clusters "
               f"{_id_list(ids)} do not call for")


def _id_list(ids: list[int]) -> str:
    return ", ".join(map(str, sorted(ids)[:8])) + (" ..." if len(ids) > 8 else "")


def _key_order(key: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key))
