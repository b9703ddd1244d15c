"""The codec's stored units: a :class:`Blob` (compact tensors + JSON meta), the shared per-layer
:class:`LayerCodec`, and a part's K and V blobs (:class:`EncodedPart`). Their bytes are
:mod:`kite.upcycle.format.codec_blob`'s; :func:`nbytes` counts exactly what is stored."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kite.upcycle.codec.settings import CodecSettings
from kite.upcycle.format import codec_blob


@dataclass
class Blob:
    """A stored unit: tensors of compact dtypes + a JSON-able meta."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


@dataclass
class LayerCodec(Blob):
    """The shared per-layer part (means, bases, bit allocations). ``decoded`` holds what the coders
    derived from the stored tensors (a dequantized basis), kept for the next part; clear it to
    free that memory."""

    decoded: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def settings(self) -> CodecSettings:
        return CodecSettings(**self.meta["settings"])


@dataclass
class EncodedPart:
    """One (cluster, layer) part: the keys' blob and the values' blob, stored separately."""

    k: Blob
    v: Blob


def to_bytes(blob: Blob) -> bytes:
    """The blob's bytes (:mod:`kite.upcycle.format.codec_blob`)."""
    return codec_blob.encode(blob.meta, blob.tensors)


def to_bytes_many(blobs: list[Blob]) -> list[bytes]:
    """:func:`to_bytes` of each blob, the tensors they hold on a GPU copied to the host in one
    transfer: a copy per tensor waits for the device each time (a state coded on a GPU holds some
    fifty in its parts)."""
    on_device = [t for b in blobs for t in b.tensors.values() if t.device.type != "cpu" and t.numel()]
    host: dict[int, torch.Tensor] = {}
    if on_device:
        flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in on_device]).cpu()
        at = 0
        for t in on_device:
            n = t.numel() * t.element_size()
            host[id(t)] = flat[at:at + n].clone().view(t.dtype).reshape(t.shape)
            at += n
    return [codec_blob.encode(b.meta, {name: host.get(id(t), t) for name, t in b.tensors.items()}) for b in blobs]


def from_bytes(data: bytes, cls=Blob) -> Blob:
    meta, tensors = codec_blob.decode(data)
    return cls(tensors=tensors, meta=meta)


def nbytes(obj) -> int:
    """Every stored byte of a blob, layer codec, part, or an iterable of them."""
    if isinstance(obj, EncodedPart):
        return nbytes(obj.k) + nbytes(obj.v)
    if isinstance(obj, Blob):
        return codec_blob.blob_nbytes(obj.meta, obj.tensors)
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    return sum(nbytes(o) for o in obj)
