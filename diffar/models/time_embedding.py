"""The diffusion time as network input."""

from __future__ import annotations

import math

import torch


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of t in [0, 1] (..., dim), as DDPM's time embedding (on t * 1000)."""
    freqs = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, device=t.device) / (dim // 2))
    angles = (1000.0 * t.float()).unsqueeze(-1) * freqs
    return torch.cat([angles.cos(), angles.sin()], dim=-1)
