"""One layer of a state resident in coded form: the data the coded attention reads
(kite.kernels.coded_attention has the reference and the description; coded_attention_triton the GPU
kernel). Its own module so that both import it and neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TILE = 32          # rows per tile of the resident form (a tile never straddles a quantization group)


# The forms of a resident state's key codes: "rebuild" (pre-RoPE keys, rebuilt and rotated per
# tile) or "coef" (post-RoPE keys, scored in coefficient space; kite.kernels.coded_attention).
KEYS = ("rebuild", "coef")


def check_keys(keys: str) -> str:
    """``keys`` if it names a form of the coded keys (KEYS), else ValueError."""
    if keys not in KEYS:
        raise ValueError(f"keys must be one of {', '.join(KEYS)}, not {keys!r}")
    return keys


@dataclass
class CodedLayer:
    """One layer of one resident state (see the module docstring). Shapes: Tp rows (a multiple of
    TILE), H KV heads of d dims, Hb = 1 (joint-head basis) or H (a basis per head), Rk / Rv code
    columns per basis block, G quantization groups.

    Nibble-packed sides (``k_nib`` / ``v_nib`` not None; per-head bases only): each basis block's
    columns are ordered [Nb low-nibble columns | Nb high-nibble columns | W byte columns] (R = 2 Nb +
    W); byte j of a block's Nb bytes holds column j in its low 4 bits and column Nb + j in its high 4,
    so columns coded at <= 4 bits cost half a byte; ``k_codes`` / ``v_codes`` then hold the W byte
    columns only ([Tp, Hb * W]). Scales, minima and the basis keep all R columns in that order."""

    pos: torch.Tensor          # int32 [Tp]: absolute position of each row, -1 = not attended
    tile_group: torch.Tensor   # int32 [Tp // TILE]: the group row of each tile's scales
    k_codes: torch.Tensor      # uint8 [Tp, Hb * Rk] (nibble-packed: [Tp, Hb * Wk])
    k_scale: torch.Tensor      # float32 [G, Hb * Rk]
    k_min: torch.Tensor        # float32 [G, Hb * Rk]
    v_codes: torch.Tensor      # uint8 [Tp, Hb * Rv] (nibble-packed: [Tp, Hb * Wv])
    v_scale: torch.Tensor
    v_min: torch.Tensor
    k_basis: torch.Tensor      # [H, Rk, d] (head h's slice of the joint basis, or its own)
    v_basis: torch.Tensor      # [H, Rv, d]
    k_mean: torch.Tensor       # float32 [G, H, d]: the mean plus the group's uncoded (0-bit) columns
    v_mean: torch.Tensor       # float32 [G, H, d]
    raw_k: torch.Tensor        # [H, S, d] rows kept exactly, keys post-RoPE
    raw_v: torch.Tensor        # [H, S, d]
    joint: bool
    k_nib: torch.Tensor | None = None   # uint8 [Tp, Hb * Nbk]: two <= 4-bit codes a byte
    v_nib: torch.Tensor | None = None   # uint8 [Tp, Hb * Nbv]

    @property
    def rows(self) -> int:
        return int(self.pos.numel())

    def nib_bytes(self, side: str) -> int:
        """Nibble bytes per row and basis block of a side (0 where the side is not nibble-packed)."""
        nib = self.k_nib if side == "k" else self.v_nib
        if nib is None:
            return 0
        blocks = 1 if self.joint else self.k_mean.shape[1]
        return nib.shape[1] // blocks

    def codes(self, side: str) -> torch.Tensor:
        """The side's codes unpacked to one byte each, columns in the basis' order: uint8 [Tp, Hb * R]."""
        codes, nib = (self.k_codes, self.k_nib) if side == "k" else (self.v_codes, self.v_nib)
        if nib is None:
            return codes
        blocks = 1 if self.joint else self.k_mean.shape[1]
        Tp = codes.shape[0]
        lo, hi = (nib & 15).view(Tp, blocks, -1), (nib >> 4).view(Tp, blocks, -1)
        return torch.cat((lo, hi, codes.view(Tp, blocks, -1)), dim=2).reshape(Tp, -1)

    def _tensors(self) -> tuple:
        return tuple(t for t in (self.k_nib, self.v_nib) if t is not None)

    @property
    def nbytes(self) -> int:
        """Bytes this layer occupies on its device (every tensor counted)."""
        return sum(t.numel() * t.element_size() for t in (
            self.pos, self.tile_group, self.k_codes, self.k_scale, self.k_min, self.v_codes, self.v_scale,
            self.v_min, self.k_basis, self.v_basis, self.k_mean, self.v_mean, self.raw_k, self.raw_v) + self._tensors())

    @property
    def stream_bytes(self) -> int:
        """Bytes one decode step must read per sequence (codes, positions, tile groups): the
        per-token part of the form; bases, means and scale tables are small and shared by a step."""
        return sum(t.numel() * t.element_size()
                   for t in (self.pos, self.tile_group, self.k_codes, self.v_codes) + self._tensors())
