"""Mutants of a `.upc` state, as a hostile writer makes them: what a reader must refuse or load
exactly as the original, never crash on nor load differently without a word.

Each mutant is one edit of one kind (:data:`MUTANT_KINDS`), made from the original's bytes, a seed
and an index alone (the same three give the same bytes on every machine):

* ``damage``: random damage, no checksum recomputed (a bit flipped anywhere or in the header,
  the file cut short, bytes appended, a range zeroed).
* ``header``: an edit of the header's JSON (a field changed, dropped or of another type; the
  format version; the address or a fingerprint), the header checksum recomputed.
* ``blob``: an edit inside one part's codec blob (its meta, its tensor table, its bytes), stored
  again with its checksum and every offset rewritten.
* ``keys``: two rows of the blob index swap keys (a part's K and V, one part in two layers or two
  clusters, two layers' shared codecs), every checksum still valid.
* ``clusters``: an edit of the cluster table that still partitions the tokens (two clusters swap
  ids, ranges or labels, a token moves from one cluster to the next), the header checksum
  recomputed.

No mutant recomputes the header's content digest nor the content address: they are the binding a
reader checks an edited header or part against (docs/upc-format.md, "What a reader detects"). A
state written without the digest (:func:`without_content`, as before it) shows what the parts'
own structure catches.
"""

from __future__ import annotations

import copy
import hashlib
import json
import struct
from dataclasses import dataclass

import numpy as np

from kite.upcycle.format import codec_blob

MUTANT_KINDS = ("damage", "header", "blob", "keys", "clusters")
_PRE = struct.Struct("<8sHHI16s")


@dataclass(frozen=True, slots=True)
class Mutant:
    index: int
    kind: str
    name: str       # what was edited, for a report (e.g. "keys: c0/L1/K <-> c0/L1/V")
    data: bytes


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class _Parsed:
    """A clean state's parts: preamble fields, header (with its blob index) and each stored blob."""

    def __init__(self, data: bytes):
        magic, self.version, self.flags, hlen, _ = _PRE.unpack_from(data)
        self.header_len = hlen
        self.meta = json.loads(data[_PRE.size:_PRE.size + hlen])
        start = _PRE.size + hlen
        self.blobs = [[row[0], data[start + row[1]:start + row[1] + row[2]], row[3], row[4]]
                      for row in self.meta["blobs"]]

    def raw(self, i: int) -> bytes:
        _, stored, _, codec = self.blobs[i]
        if codec == "zstd":
            import zstandard

            return zstandard.ZstdDecompressor().decompress(stored)
        if codec == "rans":
            from kite.upcycle.format import entropy_blob

            return entropy_blob.unpack(stored, self.blobs[i][2], entropy_blob.tables_from(self.meta.get("entropy")))
        return stored


def assemble(meta: dict, blobs, version: int = 1, flags: int = 0, index: list | None = None) -> bytes:
    """A state of these blobs ``[key, stored bytes, raw length, codec]`` in order under ``meta``,
    its blob index (offsets, lengths, checksums) and header checksum computed; ``index`` replaces
    the computed blob index (a key swap keeps every other field)."""
    rows, at = [], 0
    for key, stored, raw_len, codec in blobs:
        rows.append([key, at, len(stored), raw_len, codec, _digest(stored).hex()])
        at += len(stored)
    header = json.dumps({**{k: v for k, v in meta.items() if k != "blobs"}, "blobs": index or rows},
                        separators=(",", ":"), ensure_ascii=False).encode()
    pre = _PRE.pack(b"KITEUPC\0", version, flags, len(header), _digest(header))
    return pre + header + b"".join(stored for _, stored, _, _ in blobs)


def without_content(data: bytes) -> bytes:
    """The state without its header's content digest (as states were written before it)."""
    p = _Parsed(data)
    return assemble({k: v for k, v in p.meta.items() if k != "content"}, p.blobs, version=p.version)


def resealed(data: bytes) -> bytes:
    """``data`` (a state, perhaps edited) with every digest recomputed that needs no key: the blob
    index's offsets and checksums, the content digest, the address id and the header checksum. The
    keyed digest (``signature``) is kept as it was: a forger without the key cannot make it
    (docs/upc-format.md, "What a reader detects")."""
    from kite.upcycle.format.address import Address
    from kite.upcycle.format.header import content_digest

    p = _Parsed(data)
    meta = copy.deepcopy(p.meta)
    rows, at = [], 0
    for key, stored, raw_len, codec in p.blobs:
        rows.append([key, at, len(stored), raw_len, codec, _digest(stored).hex()])
        at += len(stored)
    if "content" in meta:
        meta["content"] = content_digest(meta, rows)
    addr = meta.get("address")
    if isinstance(addr, dict) and "id" in addr:
        addr["id"] = Address(addr["format_version"], addr["model"], addr["tokens_sha256"], addr["settings"],
                             addr["regenerator"], addr.get("tenant")).id
    return assemble(meta, p.blobs, version=p.version, flags=p.flags, index=rows)


def mutants(data: bytes, n: int, seed: int = 0, start: int = 0, kinds=MUTANT_KINDS):
    """Mutants ``start`` .. ``n - 1`` of the state ``data``, the kinds taken in turn."""
    parsed = _Parsed(data)
    for i in range(start, n):
        yield make_mutant(data, i, seed, kinds, parsed)


def make_mutant(data: bytes, index: int, seed: int = 0, kinds=MUTANT_KINDS, parsed: _Parsed | None = None) -> Mutant:
    """Mutant ``index`` of ``data``: kind ``kinds[index % len(kinds)]``, its edit drawn from (seed, index)."""
    kind = kinds[index % len(kinds)]
    rng = np.random.default_rng([seed, index])
    parsed = parsed or _Parsed(data)
    name, out = _MAKERS[kind](data, parsed, rng)
    return Mutant(index, kind, f"{kind}: {name}", out)


# --- random damage -------------------------------------------------------------------------------

def _damage(data: bytes, p: _Parsed, rng) -> tuple[str, bytes]:
    op = rng.integers(5)
    buf = bytearray(data)
    if op == 0:
        at, bit = int(rng.integers(len(buf))), int(rng.integers(8))
        buf[at] ^= 1 << bit
        return f"bit {bit} of byte {at} flipped", bytes(buf)
    if op == 1:
        at, bit = int(rng.integers(_PRE.size + p.header_len)), int(rng.integers(8))
        buf[at] ^= 1 << bit
        return f"header byte {at} bit {bit} flipped", bytes(buf)
    if op == 2:
        cut = int(rng.integers(len(buf)))
        return f"cut to {cut} bytes", bytes(buf[:cut])
    if op == 3:
        extra = rng.integers(0, 256, int(rng.integers(1, 65)), dtype=np.uint8).tobytes()
        return f"{len(extra)} bytes appended", bytes(buf) + extra
    at = int(rng.integers(len(buf)))
    n = int(rng.integers(1, 257))
    buf[at:at + n] = bytes(len(buf[at:at + n]))
    return f"bytes {at}-{at + n - 1} zeroed", bytes(buf)


# --- header edits, checksum recomputed ------------------------------------------------------------

def _paths(obj, prefix=()):
    """Every (path, value) below a JSON value (dicts and lists walked; the blob index left out)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if prefix == () and k == "blobs":
                continue
            yield prefix + (k,), v
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:16]):
            yield prefix + (i,), v
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def _drop(obj, path):
    for k in path[:-1]:
        obj = obj[k]
    del obj[path[-1]]


def _changed(value, rng):
    """Another value for a JSON leaf: a number moved (by one, doubled, negated, zero, huge), a
    string edited, a value of another type."""
    op = int(rng.integers(6))
    if isinstance(value, bool) or value is None:
        return [True, False, 0, 1, "x", None][op]
    if isinstance(value, (int, float)):
        return [value + 1, value - 1, value * 2, -value - 1, 0, 2 ** 31][op] if op < 6 else value
    if isinstance(value, str):
        if not value:
            return "x"
        at = int(rng.integers(len(value)))
        c = value[at]
        return [value[:at] + ("0" if c != "0" else "1") + value[at + 1:], value[:-1], value + "x", "", 7, None][op]
    return [None, 0, "x", [], {}, [[0, 1]]][op]


def _header(data: bytes, p: _Parsed, rng) -> tuple[str, bytes]:
    meta = copy.deepcopy(p.meta)
    blobs = [list(b) for b in p.blobs]
    op = int(rng.integers(10))
    if op == 0:
        version = [0, 2, 0xFFFF][int(rng.integers(3))]
        return f"format version {version}", assemble(meta, blobs, version=version)
    if op == 1 and isinstance(meta.get("address"), dict):
        meta["address"]["id"] = "0" * 64
        return "address id zeroed", assemble(meta, blobs)
    if op == 2 and isinstance(meta.get("fingerprints"), dict):
        fp = meta["fingerprints"]
        fp["combined"] = _changed(fp.get("combined") or "", np.random.default_rng(0))
        return "combined fingerprint changed", assemble(meta, blobs)
    leaves = [(path, v) for path, v in _paths(meta)]
    path, value = leaves[int(rng.integers(len(leaves)))]
    where = ".".join(map(str, path))
    if op == 3 and len(path) >= 1:
        _drop(meta, path)
        return f"{where} dropped", assemble(meta, blobs)
    new = _changed(value, rng)
    _set(meta, path, new)
    return f"{where} {_show(value)} -> {_show(new)}", assemble(meta, blobs)


def _show(value) -> str:
    text = json.dumps(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= 30 else text[:27] + "..."


# --- blob edits, checksums and offsets rewritten --------------------------------------------------

def _split_blob(raw: bytes) -> tuple[dict, list, bytes]:
    (n,) = struct.unpack_from("<I", raw, 3)
    head = json.loads(raw[7:7 + n])
    return head["m"], head["t"], raw[7 + n:]


def _join_blob(meta: dict, table: list, body: bytes) -> bytes:
    head = json.dumps({"m": meta, "t": table}, separators=(",", ":")).encode()
    return codec_blob.MAGIC + struct.pack("<I", len(head)) + head + body


def _blob(data: bytes, p: _Parsed, rng) -> tuple[str, bytes]:
    i = int(rng.integers(len(p.blobs)))
    key = p.blobs[i][0]
    raw = p.raw(i)
    bmeta, table, body = _split_blob(raw)
    op = int(rng.integers(9))
    if op <= 1:                                  # a field of the blob's meta
        leaves = list(_paths(bmeta))
        if leaves:
            path, value = leaves[int(rng.integers(len(leaves)))]
            new = _changed(value, rng)
            _set(bmeta, path, new)
            what = f"meta {'.'.join(map(str, path))} {_show(value)} -> {_show(new)}"
            raw = _join_blob(bmeta, table, body)
        else:
            what, raw = "meta given a field", _join_blob({"T": 1}, table, body)
    elif op == 2 and table:                      # a tensor's shape
        j = int(rng.integers(len(table)))
        shape = list(table[j][2]) or [1]
        d = int(rng.integers(len(shape)))
        old = shape[d]
        shape[d] = _changed(old, rng) if not rng.integers(2) else old + 1
        table[j][2] = shape
        what, raw = f"tensor {table[j][0]} shape dim {d} {old} -> {_show(shape[d])}", _join_blob(bmeta, table, body)
    elif op == 3 and table:                      # a tensor's dtype
        j = int(rng.integers(len(table)))
        old = table[j][1]
        table[j][1] = ["u8", "i16", "i32", "i64", "f16", "f32", "bf16", "f8e4m3", "x9"][int(rng.integers(9))]
        what, raw = f"tensor {table[j][0]} dtype {old} -> {table[j][1]}", _join_blob(bmeta, table, body)
    elif op == 4 and table:                      # a tensor dropped or renamed
        j = int(rng.integers(len(table)))
        name = table[j][0]
        if rng.integers(2):
            table[j][0] = name + "_"
            what = f"tensor {name} renamed"
        else:
            size = int(np.prod(table[j][2])) * codec_blob.ITEMSIZE[table[j][1]]
            at = sum(int(np.prod(t[2])) * codec_blob.ITEMSIZE[t[1]] for t in table[:j])
            body = body[:at] + body[at + size:]
            del table[j]
            what = f"tensor {name} dropped"
        raw = _join_blob(bmeta, table, body)
    elif op == 5:                                # the tensors' bytes cut short or extended
        n = int(rng.integers(1, 65))
        if rng.integers(2) and len(body) > n:
            what, raw = f"last {n} data bytes cut", _join_blob(bmeta, table, body[:-n])
        else:
            what, raw = f"{n} data bytes appended", _join_blob(bmeta, table, body + bytes(n))
    elif op == 6:                                # the blob's own framing
        cut = int(rng.integers(len(raw)))
        what, raw = f"blob cut to {cut} bytes", raw[:cut]
    elif op == 7:
        buf = bytearray(raw)
        at = int(rng.integers(min(7, len(buf))))
        buf[at] ^= 1 << int(rng.integers(8))
        what, raw = f"blob framing byte {at} flipped", bytes(buf)
    else:                                        # a data byte changed: a forged value
        buf = bytearray(raw)
        start = len(raw) - len(body)
        at = start + int(rng.integers(max(1, len(body))))
        if at < len(buf):
            buf[at] ^= 1 << int(rng.integers(8))
        what, raw = f"data byte {at - start} flipped", bytes(buf)
    blobs = [list(b) for b in p.blobs]
    blobs[i] = [key, raw, len(raw), "raw"]
    return f"{key} {what}", assemble(p.meta, blobs)


# --- blob-index key swaps -------------------------------------------------------------------------

def _keys(data: bytes, p: _Parsed, rng) -> tuple[str, bytes]:
    keys = [b[0] for b in p.blobs]
    parts = [k.split("/") for k in keys if k.startswith("c")]
    clusters = sorted({k[0] for k in parts})
    layers = sorted({k[1] for k in parts})
    op = int(rng.integers(4))
    c, layer = clusters[int(rng.integers(len(clusters)))], layers[int(rng.integers(len(layers)))]
    side = "KV"[int(rng.integers(2))]
    other_layer = [x for x in layers if x != layer]
    other_c = [x for x in clusters if x != c]
    if op == 0 or (op == 1 and not other_layer) or (op == 2 and not other_c):
        a, b = f"{c}/{layer}/K", f"{c}/{layer}/V"
    elif op == 1:
        a, b = f"{c}/{layer}/{side}", f"{c}/{other_layer[int(rng.integers(len(other_layer)))]}/{side}"
    elif op == 2:
        a, b = f"{c}/{layer}/{side}", f"{other_c[int(rng.integers(len(other_c)))]}/{layer}/{side}"
    else:
        shared = [k for k in keys if not k.startswith("c")]
        if len(shared) < 2:
            a, b = f"{c}/{layer}/K", f"{c}/{layer}/V"
        else:
            x, y = rng.choice(len(shared), 2, replace=False)
            a, b = shared[int(x)], shared[int(y)]
    index = [list(r) for r in p.meta["blobs"]]
    for row in index:
        row[0] = {a: b, b: a}.get(row[0], row[0])
    return f"{a} <-> {b}", assemble(p.meta, p.blobs, version=p.version, index=index)


# --- cluster-table edits --------------------------------------------------------------------------

def _clusters(data: bytes, p: _Parsed, rng) -> tuple[str, bytes]:
    meta = copy.deepcopy(p.meta)
    cl = meta["clusters"]
    if len(cl) < 2:
        return "single cluster left as it is", data
    x, y = (int(v) for v in rng.choice(len(cl), 2, replace=False))
    a, b = cl[x], cl[y]
    op = int(rng.integers(5))
    if op == 0:
        a["id"], b["id"] = b["id"], a["id"]
        what = f"cluster ids {b['id']} <-> {a['id']}"
    elif op == 1:
        a["label"], b["label"] = b["label"], a["label"]
        what = f"labels of clusters {a['id']} and {b['id']} swapped"
    elif op == 2:
        for f in ("token_ranges", "n_tokens"):
            a[f], b[f] = b[f], a[f]
        what = f"token ranges of clusters {a['id']} and {b['id']} swapped"
    elif op == 3:                                # equal-length ranges swapped (else the first of each)
        pairs = [(i, j) for i, r in enumerate(a["token_ranges"]) for j, s in enumerate(b["token_ranges"])
                 if r[1] - r[0] == s[1] - s[0]]
        if pairs:
            i, j = pairs[int(rng.integers(len(pairs)))]
        else:
            i, j = 0, 0
        ra, rb = a["token_ranges"][i], b["token_ranges"][j]
        a["token_ranges"][i], b["token_ranges"][j] = rb, ra
        for c in (a, b):
            c["token_ranges"].sort()
            c["n_tokens"] = sum(e - s for s, e in c["token_ranges"])
        what = f"range {ra} of cluster {a['id']} <-> {rb} of cluster {b['id']}"
    else:                                        # a token moved to the cluster that holds the next one
        owner = {}
        for c in cl:
            for s, e in c["token_ranges"]:
                owner[s] = (c, s, e)
        cuts = [(c, s, e) for c, s, e in owner.values() if e in owner and owner[e][0] is not c]
        if not cuts:
            return "no boundary between clusters", data
        c, s, e = cuts[int(rng.integers(len(cuts)))]
        nxt, _, f = owner[e]
        c["token_ranges"].remove([s, e])
        if e - 1 > s:
            c["token_ranges"].append([s, e - 1])
        nxt["token_ranges"].remove([e, f])
        nxt["token_ranges"].append([e - 1, f])
        for k in (c, nxt):
            k["token_ranges"].sort()
            k["n_tokens"] = sum(e2 - s2 for s2, e2 in k["token_ranges"])
        what = f"token {e - 1} moved from cluster {c['id']} to cluster {nxt['id']}"
    return what, assemble(meta, p.blobs, version=p.version)


_MAKERS = {"damage": _damage, "header": _header, "blob": _blob, "keys": _keys, "clusters": _clusters}

__all__ = ["MUTANT_KINDS", "Mutant", "assemble", "make_mutant", "mutants", "resealed", "without_content"]
