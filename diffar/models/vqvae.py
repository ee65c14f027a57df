"""DD2 stage 1: a text autoencoder that maps a token canvas to a sequence of continuous latents and back.

    tokens (B, N) -> encoder (bidirectional transformer) -> (B, N, d_latent) -> bottleneck -> z
    z -> decoder (bidirectional transformer) -> token logits (B, N, V), all positions in one pass

One latent per canvas position (no length compression: the diffusion stage needs >= 99 % reconstruction
more than it needs a shorter sequence). Length lives in the latent: a seq2seq canvas is the target, <eos>,
then <pad> up to its width, and the decoder reconstructs the pads too, so a denoised latent says where the
text ends (the first decoded <eos>). Continuation canvases are full windows of text.

The bottleneck is a product vector quantiser (EMA codebooks, dead-code restart) or, with
`bottleneck="kl"`, a KL-regularised Gaussian (models/quantizer.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from diffar.config import Config
from diffar.models.quantizer import GaussianBottleneck, VectorQuantizer
from diffar.models.transformer import BidirectionalStack, TransformerConfig

PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=1, n_head=4, d_model=64, d_latent=32, codebook_size=64, groups=2, max_len=128,
                 prompt_len=16, target_len=32),  # tests
    "small": dict(n_layer=2, n_head=8, d_model=256, d_latent=256, codebook_size=512, groups=4, max_len=256),
}
BOTTLENECKS = ("vq", "kl")


@dataclass
class VQVAEConfig(Config, presets=PRESETS):
    vocab_size: int = 8192
    n_layer: int = 2  # encoder and decoder each
    n_head: int = 8
    d_model: int = 256
    d_latent: int = 256  # the width of the space the diffusion runs in
    max_len: int = 256  # longest canvas
    bottleneck: str = "vq"
    codebook_size: int = 512  # codes per group
    groups: int = 4  # product quantisation: each latent splits into this many sub-vectors
    commitment: float = 0.25
    ema_decay: float = 0.99
    dead_threshold: float = 0.1  # restart a code whose moving-average assignments per step fall below this
    kl_weight: float = 1e-4  # bottleneck "kl"
    # the canvas layout, shared by every model built on this autoencoder
    length_ratio: float = 1.1  # seq2seq: a canvas holds ceil(length_ratio * source tokens) + length_margin
    length_margin: int = 8
    prompt_len: int = 64  # continuation: prompt tokens before a canvas of target_len
    target_len: int = 256
    preset: str = ""

    def checks(self):
        return [
            (self.bottleneck in BOTTLENECKS, f"unknown bottleneck {self.bottleneck!r}; choose one of "
                                             f"{', '.join(BOTTLENECKS)}"),
            (self.d_latent > 0 and self.groups > 0 and self.d_latent % self.groups == 0,
             f"latent width {self.d_latent} must split into {self.groups} groups"),
            (self.codebook_size > 1, f"codebook_size must be at least 2, got {self.codebook_size}"),
            (self.max_len > 0, f"max_len must be positive, got {self.max_len}"),
            (0 < self.ema_decay < 1, f"ema_decay must be in (0, 1), got {self.ema_decay}"),
            (self.length_ratio > 0 and self.length_margin >= 0, "length_ratio must be > 0, length_margin >= 0"),
            (0 < self.target_len <= self.max_len and self.prompt_len > 0,
             f"target_len must be in 1..{self.max_len} and prompt_len positive"),
        ]

    @classmethod
    def from_preset(cls, name: str, vocab_size: int, **overrides) -> VQVAEConfig:
        return super().from_preset(name, **overrides, vocab_size=vocab_size)

    def width(self, source_len: int) -> int:
        """Canvas positions for a seq2seq source of `source_len` tokens (room for the text, <eos>, pads)."""
        return min(self.max_len, math.ceil(self.length_ratio * source_len) + self.length_margin)

    def stack_config(self) -> TransformerConfig:
        return TransformerConfig(vocab_size=self.vocab_size, n_layer=self.n_layer, n_head=self.n_head,
                                 d_model=self.d_model, max_seq_len=self.max_len)


class TextVQVAE(nn.Module):
    loss_is_nll = False  # CE plus the bottleneck's own term

    def __init__(self, cfg: VQVAEConfig):
        super().__init__()
        self.config = cfg
        stack = cfg.stack_config()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = BidirectionalStack(stack)
        self.to_latent = nn.Linear(cfg.d_model, cfg.d_latent, bias=False)
        if cfg.bottleneck == "vq":
            self.bottleneck = VectorQuantizer(cfg.d_latent, cfg.codebook_size, cfg.groups, decay=cfg.ema_decay,
                                              commitment=cfg.commitment, dead_threshold=cfg.dead_threshold)
        else:
            self.bottleneck = GaussianBottleneck(cfg.d_latent, cfg.kl_weight)
        self.from_latent = nn.Linear(cfg.d_latent, cfg.d_model, bias=False)
        self.decoder = BidirectionalStack(stack)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        self.loss_parts: dict[str, float] = {}

    def quantize(self, tokens: torch.Tensor,
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """tokens (B, N) -> (latents (B, N, d_latent), codes (B, N, groups) or None, the bottleneck's loss);
        `mask` as in `decode`."""
        return self.bottleneck(self.to_latent(self.encoder(self.tok_emb(tokens), mask)))

    def encode(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, N) -> latents (B, N, d_latent): the quantised codes' vectors, or the Gaussian's mean."""
        return self.quantize(tokens, mask)[0]

    def decode(self, z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """latents (B, N, d_latent) -> token logits (B, N, V): every position in one parallel pass. `mask`
        (B, N): the positions each row's canvas has (default: all), so rows of different widths batch."""
        return self.lm_head(self.decoder(self.from_latent(z), mask))

    def forward(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reconstruct the canvas `targets` (B, N) -> (logits, CE + bottleneck loss)."""
        z, codes, bottleneck_loss = self.quantize(targets)
        logits = self.decode(z)
        ce = F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1))
        self.loss_parts = {"ce": float(ce.detach()), "bottleneck": float(bottleneck_loss.detach()),
                           "token_acc": float((logits.argmax(-1) == targets).float().mean())}
        if codes is not None:
            self.loss_parts["code_usage"] = self.bottleneck.usage(codes)
        return logits, ce + bottleneck_loss
