"""One layer of a state resident in coded form: the data the coded attention reads
(kite.kernels.coded_attention has the reference and the description; coded_attention_triton the GPU
kernel). Its own module so that both import it and neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TILE = 32          # rows per tile of the resident form (a tile never straddles a quantization group)


@dataclass
class CodedLayer:
    """One layer of one resident state (see the module docstring). Shapes: Tp rows (a multiple of
    TILE), H KV heads of d dims, Hb = 1 (joint-head basis) or H (a basis per head), Rk / Rv code
    columns per basis block, G quantization groups."""

    pos: torch.Tensor          # int32 [Tp]: absolute position of each row, -1 = not attended
    tile_group: torch.Tensor   # int32 [Tp // TILE]: the group row of each tile's scales
    k_codes: torch.Tensor      # uint8 [Tp, Hb * Rk]
    k_scale: torch.Tensor      # float32 [G, Hb * Rk]
    k_min: torch.Tensor        # float32 [G, Hb * Rk]
    v_codes: torch.Tensor      # uint8 [Tp, Hb * Rv]
    v_scale: torch.Tensor
    v_min: torch.Tensor
    k_basis: torch.Tensor      # [H, Rk, d] (head h's slice of the joint basis, or its own)
    v_basis: torch.Tensor      # [H, Rv, d]
    k_mean: torch.Tensor       # float32 [G, H, d]: the mean plus the group's uncoded (0-bit) columns
    v_mean: torch.Tensor       # float32 [G, H, d]
    raw_k: torch.Tensor        # [H, S, d] rows kept exactly, keys post-RoPE
    raw_v: torch.Tensor        # [H, S, d]
    joint: bool

    @property
    def rows(self) -> int:
        return int(self.pos.numel())

    @property
    def nbytes(self) -> int:
        """Bytes this layer occupies on its device (every tensor counted)."""
        return sum(t.numel() * t.element_size() for t in (
            self.pos, self.tile_group, self.k_codes, self.k_scale, self.k_min, self.v_codes, self.v_scale,
            self.v_min, self.k_basis, self.v_basis, self.k_mean, self.v_mean, self.raw_k, self.raw_v))

    @property
    def stream_bytes(self) -> int:
        """Bytes one decode step must read per sequence (codes, positions, tile groups): the
        per-token part of the form; bases, means and scale tables are small and shared by a step."""
        return sum(t.numel() * t.element_size() for t in (self.pos, self.tile_group, self.k_codes, self.v_codes))
