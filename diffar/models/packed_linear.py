"""Linear layers with their weights prepacked for oneDNN, for CPU inference.

A decoding step multiplies a handful of rows (the batch, or a block being verified) by every weight matrix.
Through `F.linear` each call re-lays the weight out for the matrix unit (and in bf16 takes a path built for
large inputs); packing once at load makes those calls faster in bf16 and in fp32 on CPUs with AVX-512/AMX, with
results equal to rounding (measured on SmolLM2-135M and the 7M models: docs/benchmarks.md). Inference only:
the packed product has no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and (weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1) if can_pack(weight) else None


class PackedLinear(nn.Module):
    """`nn.Linear` (no bias) whose forward reads a oneDNN-packed copy of the weight; `weight` stays the
    original parameter, so ties, state dicts and weight readers see what they saw before. Moved or cast
    (`.to`), it packs the weight again, or, where it cannot be packed (a GPU, fp16), multiplies by it plainly."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_buffer("packed", _pack(self.weight), persistent=False)

    def _apply(self, fn, recurse=True):
        del self._buffers["packed"]  # a oneDNN tensor cannot be moved or cast: it is made again from the weight
        super()._apply(fn, recurse)
        self.register_buffer("packed", _pack(self.weight), persistent=False)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def pack_linears(model: nn.Module) -> nn.Module:
    """Swap every bias-free CPU `nn.Linear` of an inference model for a `PackedLinear`, in place."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Linear and child.bias is None and can_pack(child.weight):
                setattr(parent, name, PackedLinear(child))
    return model
