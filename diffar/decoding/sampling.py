"""Turning logits into a next token: greedy, temperature, top-k, top-p (nucleus, Holtzman et al. 2019), drawn
from a random generator or determined by a given noise value (`sample_coupled`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from diffar.errors import DiffarError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise DiffarError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise DiffarError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:  # also rejects nan
            raise DiffarError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


MIN_TEMPERATURE = 1e-6  # smaller temperatures sample as this one does: the argmax (ties shared), in float32


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """(B, V) logits -> (B, V) the distribution sampling draws from (after temperature, top-k, top-p). Safe for
    every admitted value: the logits are shifted to a maximum of 0 before the temperature (at least
    MIN_TEMPERATURE) divides them, and top-p always keeps the likeliest token."""
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / max(cfg.temperature, MIN_TEMPERATURE)
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens ranked above it already cover top_p; the top token always stays.
        drop = sorted_probs.cumsum(-1) - sorted_probs >= cfg.top_p
        drop[..., 0] = False  # a top_p below float32's smallest number still keeps it
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids."""
    if cfg.greedy:
        return logits.argmax(dim=-1)
    probs = probabilities(logits, cfg)
    if generator is not None and generator.device != probs.device:  # a CPU generator drives a CUDA model
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_coupled(logits: torch.Tensor, cfg: SamplingConfig, noise: torch.Tensor) -> torch.Tensor:
    """(B, V) logits and (B,) standard-normal noise -> (B,) the token that noise determines: the inverse CDF
    of the sampling distribution (after temperature, top-k, top-p) at u = Phi(noise). The same noise always
    gives the same token, and noise drawn from N(0, 1) draws tokens from the distribution: the teacher's
    sampling made a deterministic function of its noise, as DD1 couples noise and text (arXiv 2412.17153).
    Greedy ignores the noise."""
    if cfg.greedy:
        return logits.argmax(dim=-1)
    cdf = probabilities(logits, cfg).cumsum(-1)
    u = torch.special.ndtr(noise.to(cdf.device, torch.float64)).to(cdf.dtype).unsqueeze(-1) * cdf[:, -1:]
    # right=True: the first token whose CDF passes u, so a token of probability 0 is never chosen
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
