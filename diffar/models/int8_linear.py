"""Weight-only int8 linear layers for CPU inference: int8 weights with one scale per output channel, bf16
activations, multiplied by PyTorch's int8-weight kernel (`_weight_int8pack_mm`, the one gpt-fast's int8 mode
uses). Half the weight bytes of bf16 and no activation quantisation, so the text barely moves. Dynamic int8
(`torch.ao` `quantize_dynamic`, activations quantised too) was faster at batch 1 but raised SmolLM2-135M's
perplexity 3.4x (activation outliers): docs/benchmarks.md."""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    """A bias-free `nn.Linear` stored as int8 rows times per-row scales (symmetric, absmax / 127)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-12) / 127
        self.register_buffer("weight_int8", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features).to(torch.bfloat16), self.weight_int8,
                                               self.scale)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


def int8_linears(model: nn.Module) -> nn.Module:
    """Swap every bias-free `nn.Linear` of an inference model for an `Int8Linear`, in place."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Linear and child.bias is None:
                setattr(parent, name, Int8Linear(child))
    return model
