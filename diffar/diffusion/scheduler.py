"""Samplers hold no weights: `set_timesteps(n)` picks the times, `step(...)` moves a sample one of them
towards t = 0 given the network's output (the diffusers interface).

The network predicts either the noise (`prediction="eps"`, DDPM's parameterisation) or the clean sample
(`prediction="x0"`); `x0_hat` converts an eps prediction with
    x0_hat = (z_t - sqrt(1 - alpha_bar_t) * eps_hat) / sqrt(alpha_bar_t),
which, from pure noise at t = 1, is the one-step jump (the DD2 seed post, `seeds/dd2.zh.txt`, section 2.2).
"""

from __future__ import annotations

import torch

from diffar.diffusion.schedules import NoiseSchedule
from diffar.errors import DiffarError

PREDICTIONS = ("eps", "x0")


class Scheduler:
    """Shared bookkeeping: n steps visit t = 1, (n-1)/n, ..., 1/n; the step from 1/n lands on x0_hat."""

    def __init__(self, schedule: NoiseSchedule, prediction: str = "eps"):
        if prediction not in PREDICTIONS:
            raise DiffarError(f"unknown prediction type {prediction!r}; choose one of {', '.join(PREDICTIONS)}")
        self.schedule, self.prediction = schedule, prediction
        self.timesteps = torch.ones(1)

    def set_timesteps(self, n: int) -> None:
        if n <= 0:
            raise DiffarError(f"the number of denoising steps must be positive, got {n}")
        self.timesteps = torch.arange(n, 0, -1, dtype=torch.float32) / n

    def next_time(self, t: float) -> float:
        later = self.timesteps[self.timesteps < t]
        return float(later[0]) if len(later) else 0.0

    def alpha_bar(self, t: float, like: torch.Tensor) -> torch.Tensor:
        return self.schedule.alpha_bar(torch.tensor(t)).to(like.dtype)

    def x0_hat(self, model_output: torch.Tensor, t: float, z_t: torch.Tensor) -> torch.Tensor:
        if self.prediction == "x0":
            return model_output
        a = self.alpha_bar(t, z_t)
        return (z_t - (1 - a).sqrt() * model_output) / a.sqrt()

    def output_for(self, x0: torch.Tensor, t: float, z_t: torch.Tensor) -> torch.Tensor:
        """The network output that predicts `x0` from z_t (the inverse of `x0_hat`), e.g. after editing x0."""
        return x0 if self.prediction == "x0" else self._implied_eps(x0, t, z_t)

    def eps_hat(self, model_output: torch.Tensor, t: float, z_t: torch.Tensor) -> torch.Tensor:
        return model_output if self.prediction == "eps" else self._implied_eps(model_output, t, z_t)

    def _implied_eps(self, x0: torch.Tensor, t: float, z_t: torch.Tensor) -> torch.Tensor:
        """The noise that takes x0 to z_t at time t."""
        a = self.alpha_bar(t, z_t)
        return (z_t - a.sqrt() * x0) / (1 - a).sqrt()


class DDIMScheduler(Scheduler):
    """Deterministic DDIM (eta = 0; Song et al. 2021, arXiv 2010.02502): re-noise x0_hat to the next time
    with the noise the prediction implies. With one step it is the one-step jump from pure noise to x0_hat."""

    def step(self, model_output: torch.Tensor, t: float, z_t: torch.Tensor,
             generator: torch.Generator | None = None) -> torch.Tensor:
        """z at the next time (x0_hat itself once the next time is 0). `generator` is unused (deterministic)."""
        x0 = self.x0_hat(model_output, t, z_t)
        t_next = self.next_time(t)
        if t_next == 0.0:
            return x0
        a_next = self.alpha_bar(t_next, z_t)
        return a_next.sqrt() * x0 + (1 - a_next).sqrt() * self.eps_hat(model_output, t, z_t)


class DDPMScheduler(Scheduler):
    """Ancestral sampling from the posterior q(z_s | z_t, x0_hat) (Ho et al. 2020, arXiv 2006.11239, eq. 7),
    for any grid of times s < t: with a_ts = alpha_bar_t / alpha_bar_s,
        mean = sqrt(alpha_bar_s) (1 - a_ts) / (1 - alpha_bar_t) x0
               + sqrt(a_ts) (1 - alpha_bar_s) / (1 - alpha_bar_t) z_t
        var  = (1 - alpha_bar_s) / (1 - alpha_bar_t) (1 - a_ts)."""

    def step(self, model_output: torch.Tensor, t: float, z_t: torch.Tensor,
             generator: torch.Generator | None = None) -> torch.Tensor:
        x0 = self.x0_hat(model_output, t, z_t)
        t_next = self.next_time(t)
        if t_next == 0.0:
            return x0
        a, a_next = self.alpha_bar(t, z_t), self.alpha_bar(t_next, z_t)
        a_ts = a / a_next
        mean = (a_next.sqrt() * (1 - a_ts) * x0 + a_ts.sqrt() * (1 - a_next) * z_t) / (1 - a)
        var = (1 - a_next) / (1 - a) * (1 - a_ts)
        noise = torch.randn(z_t.shape, generator=generator, dtype=z_t.dtype).to(z_t.device)  # a CPU generator's draw
        return mean + var.sqrt() * noise


SCHEDULERS = {"ddim": DDIMScheduler, "ddpm": DDPMScheduler}
