"""Small random DD2 models and inputs shared by the DD2 model and sampling tests."""

from __future__ import annotations

import torch

from diffar.models.dd2 import DD2Config, DD2Model
from diffar.models.transformer import TransformerConfig
from diffar.models.vqvae import VQVAEConfig

VOCAB = 512
EOS = 2


def random_dd2(seed=0, encoder=False, **overrides) -> DD2Model:
    """A `tiny` DD2 model with large random weights, so that different inputs give different tokens;
    `encoder`: with a `tiny` AR model as its source encoder."""
    torch.manual_seed(seed)
    if encoder:
        overrides["source_encoder"] = TransformerConfig.from_preset("tiny", vocab_size=VOCAB)
    model = DD2Model(DD2Config.from_preset("tiny", VQVAEConfig.from_preset("tiny", VOCAB), **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


def sources(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, VOCAB, (int(length),), generator=g).tolist()
            for length in torch.randint(3, 12, (n,), generator=g)]


def inputs(model, batch=2, width=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, width, model.config.vqvae.d_latent, generator=g)
    source = torch.randint(5, VOCAB, (batch, 6), generator=g)
    return z, torch.full((batch,), 0.7), source, torch.ones_like(source, dtype=torch.bool)
