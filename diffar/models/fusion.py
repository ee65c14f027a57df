"""Cross-attention between the two streams of ReFusion: queries from one stream read the other stream's
states, and a tanh gate scales what is added to the residual (as Flamingo's gated cross-attention,
arXiv 2204.14198). A gate of 0 makes the layer an exact identity."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffar.models.transformer import RMSNorm


class CrossAttentionFusion(nn.Module):
    def __init__(self, d_query: int, d_context: int, n_head: int, gate_init: float = 0.0, eps: float = 1e-5):
        super().__init__()
        if d_query % n_head:
            raise ValueError(f"fusion width {d_query} does not split into {n_head} heads")
        self.n_head = n_head
        self.norm_q, self.norm_kv = RMSNorm(d_query, eps), RMSNorm(d_context, eps)
        self.q = nn.Linear(d_query, d_query, bias=False)
        self.kv = nn.Linear(d_context, 2 * d_query, bias=False)
        self.proj = nn.Linear(d_query, d_query, bias=False)
        self.gate = nn.Parameter(torch.tensor(float(gate_init)))

    def keys_values(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """context (N, S, d_context) -> keys and values (N, H, S, d_query / H); a decoder may cache them."""
        N, S, _ = context.shape
        H = self.n_head
        return self.kv(self.norm_kv(context)).view(N, S, 2, H, -1).permute(2, 0, 3, 1, 4).unbind(0)

    def forward(self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """x (N, T, d_query) attends to the context's `keys_values` where mask (N, 1, T or 1, S) is True.
        Every query needs at least one visible context position."""
        N, T, C = x.shape
        q = self.q(self.norm_q(x)).view(N, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, *kv, attn_mask=mask)
        return x + torch.tanh(self.gate) * self.proj(y.transpose(1, 2).reshape(N, T, C))
