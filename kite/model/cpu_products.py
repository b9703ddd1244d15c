"""A CPU model's products of a few rows (a decode step: one row a sequence; a short prompt: one row a
token) near the speed of its memory.

A decode step multiplies each weight by one row a sequence. torch's ``linear`` sends one row to a
matrix-vector product that ran on one core of the 2-core dev CPU, and a few rows to a matrix product
tuned for many: the embedded model's projections of one row read their weights at ~21 GB/s, of
eight rows at ~16 GB/s. So :func:`install_cpu_products` gives every plain fp32 ``nn.Linear`` of a CPU
model a forward that, without autograd, takes :func:`small_rows_product`:

* the native runtime's ``kite_rows_product`` where it is built, for up to :data:`NATIVE_ROWS` rows:
  each pair of weight rows read once and summed against every block of 8 rows while it is in the
  core's cache, the next pair prefetched (~32-36 GB/s of weights for one to eight rows on the dev
  CPU's two cores); a row's sums do not depend on the rows beside it, so a batch decodes what each
  sequence decodes alone. A short prompt's forward takes it too: on the dev CPU the embedded model's
  forward of 12 / 25 / 45 / 100 / 160 tokens took 1.78 / 1.64 / 1.43 / 1.28 / 1.18x less time than
  through ``linear`` (BLAS's product of many rows), and the same at 256
  (benchmarks/results/cpu_products_cpu2_20261205_7399b56.json);
* else, for up to :data:`SMALL_ROWS` rows, BLAS the other way round, the weight times the rows
  transposed (~40 GB/s for two to four rows, ~25-30 GB/s for five or six; up to :data:`ONE_PRODUCT`
  rows in one product, more in two; one row sent as two).

Longer inputs (a long prompt's prefill), training and other dtypes keep ``linear``. The decode step
and a prompt's forward, side by side: `benchmarks/cpu_products.py` (docs/PERFORMANCE.md, "Continuous
batching").
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from kite.kernels import native

SMALL_ROWS = 8   # inputs of at most this many rows take the transposed product
NATIVE_ROWS = 192  # ... or, where the native runtime is built, its product (BLAS is as fast from ~256)
ONE_PRODUCT = 6  # rows one product takes; 7 or 8 go as two halves (one product of them ran slower)
ENABLED = True   # False: every product is torch's linear (side-by-side benchmarks)
NATIVE = True    # False: BLAS's transposed product even where the native runtime is built (benchmarks)


_VECTOR_PATH: dict[int, bool] = {}   # per loaded library: whether it was built with a vector path


def _runtime():
    """The native runtime when it is built with a vector path for these products, else None (asked of
    each library once: every projection of every step asks)."""
    if not NATIVE:
        return None
    lib = native.cpu()
    if lib is None:
        return None
    vector = _VECTOR_PATH.get(id(lib))
    if vector is None:
        vector = _VECTOR_PATH[id(lib)] = lib.kite_rows_product_width() > 0
    return lib if vector else None


def native_available() -> bool:
    """Whether the products run through the native runtime here (built, with a vector path, not
    switched off by :data:`NATIVE` or ``KITE_RUNTIME=torch``)."""
    return _runtime() is not None


def small_rows_product(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [..., in]: the native runtime's product where it is built
    (any number of rows; :func:`install_cpu_products`'s forward sends it up to NATIVE_ROWS), else, for
    at most SMALL_ROWS rows, the weight times the rows transposed, in one product of up to ONE_PRODUCT
    rows or two halves; a single row is sent as two (one column took the matrix-vector kernel again)."""
    lib = _native_for(weight, bias)
    return _native_product(lib, weight, bias, x) if lib is not None else _transposed_product(weight, bias, x)


def _native_for(weight: torch.Tensor, bias: torch.Tensor | None):
    """The native runtime where it is built and takes this weight and bias as they are laid out."""
    lib = _runtime()
    return lib if lib is not None and weight.stride(-1) == 1 and (bias is None or bias.is_contiguous()) else None


def _native_product(lib, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    n = rows.shape[0]
    out = torch.empty(n, weight.shape[0], dtype=torch.float32)
    native.check(lib.kite_rows_product(weight.data_ptr(), weight.stride(0), rows.data_ptr(), rows.stride(0),
                                       None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
                                       n, weight.shape[0], weight.shape[1], torch.get_num_threads()),
                 "rows_product")
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _transposed_product(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    # the product's [out, n] back to [n, out] as a copy (n · out floats beside the weight it read): a
    # transposed view sent the attention after the projections to torch's slowest kernel (the query's
    # last dimension not contiguous) and slowed the elementwise work between them
    if n == 1:
        out = (weight @ torch.cat([rows, rows]).T)[:, :1].T.contiguous()   # (a broadcast view took the slow kernel too)
    elif n <= ONE_PRODUCT:
        out = (weight @ rows.T).T.contiguous()
    else:
        half = (n + 1) // 2
        out = torch.cat([(weight @ rows[:half].T).T, (weight @ rows[half:].T).T])
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
    if ENABLED and not grad and x.dtype == torch.float32 and x.device.type == "cpu":
        # the runtime looked up once a projection (every projection of every step comes here)
        lib = _native_for(self.weight, self.bias)
        if lib is not None and x.numel() <= NATIVE_ROWS * x.shape[-1]:
            return _native_product(lib, self.weight, self.bias, x)
        if lib is None and x.numel() <= SMALL_ROWS * x.shape[-1]:
            return _transposed_product(self.weight, self.bias, x)
    return F.linear(x, self.weight, self.bias)


def install_cpu_products(model: nn.Module) -> int:
    """Give each plain fp32 ``nn.Linear`` of ``model`` on the CPU the small-rows forward (idempotent);
    the number of layers that have it. Subclasses (an adapter's wrapped layers) keep theirs: the base
    layer inside them gets it."""
    done = 0
    for module in model.modules():
        if type(module) is not nn.Linear or module.weight.device.type != "cpu" or module.weight.dtype != torch.float32:
            continue
        if not getattr(module, "_kite_small_rows", False):
            module.forward = types.MethodType(_forward, module)
            module._kite_small_rows = True
        done += 1
    return done
