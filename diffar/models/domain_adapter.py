"""A domain adapter for the diffusion stream (the ReFusion seed's "lightweight adaptation layer for specialist
domains", `seeds/refusion.zh.txt`): one learned embedding per domain, mixed into the hidden states by a gate the
states themselves set,

    gate = sigmoid(W h + b),    h' = gate * e_domain + (1 - gate) * h,

per position and channel. It starts nearly closed (b = -4: gate ~ 0.02, e = 0), so a stream gains one without
changing what it drafts. One stream with an adapter serves several domains; which one is told per row.
"""

from __future__ import annotations

import torch
from torch import nn

GATE_BIAS = -4.0


class DomainAdapter(nn.Module):
    def __init__(self, n_domains: int, d_model: int):
        super().__init__()
        self.embedding = nn.Embedding(n_domains, d_model)
        self.gate = nn.Linear(d_model, d_model)
        nn.init.zeros_(self.embedding.weight)
        nn.init.constant_(self.gate.bias, GATE_BIAS)

    def forward(self, h: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
        """h (N, L, d) hidden states, domain (N,) each row's domain index -> the adapted states (N, L, d)."""
        gate = torch.sigmoid(self.gate(h))
        return gate * self.embedding(domain).unsqueeze(1).to(h.dtype) + (1 - gate) * h
