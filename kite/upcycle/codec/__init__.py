"""The KV-cache codec of a `.upc` state (KVTC-style PCA + per-component bit allocation, plain
quantization, raw casts): settings and presets, the side coders registered per mode, the per-layer
codec (CPU) and the batched encoder (any device, the GPU's), the bit allocation over a whole state's
byte budget both share (``fit_state``, :mod:`.state_bits`), and the quantizer under them; the
regenerator (per-model calibrated bases a state may be coded on; over groups of layers, the states
of :mod:`.groups`), the attention-aware distortion weights and the attention probe that choose between bases. Loads read the regenerator from here;
`kite upcycle train` (kite.upcycle.train) fits it. And the nibble-lanes encoder (`encode_lanes`,
`lanes_nbytes`, `LANE_CLIPS`: a loaded state coded again into the form the lanes decode kernel reads,
kite.kernels.lanes)."""

from kite.upcycle.codec.batched import EncodedState, encode_state
from kite.upcycle.codec.batched import supports as supports_batched
from kite.upcycle.codec.batched_regen import takes as batched_takes_regenerator
from kite.upcycle.codec.layer_weights import LayerWeights, shipped_for
from kite.upcycle.codec.bits import (allocate_bits, allocate_bits_batched, expected_error, first_bit_cost,
                                    layer_budget_bits)
from kite.upcycle.codec.blob import Blob, EncodedPart, LayerCodec, from_bytes, nbytes, to_bytes, to_bytes_many
from kite.upcycle.codec.coders import (CODERS, PcaSide, QuantSide, RawSide, RegenSide, SideCoder, attach_regenerator,
                                      blocks, coder, register)
from kite.upcycle.codec.lanes import CLIPS as LANE_CLIPS
from kite.upcycle.codec.lanes import encode_layers as encode_lanes
from kite.upcycle.codec.lanes import nbytes_for as lanes_nbytes
from kite.upcycle.codec.layer import (batched_pca, decode, encode, fit_layer, fit_layers, fit_state, state_budgeted,
                                     weighted_error)
from kite.upcycle.codec.quant import FLOAT_FORMATS, INT_FORMATS, QTensor, dequantize, quantize, tensors_nbytes
from kite.upcycle.codec.part_widths import part_widths
from kite.upcycle.codec.probe import ROWS as PROBE_ROWS
from kite.upcycle.codec.probe import AttentionProbe
from kite.upcycle.codec.regenerator import Regenerator, RegeneratorFit
from kite.upcycle.codec.settings import PRESETS, CodecSettings, at_ratio, ratio_of, settings_for
from kite.upcycle.codec.state_bits import within_budget
from kite.upcycle.codec.weights import model_value_weights

__all__ = ["CODERS", "FLOAT_FORMATS", "INT_FORMATS", "LANE_CLIPS", "PRESETS", "PROBE_ROWS", "AttentionProbe", "Blob", "CodecSettings",
           "EncodedPart", "EncodedState", "LayerCodec", "LayerWeights", "shipped_for", "PcaSide", "QTensor", "QuantSide", "RawSide", "RegenSide",
           "Regenerator", "RegeneratorFit", "SideCoder", "allocate_bits", "allocate_bits_batched", "at_ratio",
           "attach_regenerator", "batched_pca", "blocks", "coder", "decode", "dequantize", "encode", "encode_lanes",
           "encode_state", "expected_error", "first_bit_cost", "fit_layer", "fit_layers", "fit_state", "from_bytes", "lanes_nbytes",
           "layer_budget_bits", "model_value_weights", "nbytes", "part_widths", "quantize", "ratio_of", "register",
           "settings_for", "state_budgeted", "supports_batched", "batched_takes_regenerator", "tensors_nbytes", "to_bytes", "to_bytes_many", "weighted_error",
           "within_budget"]
