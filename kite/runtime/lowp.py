"""Low-precision matmuls for throughput passes that tolerate them (the analyze entropy pass).

`bf16_linears(model)` runs every `nn.Linear` of a model on a bf16 copy of its weights: the input
is cast to bf16, the output back to the input's dtype, so everything between the matmuls (the
residual stream, norms, softmax) stays in the model's own precision. Against `torch.autocast`
this casts each weight once, not on every call (autocast re-casts fp32 weights per forward),
which is where autocast loses most of bf16's speed on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class BF16Linear(torch.nn.Module):
    """A Linear on bf16 weights that keeps its caller's dtype at the boundary."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = torch.nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = (None if linear.bias is None
                     else torch.nn.Parameter(linear.bias.detach().to(torch.bfloat16), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)


def _parent(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    owner, _, attr = name.rpartition(".")
    return (model.get_submodule(owner) if owner else model), attr


@contextmanager
def bf16_linears(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Swap `model`'s Linear layers for :class:`BF16Linear` copies; put the originals back on exit
    (also on an exception). The model is not safe to share with other threads meanwhile."""
    originals = {name: mod for name, mod in model.named_modules() if type(mod) is torch.nn.Linear}
    try:
        for name, mod in originals.items():
            parent, attr = _parent(model, name)
            setattr(parent, attr, BF16Linear(mod))
        yield model
    finally:
        for name, mod in originals.items():
            parent, attr = _parent(model, name)
            setattr(parent, attr, mod)
