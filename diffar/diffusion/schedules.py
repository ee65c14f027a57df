"""Noise schedules for Gaussian diffusion in continuous time t in [0, 1]: alpha_bar(t) falls from ~1 (clean)
to ~0 (pure noise), and the forward process is q(z_t | z_0) = N(sqrt(alpha_bar) z_0, (1 - alpha_bar) I).

- linear: the continuous limit of DDPM's linear betas (the VP SDE of Song et al. 2021, arXiv 2011.13456).
- cosine: Nichol & Dhariwal 2021 (arXiv 2102.09672).
- learned: a monotone log-SNR curve between fixed end points whose shape is a parameter trained with the
  model (the end points stay fixed so the loss cannot make every step easy; cf. VDM, arXiv 2107.00630).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from diffar.errors import DiffarError

KINDS = ("linear", "cosine", "learned")
ALPHA_BAR_RANGE = (1e-5, 1 - 1e-5)  # keeps sqrt(alpha_bar) and sqrt(1 - alpha_bar) away from 0


class NoiseSchedule(nn.Module):
    def __init__(self, kind: str = "cosine", beta_min: float = 0.1, beta_max: float = 20.0, cosine_s: float = 0.008,
                 logsnr_range: tuple[float, float] = (-10.0, 10.0), bins: int = 16):
        super().__init__()
        if kind not in KINDS:
            raise DiffarError(f"unknown noise schedule {kind!r}; choose one of {', '.join(KINDS)}")
        self.kind, self.beta_min, self.beta_max, self.cosine_s = kind, beta_min, beta_max, cosine_s
        self.logsnr_min, self.logsnr_max = logsnr_range
        if kind == "learned":  # equal softplus increments: a straight log-SNR line at initialisation
            self.increments = nn.Parameter(torch.full((bins,), math.log(math.e - 1)))

    def alpha_bar(self, t: torch.Tensor) -> torch.Tensor:
        """alpha_bar at times t (any shape, values in [0, 1]), monotonically decreasing in t."""
        t = t.float()
        if self.kind == "linear":
            a = torch.exp(-(self.beta_min * t + 0.5 * (self.beta_max - self.beta_min) * t * t))
        elif self.kind == "cosine":
            s = self.cosine_s
            a = torch.cos((t + s) / (1 + s) * math.pi / 2) ** 2 / math.cos(s / (1 + s) * math.pi / 2) ** 2
        else:
            a = torch.sigmoid(self.logsnr(t))
        return a.clamp(*ALPHA_BAR_RANGE)

    def logsnr(self, t: torch.Tensor) -> torch.Tensor:
        """The learned schedule's log(alpha_bar / (1 - alpha_bar)): piecewise linear, decreasing."""
        steps = F.softplus(self.increments)
        knots = torch.cat([steps.new_zeros(1), steps.cumsum(0) / steps.sum()])  # 0 .. 1, increasing
        x = t.clamp(0, 1) * (len(knots) - 1)
        i = x.floor().long().clamp(max=len(knots) - 2)
        frac = knots[i] + (x - i) * (knots[i + 1] - knots[i])
        return self.logsnr_max - (self.logsnr_max - self.logsnr_min) * frac

    def q_sample(self, z0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """z_t = sqrt(alpha_bar) z0 + sqrt(1 - alpha_bar) noise; t broadcasts over z0's leading dims."""
        a = self.alpha_bar(t).view(*t.shape, *([1] * (z0.dim() - t.dim()))).to(z0.dtype)
        return a.sqrt() * z0 + (1 - a).sqrt() * noise
