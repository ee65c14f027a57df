"""Bottlenecks of the text autoencoder: a vector quantiser and a continuous (KL-regularised) Gaussian.

`VectorQuantizer` (VQ-VAE, van den Oord et al. 2017, arXiv 1711.00937) splits each latent vector into
`groups` sub-vectors, each snapped to the nearest of `codebook_size` codes of its own codebook (product
quantisation: codebook_size ** groups combinations per position from small tables). Sub-vectors and codes
live on the sphere of radius sqrt(group width), i.e. unit RMS: nearest-code lookup by cosine similarity
keeps far more codes in use than raw distances (Yu et al. 2022, ViT-VQGAN, arXiv 2110.04627), and the
diffusion then runs in a space of known scale. The codebooks are not
trained by the optimizer but as exponential moving averages of the encoder outputs assigned to them
(VQ-VAE-2, arXiv 1906.00446); the encoder gets the straight-through gradient plus the commitment loss.
A code whose moving-average usage falls below `dead_threshold` is restarted on a random encoder output
of the current batch (Dhariwal et al. 2020, Jukebox), so no code stays dead; the first training batch
seeds every code the same way.

`GaussianBottleneck` is the continuous option: the encoder predicts a mean and log-variance per latent
dimension, training samples from it and pays a KL to N(0, I) (Kingma & Welling 2014); inference uses the mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VectorQuantizer(nn.Module):
    def __init__(self, dim: int, codebook_size: int, groups: int, *, decay: float, commitment: float,
                 dead_threshold: float):
        super().__init__()
        self.groups, self.codebook_size, self.group_dim = groups, codebook_size, dim // groups
        self.decay, self.commitment, self.dead_threshold = decay, commitment, dead_threshold
        codes = F.rms_norm(torch.randn(groups, codebook_size, self.group_dim), (self.group_dim,))
        self.register_buffer("codebook", codes)
        self.register_buffer("ema_count", torch.ones(groups, codebook_size))
        self.register_buffer("ema_sum", codes.clone())
        self.register_buffer("restarts", torch.zeros((), dtype=torch.long))  # codes restarted so far
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))  # codes drawn from the first batch

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """Each group's sub-vector scaled to unit RMS."""
        x = z.reshape(*z.shape[:-1], self.groups, self.group_dim)
        return F.rms_norm(x, (self.group_dim,)).flatten(-2)

    def nearest(self, z: torch.Tensor) -> torch.Tensor:
        """z (..., dim) -> code index per group (..., groups)."""
        x = z.reshape(-1, self.groups, self.group_dim).transpose(0, 1).float()  # (G, M, g)
        book = self.codebook.float()
        dist = (x * x).sum(-1, keepdim=True) - 2 * x @ book.transpose(1, 2) + (book * book).sum(-1).unsqueeze(1)
        return dist.argmin(-1).transpose(0, 1).reshape(*z.shape[:-1], self.groups)

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """Code indices (..., groups) -> latent vectors (..., dim)."""
        g = torch.arange(self.groups, device=codes.device)
        return self.codebook[g, codes].flatten(-2)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """z (B, N, dim) -> (quantised z with straight-through gradient, codes (B, N, groups), commitment loss)."""
        z = self.normalize(z)
        codes = self.nearest(z)
        zq = self.lookup(codes).to(z.dtype)
        if self.training:
            self._update(z.detach(), codes)
        loss = self.commitment * F.mse_loss(z, zq.detach())
        return z + (zq - z).detach(), codes, loss

    @torch.no_grad()
    def _update(self, z: torch.Tensor, codes: torch.Tensor) -> None:
        x = z.reshape(-1, self.groups, self.group_dim).transpose(0, 1).float()  # (G, M, g)
        if not self.initialized:  # start every code on a real encoder output, not far from all of them
            pick = torch.randint(x.shape[1], (self.codebook_size,), device=x.device)
            self.codebook.copy_(x[:, pick])
            self.ema_sum.copy_(x[:, pick])
            self.initialized.fill_(True)
            codes = self.nearest(z)
        onehot = F.one_hot(codes.reshape(-1, self.groups).transpose(0, 1), self.codebook_size).float()  # (G, M, K)
        self.ema_count.mul_(self.decay).add_(onehot.sum(1), alpha=1 - self.decay)
        self.ema_sum.mul_(self.decay).add_(onehot.transpose(1, 2) @ x, alpha=1 - self.decay)
        n = self.ema_count.sum(-1, keepdim=True)  # Laplace smoothing keeps rare codes finite
        count = (self.ema_count + 1e-5) / (n + self.codebook_size * 1e-5) * n
        self.codebook.copy_(F.rms_norm(self.ema_sum / count.unsqueeze(-1), (self.group_dim,)))
        dead = self.ema_count < self.dead_threshold
        if dead.any():
            for g in range(self.groups):
                idx = dead[g].nonzero().squeeze(1)
                if len(idx):
                    pick = torch.randint(x.shape[1], (len(idx),), device=x.device)
                    self.codebook[g, idx] = x[g, pick]
                    self.ema_sum[g, idx] = x[g, pick]
                    self.ema_count[g, idx] = 1.0
            self.restarts += int(dead.sum())

    def usage(self, codes: torch.Tensor) -> float:
        """Share of the codes used at least once in `codes`, averaged over the groups."""
        flat = codes.reshape(-1, self.groups)
        return sum(len(flat[:, g].unique()) for g in range(self.groups)) / (self.groups * self.codebook_size)


class GaussianBottleneck(nn.Module):
    """The continuous option: z ~ N(mean, sigma^2) with a KL(q || N(0, I)) term (weight `kl_weight`). The mean
    is kept at unit RMS, the scale of the VQ codes, so the KL term works on the noise: it keeps the posterior
    wide enough that nearby latents decode alike (a smooth space for the diffusion). Inference uses the mean."""

    def __init__(self, dim: int, kl_weight: float):
        super().__init__()
        self.to_stats = nn.Linear(dim, 2 * dim)
        with torch.no_grad():  # start near-deterministic (sigma ~ 0.05): the decoder learns to read the mean
            self.to_stats.bias[dim:].fill_(-6.0)  # first, then the KL term widens the posterior
        self.kl_weight = kl_weight

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
        mean, logvar = self.to_stats(z).chunk(2, dim=-1)
        mean = F.rms_norm(mean, (mean.shape[-1],))  # unit RMS, the scale of the VQ codes
        logvar = logvar.clamp(-20, 10)
        kl = 0.5 * (mean ** 2 + logvar.exp() - 1 - logvar).sum(-1).mean()
        sample = mean + (0.5 * logvar).exp() * torch.randn_like(mean) if self.training else mean
        return sample, None, self.kl_weight * kl
