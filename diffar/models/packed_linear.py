"""Linear layers with their weights prepacked for oneDNN, for CPU inference.

A decoding step multiplies a handful of rows (the batch) by every weight matrix. Through `F.linear` each call
re-lays the weight out for the matrix unit (and in bf16 takes a path built for large inputs); packing once at
load makes those calls about twice as fast in bf16 on CPUs with AVX-512/AMX, with the same results (measured
on SmolLM2-135M: docs/benchmarks.md). Inference only: the packed product has no gradient.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and (weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()))


class PackedLinear(nn.Module):
    """`nn.Linear` (no bias) whose forward reads a oneDNN-packed copy of the weight; `weight` stays the
    original parameter, so ties, state dicts and weight readers see what they saw before."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 1):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def pack_linears(model: nn.Module) -> nn.Module:
    """Swap every bias-free CPU `nn.Linear` of an inference model for a `PackedLinear`, in place."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Linear and child.bias is None and can_pack(child.weight):
                setattr(parent, name, PackedLinear(child))
    return model
