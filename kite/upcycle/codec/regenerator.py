"""The regenerator: what compression learns once per model from a calibration set (KVTC's lesson).

Per layer and side (pre-RoPE keys ``k``, values ``v``), in the blocks the codec uses (one block of
``H*d`` dims with joint heads, else one per KV head): the calibration tokens' mean, the PCA basis
(every component, columns in order of decreasing variance) and the per-component variances. States
encoded against it store, per layer and side, only their own mean, the bits of each component and
the coefficients; the basis comes from here (:class:`kite.upcycle.codec.RegenSide`). Where a
document's own basis pays for its bytes, the state keeps it instead (the codec decides per layer
and side by the expected error at the byte budget).

A **weighted** regenerator (format version 2: the calibration also summed the queries, and the
model's ``o_proj`` weights were given) minimises what attention feels rather than the plain squared
error (:mod:`kite.upcycle.codec.weights`): per layer and side it holds the distortion weights ``w``
[B, D] (``L{l}.{k|v}.weight``), its basis is the weighted PCA's (the PCA of ``x * sqrt(w)``, stored
as ``U / sqrt(w)`` so decoding is unchanged) and its variances are the weighted ones. States coded
against it keep, per side, whichever of the regenerator's basis and the document's own leaves the
lower *measured* weighted error (:func:`kite.upcycle.codec.fit_layer` with ``weights``). Version 1
regenerators (plain PCA, no weights) load and code as before.

A **grouped** regenerator (format version 3, ``RegeneratorFit(layer_group=g)``) has one basis per
group of ``g`` adjacent layers (joint heads), over the group's ``g*H*d`` features together (KVTC's
PCA over heads and layers; measured: at 16x a basis over every layer leaves a fraction of the
per-layer bases' loss). Each layer's features are weighed by the inverse of its calibration variance
(``L{start}.{side}.weight``, so no layer's scale rules the group's basis), the basis is the weighted
PCA's as above, and its tensors are named by the group's first layer (``L{start}.{side}.*``, ``D =
g*H*d``; the basis in fp16). ``layer_groups`` in the metadata lists the groups as [start, stop].
States coded on it keep one layer codec and one part per (cluster, group, side)
(:mod:`kite.upcycle.codec.groups`).

On disk, in a folder: ``regenerator.safetensors`` (float32 tensors ``L{l}.{k|v}.{mean|basis|evals}``,
and ``.weight`` when weighted or grouped; a grouped one's bases fp16) and ``regenerator.json`` (what it was made for and from). Its fingerprint (``kite-fp1:`` + sha256 of
the tensors' file and the canonical JSON) is what a state records; a state is never decoded with
another regenerator (invariant 3). Fitting streams: each document's Gram is added to a float64 sum,
so the calibration set never has to fit in memory.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kite.errors import BadInput, FingerprintMismatch
from kite.model.fingerprint import PREFIX, short
from kite.shortid import apart

if TYPE_CHECKING:
    from kite.model import LoadedModel
    from kite.upcycle.codec.layer_weights import LayerWeights

FORMAT = "kite-regenerator"
VERSION = 3          # the newest this reads; 1 = unweighted, 2 = weighted, 3 = bases over groups of layers
TENSORS = "regenerator.safetensors"
META = "regenerator.json"


def _blocks(X: torch.Tensor, joint: bool) -> torch.Tensor:
    """[H, T, d] -> [B, T, D] (as the codec's blocks: joint = one block of H*d dims)."""
    if joint:
        H, T, d = X.shape
        return X.permute(1, 0, 2).reshape(1, T, H * d)
    return X


@dataclass
class RegeneratorFit:
    """Streaming sums of a calibration set: per (layer, side), sum x, sum x x^T and the token count."""

    n_layers: int
    joint_heads: bool = True
    center: bool = True
    sums: dict = field(default_factory=dict)      # (layer, side) -> [B, D] float64
    grams: dict = field(default_factory=dict)     # (layer, side) -> [B, D, D] float64
    tokens: int = 0
    documents: int = 0
    digest: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    query_sq: list | None = None                  # per layer [H_q * d] float64, while every document has them
    shape: tuple[int, int] | None = None          # (H, d) of the KV added
    layer_group: int = 1                          # layers a basis spans (> 1: joint heads, dividing n_layers)

    def __post_init__(self) -> None:
        g = self.layer_group
        if isinstance(g, bool) or not isinstance(g, int) or g < 1 or self.n_layers % g:
            raise BadInput(f"--layer-group {g}: expected a whole number that divides the model's {self.n_layers} "
                           f"layers")
        if g > 1 and not self.joint_heads:
            raise BadInput("bases across layers are over the joint heads of each layer (joint_heads)")

    @property
    def groups(self) -> list[tuple[int, int]]:
        """[start, stop) of each group of layers one basis spans."""
        return [(a, a + self.layer_group) for a in range(0, self.n_layers, self.layer_group)]

    def add(self, keys_pre: list[torch.Tensor], values: list[torch.Tensor], ids: list[int] | None = None,
            query_sq: list[torch.Tensor] | None = None) -> None:
        """Add one document's KV ([H, T, d] per layer, keys before RoPE) and, for a weighted
        regenerator, its summed squared queries per layer (:attr:`kite.upcycle.capture.Capture.query_sq`;
        every document must bring them, or the fit is unweighted)."""
        if len(keys_pre) != self.n_layers or len(values) != self.n_layers:
            raise ValueError(f"expected {self.n_layers} layers, got {len(keys_pre)}")
        if query_sq is not None and len(query_sq) != self.n_layers:
            raise ValueError(f"expected queries of {self.n_layers} layers, got {len(query_sq)}")
        self.shape = (int(keys_pre[0].shape[0]), int(keys_pre[0].shape[2]))
        if query_sq is None or (self.documents and self.query_sq is None):
            self.query_sq = None
        elif self.query_sq is None:
            self.query_sq = [q.double().cpu().clone() for q in query_sq]
        else:
            self.query_sq = [a + q.double().cpu() for a, q in zip(self.query_sq, query_sq)]
        for a, b in self.groups:
            for side, Xs in (("k", keys_pre), ("v", values)):
                Xb = torch.cat([_blocks(X.double(), self.joint_heads) for X in Xs[a:b]], dim=2)   # [B, T, D]
                s, g = Xb.sum(dim=1), Xb.transpose(1, 2) @ Xb
                key = (a, side)
                if key in self.sums:
                    self.sums[key] += s
                    self.grams[key] += g
                else:
                    self.sums[key], self.grams[key] = s, g
        self.tokens += int(keys_pre[0].shape[1])
        self.documents += 1
        if ids is not None:
            self.digest.update(json.dumps(ids).encode())

    def regroup(self, layer_group: int) -> "RegeneratorFit":
        """The sums of the same calibration over groups of ``layer_group`` layers (a divisor of this
        fit's): each finer group's sums and Gram are a slice of its coarser group's, so one pass over
        the calibration set can finish bases of every grouping that nests in it (1: per layer)."""
        g, G = layer_group, self.layer_group
        if isinstance(g, bool) or not isinstance(g, int) or g < 1 or G % g:
            raise ValueError(f"layer group {g} does not divide this fit's {G}")
        out = RegeneratorFit(n_layers=self.n_layers, joint_heads=self.joint_heads, center=self.center,
                             tokens=self.tokens, documents=self.documents, digest=self.digest.copy(),
                             query_sq=self.query_sq, shape=self.shape, layer_group=g)
        width = self.sums[(0, "k")].shape[1] // G                 # one layer's features in a block
        for (lead, side), s in self.sums.items():
            for i in range(0, G, g):
                cut = slice(i * width, (i + g) * width)
                out.sums[(lead + i, side)] = s[:, cut]
                out.grams[(lead + i, side)] = self.grams[(lead, side)][:, cut, cut]
        return out

    def finish(self, meta: dict, value_weights: list[torch.Tensor] | None = None,
               layer_weights: LayerWeights | None = None) -> "Regenerator":
        """The regenerator of everything added (``meta``: what it is made for; see :class:`Regenerator`).

        ``value_weights``: per layer [H, d] (:func:`kite.upcycle.codec.weights.model_value_weights`).
        With them, and queries added with every document, the regenerator is weighted (version 2); a
        grouped one weighs each layer's features by them inside the layer. ``layer_weights``: a grouped
        one also weighs each layer side by its weight (:class:`kite.upcycle.codec.LayerWeights`)."""
        from kite.upcycle.codec import weights as W

        if not self.tokens:
            raise BadInput("no calibration tokens: the regenerator needs at least one document")
        grouped = self.layer_group > 1
        attention = value_weights is not None and self.query_sq is not None
        weighted = attention and not grouped
        if value_weights is not None and len(value_weights) != self.n_layers:
            raise ValueError(f"expected value weights of {self.n_layers} layers, got {len(value_weights)}")
        if layer_weights is not None and not grouped:
            raise ValueError("layer weights go into the bases of a grouped regenerator only (a per-layer one's "
                             "states allocate by them)")
        if layer_weights is not None:
            layer_weights.check(self.n_layers)
        tensors: dict[str, torch.Tensor] = {}
        n = float(self.tokens)
        means = {key: s / n if self.center else torch.zeros_like(s) for key, s in self.sums.items()}
        H, d = self.shape
        device = next(iter(self.grams.values())).device      # the sums' (a GPU's in a GPU run); queries are on the host

        def attention_weights(layer: int, side: str) -> torch.Tensor:      # [1, H*d], mean 1 in the layer
            return W.as_blocks(W.key_weights(self.query_sq[layer], H, d) if side == "k" else value_weights[layer],
                               self.joint_heads).to(device)

        if grouped:       # every group's and side's weights first: they are stored on one scale
            group_w = {}
            for (layer, side), mean in means.items():
                var = self.grams[(layer, side)].diagonal(dim1=1, dim2=2) / n - mean ** 2
                span = range(layer, layer + self.layer_group)
                inside = torch.cat([attention_weights(i, side) for i in span], dim=1) if attention else None
                across = layer_weights.side(side)[list(span)] if layer_weights is not None else None
                group_w[(layer, side)] = _group_weights(var, self.layer_group, inside, across)
            group_w = _in_half(group_w)
        for (layer, side), mean in sorted(means.items()):
            cov = self.grams[(layer, side)] / n - mean[:, :, None] * mean[:, None, :]
            root = None
            if grouped:
                w = group_w[(layer, side)]
                tensors[f"L{layer}.{side}.weight"] = w.float().contiguous()
                root = w.double().sqrt()
                cov = cov * root[:, :, None] * root[:, None, :]
            elif weighted:
                w = attention_weights(layer, side).to(torch.float16).float()   # as a state stores them (put_weights)
                tensors[f"L{layer}.{side}.weight"] = w.contiguous()
                root = w.double().sqrt()
                cov = cov * root[:, :, None] * root[:, None, :]
            evals, U = torch.linalg.eigh((cov + cov.transpose(1, 2)) / 2)
            order = torch.argsort(evals, dim=1, descending=True)
            evals = evals.gather(1, order).clamp_min(0)
            U = U.gather(2, order[:, None, :].expand_as(U))
            if root is not None:
                U = U / root[:, :, None]             # the weighted basis: decode c @ U^T / sqrt(w) + mean
            tensors[f"L{layer}.{side}.mean"] = mean.float().cpu().contiguous()
            tensors[f"L{layer}.{side}.basis"] = (U.half() if grouped else U.float()).cpu().contiguous()
            tensors[f"L{layer}.{side}.evals"] = evals.float().cpu().contiguous()
        extra = {"weights": {"k": "query energy per RoPE pair, summed over the KV head's query heads",
                             "v": "o_proj column energy, summed over the KV head's query heads",
                             "floor": W.FLOOR}} if weighted else {}
        if grouped:
            per_layer = "1 / the layer's calibration variance"
            in_layer = {"k": " x the query energy of its RoPE pair, summed over the KV head's query heads",
                        "v": " x the energy of its o_proj columns, summed over the KV head's query heads"}
            of_layer = {"k": " x the layer's keys' weight", "v": " x the layer's values' weight"}
            extra = {"layer_groups": [list(g) for g in self.groups],
                     "weights": {side: per_layer + (in_layer[side] if attention else "")
                                 + (of_layer[side] if layer_weights is not None else "") for side in ("k", "v")}}
            if attention:
                extra["weights"]["floor"] = W.FLOOR
            if layer_weights is not None:
                extra["layer_weights"] = layer_weights.fingerprint
        full = {"format": FORMAT, "version": 3 if grouped else 2 if weighted else 1, **meta, **extra,
                "n_layers": self.n_layers,
                "joint_heads": self.joint_heads, "center": self.center,
                "calibration": {**meta.get("calibration", {}), "documents": self.documents, "tokens": self.tokens,
                                "ids_sha256": self.digest.hexdigest()}}
        return Regenerator(full, tensors)


def _group_weights(variances: torch.Tensor, g: int, inside: torch.Tensor | None = None,
                   across: torch.Tensor | None = None) -> torch.Tensor:
    """[B, D] float64 weights of a group's features (D = g layers' dims; ``variances`` [B, D] their
    calibration variances): 1 / each layer's mean calibration variance, so every layer's relative error
    counts alike; times ``inside`` [B, D] (each layer's attention weights, mean 1 in the layer) and
    ``across`` [g] (each layer's weight) when given."""
    B, D = variances.shape
    per_layer = variances.clamp_min(0).reshape(B, g, D // g).mean(dim=2, keepdim=True).clamp_min(1e-12)
    w = 1.0 / per_layer
    if across is not None:
        w = w * across.double().to(w.device).reshape(1, g, 1)
    w = w.expand(B, g, D // g).reshape(B, D)
    return w * inside.double() if inside is not None else w


HALF_TOP = 2.0 ** 14     # the largest weight a grouped regenerator stores (fp16 holds up to 65,504)


def _in_half(weights: dict) -> dict:
    """Every group's and side's weights as a state stores them (fp16), all scaled by one power of two
    when the largest would pass ``HALF_TOP``: one state-wide budget compares them, so only their ratios
    count, and a model whose KV varies little would overflow fp16 with 1 / its variance."""
    top = max(float(w.max()) for w in weights.values())
    scale = 2.0 ** -max(0, math.ceil(math.log2(top / HALF_TOP))) if top > 0 else 1.0
    tiny = torch.finfo(torch.float16).tiny
    return {key: (w * scale).to(torch.float16).clamp_min(tiny).double() for key, w in weights.items()}


@dataclass
class Regenerator:
    """Calibrated per-layer bases of one model. ``meta`` holds at least ``model_fingerprint`` (the
    combined fingerprint of the model it was fitted on), ``n_layers``, ``joint_heads``, ``center``."""

    meta: dict
    tensors: dict[str, torch.Tensor]
    _fingerprint: str | None = field(default=None, repr=False)
    # how states coded against it pick each side's basis: kite.upcycle.codec.fit_layer's ``choice``
    # ("expected", "measured"; None: its default) or "probe" (measured by the attention probe,
    # kite.upcycle.codec.probe, which the compressor builds). A setting of the coder, not saved.
    choice: str | None = field(default=None, compare=False)
    _on_device: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = _fingerprint(_tensor_bytes(self.tensors), self.meta)
        return self._fingerprint

    @property
    def joint_heads(self) -> bool:
        return bool(self.meta["joint_heads"])

    @property
    def layer_groups(self) -> list[tuple[int, int]]:
        """[start, stop) of each group of layers a basis spans (one per layer unless grouped)."""
        groups = self.meta.get("layer_groups")
        if groups is None:
            return [(layer, layer + 1) for layer in range(int(self.meta["n_layers"]))]
        return [(int(a), int(b)) for a, b in groups]

    @property
    def grouped(self) -> bool:
        """Whether its bases span groups of layers (states coded on it: kite.upcycle.codec.groups)."""
        return "layer_groups" in self.meta

    def side(self, layer: int, side: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean [B, D], variances [B, D] descending, basis [B, D, D], column j = component j)."""
        p = f"L{layer}.{side}"
        try:
            return self.tensors[f"{p}.mean"], self.tensors[f"{p}.evals"], self.tensors[f"{p}.basis"]
        except KeyError:
            raise BadInput(f"regenerator {short(self.fingerprint)} has no layer {layer} "
                           f"(it has {self.meta.get('n_layers')})") from None

    def bases(self, side: str, device) -> torch.Tensor:
        """Every layer's basis of ``side`` stacked, [L, B, D, D] float32 on ``device`` (kept there: a
        training run codes many states on it)."""
        self._per_layer("the batched encoder")
        key = (side, str(device))
        if key not in self._on_device:
            L = int(self.meta["n_layers"])
            self._on_device[key] = torch.stack([self.side(layer, side)[2] for layer in range(L)]).to(device,
                                                                                                   torch.float32)
        return self._on_device[key]

    def _per_layer(self, what: str) -> None:
        if self.grouped:
            raise ValueError(f"regenerator {short(self.fingerprint)} has bases across layers; {what} takes "
                             f"per-layer bases (kite.upcycle.codec.groups codes on these)")

    def basis_on(self, layer: int, side: str, device) -> torch.Tensor:
        """The basis of ``layer`` (a grouped one's: of the group starting there) as float32 on
        ``device``, kept there when that is a GPU (a training run codes and loads many states on
        it; on the host the float32 copy is made each time, not kept beside the stored one)."""
        if torch.device(device).type == "cpu":
            return self.side(layer, side)[2].float()
        key = (layer, side, str(device))
        if key not in self._on_device:
            self._on_device[key] = self.side(layer, side)[2].to(device, torch.float32)
        return self._on_device[key]

    @property
    def weighted(self) -> bool:
        """Whether its bases are attention-weighted (version 2); a grouped one's weights scale layers."""
        return "L0.k.weight" in self.tensors and not self.grouped

    def weights(self, layer: int) -> dict[str, torch.Tensor] | None:
        """A weighted regenerator's distortion weights of ``layer``: ``{"k": [B, D], "v": [B, D]}``
        (what :func:`kite.upcycle.codec.fit_layer` takes); a grouped one's layer scales of the group
        starting at ``layer``; None for an unweighted one."""
        if not self.weighted and not self.grouped:
            return None
        self.side(layer, "k")      # BadInput naming the layer when it has none
        return {side: self.tensors[f"L{layer}.{side}.weight"] for side in ("k", "v")}

    def layer(self, layer: int, metric=None) -> dict:
        """What :func:`kite.upcycle.codec.fit_layer` takes for ``layer``: ``regenerator=`` (each
        side's mean, variances, basis), ``weights=`` (None when unweighted), ``choice=`` and
        ``metric=`` (the attention probe's for this layer when :attr:`choice` is ``"probe"``)."""
        self._per_layer("the per-layer codec")
        if self.choice == "probe" and metric is None:
            raise ValueError("choice 'probe' needs the attention probe's metric for the layer")
        return {"regenerator": {side: self.side(layer, side) for side in ("k", "v")}, "weights": self.weights(layer),
                "choice": "measured" if self.choice == "probe" else self.choice,
                "metric": metric if self.choice == "probe" else None}

    def check_model(self, lm: LoadedModel) -> None:
        """Refuse a model other than the one this regenerator was fitted on (invariant 3): its weights
        and tokenizer (``model_fingerprint`` is their combined fingerprint without an adapter; a reader
        adapter does not change the KV a document is captured with)."""
        want = self.meta.get("model_fingerprint")
        have = lm.fingerprints.base
        if want != have:
            made_for, loaded = apart(want, have)
            raise FingerprintMismatch(
                f"regenerator {short(self.fingerprint)} was made for model {made_for}, not the loaded "
                f"model {loaded}; run `kite upcycle train` for this model, or migrate the regenerator with "
                f"the states")

    def save(self, folder: str | Path) -> Path:
        """Write ``regenerator.safetensors`` + ``regenerator.json`` into ``folder`` (each atomically)."""
        from kite.atomic import write_bytes, write_text

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        data = _tensor_bytes(self.tensors)
        write_bytes(folder / TENSORS, data)
        write_text(folder / META, json.dumps({**self.meta, "fingerprint": _fingerprint(data, self.meta)}, indent=1,
                                             sort_keys=True) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> "Regenerator":
        """Read a regenerator folder. BadInput when a file is missing, damaged or from another version."""
        from safetensors.torch import load

        folder = Path(folder)
        try:
            data = (folder / TENSORS).read_bytes()
            raw = json.loads((folder / META).read_text())
        except FileNotFoundError as exc:
            raise BadInput(f"{folder}: not a regenerator ({Path(exc.filename).name} is missing; "
                           f"`kite upcycle train` makes one)") from None
        except (OSError, ValueError) as exc:
            raise BadInput(f"{folder}: damaged regenerator ({exc})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise BadInput(f"{folder / META}: not a regenerator's metadata")
        if int(raw.get("version", 0)) > VERSION:
            raise BadInput(f"{folder}: regenerator format {raw.get('version')} is newer than this KITE reads; upgrade")
        stored = raw.pop("fingerprint", None)
        try:
            tensors = load(data)
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types on damaged files
            raise BadInput(f"{folder / TENSORS}: damaged ({exc})") from None
        fp = _fingerprint(data, raw)
        if stored is not None and stored != fp:
            recorded, now = apart(stored, fp)
            raise BadInput(f"{folder}: the regenerator's files do not match its recorded fingerprint "
                           f"{recorded} (now {now}): damaged or edited")
        return cls(raw, tensors, fp)


def _tensor_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({k: tensors[k].contiguous() for k in sorted(tensors)})


def _fingerprint(data: bytes, meta: dict) -> str:
    h = hashlib.sha256(data)
    h.update(json.dumps({k: v for k, v in meta.items() if k != "fingerprint"}, sort_keys=True).encode())
    return PREFIX + h.hexdigest()


def regenerators_dir() -> Path:
    """Where regenerators are kept by fingerprint, for states to find theirs: ``$KITE_HOME/regenerators``."""
    from kite.paths import kite_home

    return kite_home() / "regenerators"


def install(reg: Regenerator) -> Path:
    """Keep a copy under :func:`regenerators_dir` (named by its short fingerprint), so every load of a
    state made with it finds it; returns the folder."""
    folder = regenerators_dir() / short(reg.fingerprint)
    if not (folder / META).exists():
        reg.save(folder)
    return folder


_LOADED: dict[str, Regenerator] = {}


def resolve(fingerprint: str, given: Regenerator | None = None) -> Regenerator:
    """The regenerator a state was made with: ``given`` when it is that one, else the copy kept
    under :func:`regenerators_dir`. FingerprintMismatch naming the fingerprint when neither is."""
    if given is not None and given.fingerprint == fingerprint:
        return given
    if fingerprint in _LOADED:
        return _LOADED[fingerprint]
    folder = regenerators_dir() / short(fingerprint)
    if (folder / META).exists():
        reg = Regenerator.load(folder)
        if reg.fingerprint == fingerprint:
            _LOADED[fingerprint] = reg
            return reg
    hint = f" (the one given is {short(given.fingerprint)})" if given is not None else ""
    raise FingerprintMismatch(
        f"this state was encoded against regenerator {short(fingerprint)}, which is not here{hint}; pass its "
        f"folder (--regenerator DIR, or regenerator: in upcycle_config.yaml) or keep a copy in {folder}")
