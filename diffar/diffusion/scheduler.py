"""Samplers hold no weights: `set_timesteps(n)` picks the times, `step(...)` moves a sample one of them
towards t = 0 given the network's prediction (the diffusers interface)."""

from __future__ import annotations

import torch

from diffar.diffusion.schedules import NoiseSchedule
from diffar.errors import DiffarError


class DDIMScheduler:
    """Deterministic DDIM (eta = 0; Song et al. 2021, arXiv 2010.02502) driven by an x0 prediction.

    n steps visit t = 1, (n-1)/n, ..., 1/n; each step turns the prediction x0_hat at t into the implied
    noise eps_hat = (z_t - sqrt(a_t) x0_hat) / sqrt(1 - a_t) and re-noises to the next time. One step is the
    jump from pure noise straight to x0_hat.
    """

    def __init__(self, schedule: NoiseSchedule):
        self.schedule = schedule
        self.timesteps = torch.ones(1)

    def set_timesteps(self, n: int) -> None:
        if n <= 0:
            raise DiffarError(f"the number of denoising steps must be positive, got {n}")
        self.timesteps = torch.arange(n, 0, -1, dtype=torch.float32) / n

    def next_time(self, t: float) -> float:
        later = self.timesteps[self.timesteps < t]
        return float(later[0]) if len(later) else 0.0

    def step(self, x0_hat: torch.Tensor, t: float, z_t: torch.Tensor) -> torch.Tensor:
        """z at the next time (x0_hat itself once the next time is 0)."""
        t_next = self.next_time(t)
        if t_next == 0.0:
            return x0_hat
        a, a_next = (self.schedule.alpha_bar(torch.tensor(v)).to(z_t.dtype) for v in (t, t_next))
        eps_hat = (z_t - a.sqrt() * x0_hat) / (1 - a).sqrt()
        return a_next.sqrt() * x0_hat + (1 - a_next).sqrt() * eps_hat
