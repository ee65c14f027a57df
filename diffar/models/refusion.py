"""ReFusion: an AR stream and a diffusion stream joined by cross-attention fusion (the ReFusion seed post,
`seeds/refusion.zh.txt`).

- The AR stream is the foundation's `Transformer`; it alone decides what text is produced.
- `TextDiffuser`, the diffusion stream, denoises a block of token embeddings. Its first slot holds the
  token the AR stream has just chosen (clean); the next `block` slots are the tokens after it, noised
  with a noise schedule (cosine, linear or learned). A bidirectional transformer predicts the clean block
  (x0), reading the AR stream's hidden states through `CrossAttentionFusion`; rounding the prediction
  against the embedding table gives token logits. From pure noise, one pass drafts `block` tokens.
- With `domains`, a domain adapter (models/domain_adapter.py) mixes the embedding of each row's domain into the
  stream's input states: one stream drafts for several domains (corpora of a mixture), told which per row.
- Optional AR-side fusion layers let the AR stream read the diffusion stream's (noised) block at token
  positions it has already seen. They change the AR stream, so lossless decoding refuses such a model.

Training (`forward`) picks `anchors` random block positions per sequence and returns
    loss = ar_weight * CE_AR + mse_weight * MSE(x0_hat, x0) + kl_weight * KL(p_AR || p_diffusion)
where the KL compares, slot by slot, the AR stream's teacher-forced next-token distribution with the
diffusion stream's rounding. Stage "diffusion" trains the diffusion stream alone (no AR stream, no
fusion): the KL term's reference is then the data's one-hot, i.e. cross-entropy on the true tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from diffar.config import Config
from diffar.data.batching import IGNORE_INDEX
from diffar.diffusion.schedules import KINDS, NoiseSchedule
from diffar.errors import DiffarError
from diffar.models.domain_adapter import DomainAdapter
from diffar.models.fusion import CrossAttentionFusion
from diffar.models.time_embedding import timestep_embedding
from diffar.models.transformer import Block, RMSNorm, Transformer, TransformerConfig, rope_angles, rope_tables

PRESETS: dict[str, dict] = {
    "tiny": dict(ar_preset="tiny", n_layer=1, n_head=4, d_model=64, block=4, fusion_heads=4),
    "small": dict(ar_preset="small", n_layer=2, n_head=8, d_model=256, block=8, fusion_heads=8),
}
STAGES = ("diffusion", "joint")


@dataclass
class RefusionConfig(Config, presets=PRESETS, nested={"ar": TransformerConfig}):
    ar: TransformerConfig = field(default_factory=TransformerConfig)
    ar_preset: str = "small"
    n_layer: int = 2  # diffusion stream
    n_head: int = 8
    d_model: int = 256
    block: int = 8  # tokens drafted per block, after the AR stream's own next token
    fusion_heads: int = 8
    diffusion_fusion_layers: tuple[int, ...] | None = None  # diffusion layers reading the AR stream; None = all
    ar_fusion_layers: tuple[int, ...] = ()  # AR layers reading the diffusion stream (not lossless)
    domains: tuple[str, ...] = ()  # a domain adapter's domains (corpus names); () = none
    schedule: str = "cosine"
    # training
    stage: str = "joint"
    freeze_ar: bool = True  # keep the AR stream's weights (the verifier) as they were loaded
    anchors: int = 8  # blocks per training sequence
    full_noise_prob: float = 0.75  # share of training blocks at t = 1, where one-step drafting starts
    ar_weight: float = 1.0
    mse_weight: float = 0.5
    kl_weight: float = 0.1
    grad_checkpoint: bool = False  # recompute both streams' block activations in backward
    preset: str = ""

    def __post_init__(self):
        if self.diffusion_fusion_layers is None:
            self.diffusion_fusion_layers = tuple(range(self.n_layer))
        self.diffusion_fusion_layers, self.ar_fusion_layers = (tuple(self.diffusion_fusion_layers),
                                                               tuple(self.ar_fusion_layers))
        self.domains = tuple(self.domains)
        super().__post_init__()

    def checks(self):
        return [
            (self.block > 0, f"block size must be positive, got {self.block}"),
            (self.anchors > 0, f"anchors must be positive, got {self.anchors}"),
            (self.schedule in KINDS, f"unknown noise schedule {self.schedule!r}; choose one of {', '.join(KINDS)}"),
            (self.stage in STAGES, f"unknown stage {self.stage!r}; choose one of {', '.join(STAGES)}"),
            (0 <= self.full_noise_prob <= 1, f"full_noise_prob must be in [0, 1], got {self.full_noise_prob}"),
            (all(0 <= i < self.n_layer for i in self.diffusion_fusion_layers),
             f"diffusion fusion layers {self.diffusion_fusion_layers} must lie in 0..{self.n_layer - 1}"),
            (all(0 <= i < self.ar.n_layer for i in self.ar_fusion_layers),
             f"AR fusion layers {self.ar_fusion_layers} must lie in 0..{self.ar.n_layer - 1}"),
            (self.d_model % self.fusion_heads == 0 and self.ar.d_model % self.fusion_heads == 0,
             f"fusion_heads {self.fusion_heads} must divide both streams' widths"),
            (len(set(self.domains)) == len(self.domains), f"domains must differ, got {self.domains}"),
            *self.nonnegative("ar_weight", "mse_weight", "kl_weight"),
        ]

    @classmethod
    def from_preset(cls, name: str, vocab_size: int, **overrides) -> RefusionConfig:
        """The AR stream comes from its own preset, `ar_preset`."""
        ar_preset = {**cls.preset_settings(name), **overrides}["ar_preset"]
        return super().from_preset(name, ar=TransformerConfig.from_preset(ar_preset, vocab_size=vocab_size),
                                   **overrides)

    def stream_config(self) -> TransformerConfig:
        """The diffusion stream's transformer shape (its 'sequence' is one block plus the anchor slot)."""
        return TransformerConfig(vocab_size=self.ar.vocab_size, n_layer=self.n_layer, n_head=self.n_head,
                                 d_model=self.d_model, max_seq_len=self.block + 1, norm_eps=self.ar.norm_eps)


class TextDiffuser(nn.Module):
    """The diffusion stream: a block of noised token embeddings -> the clean embeddings (x0) -> logits."""

    def __init__(self, cfg: RefusionConfig):
        super().__init__()
        inner = cfg.stream_config()
        self.d_model = cfg.d_model
        self.gradient_checkpointing = cfg.grad_checkpoint
        # Frozen embedding table: the space the diffusion runs in. Training it with an MSE loss lets the
        # embeddings collapse together (Li et al. 2022, Diffusion-LM); fixed rows at unit RMS, the scale of
        # the Gaussian noise, cannot.
        self.tok_emb = nn.Embedding(cfg.ar.vocab_size, cfg.d_model).requires_grad_(False)
        self.set_embeddings(self.tok_emb.weight)
        self.schedule = NoiseSchedule(cfg.schedule)
        self.warm = nn.Linear(cfg.ar.d_model, cfg.d_model, bias=False)  # warm start from the AR stream's state
        # what the fusion reads at context position s: the AR state there plus the tokens at s and s + 1
        # (which tokens follow which: the copy cue that prompt lookup lives on)
        self.read_tokens = nn.Linear(2 * cfg.d_model, cfg.ar.d_model, bias=False)
        self.time_mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_model), nn.SiLU(),
                                      nn.Linear(cfg.d_model, cfg.d_model))
        self.domains = cfg.domains
        self.adapter = DomainAdapter(len(cfg.domains), cfg.d_model) if cfg.domains else None
        self.blocks = nn.ModuleList(Block(inner) for _ in range(cfg.n_layer))
        self.fusion = nn.ModuleDict({
            str(i): CrossAttentionFusion(cfg.d_model, cfg.ar.d_model, cfg.fusion_heads, gate_init=1.0,
                                         eps=cfg.ar.norm_eps)
            for i in cfg.diffusion_fusion_layers
        })
        self.norm = RMSNorm(cfg.d_model, cfg.ar.norm_eps)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(-0.5 * math.log(cfg.d_model)))
        cos, sin = rope_tables(inner.head_dim, inner.max_seq_len, inner.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def set_embeddings(self, table: torch.Tensor) -> None:
        """Use `table` (V, d), each row scaled to unit RMS, as the diffusion space."""
        self.tok_emb.weight.copy_(F.rms_norm(table.float(), (self.d_model,)))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids -> points of the diffusion space."""
        return self.tok_emb(tokens)

    def context_kv(self, context: torch.Tensor, context_tokens: torch.Tensor) -> dict[str, tuple]:
        """Each fusion layer's keys and values for context (N, S, d_ar), the AR stream's hidden states, and
        context_tokens (N, S, 2), the token at each context position and the one after it."""
        features = context + self.read_tokens(self.embed(context_tokens).flatten(2))
        return {i: layer.keys_values(features) for i, layer in self.fusion.items()}

    def forward(self, z: torch.Tensor, t: torch.Tensor, context: torch.Tensor | None = None,
                context_mask: torch.Tensor | None = None, context_tokens: torch.Tensor | None = None,
                kv: dict[str, tuple] | None = None, domain: torch.Tensor | None = None) -> torch.Tensor:
        """z (N, L, d) noised block, t (N, L) per-slot times -> x0 prediction (N, L, d).

        The fusion layers read the context (see `context_kv`; `kv` passes them precomputed) where
        context_mask (N, S) is True; no context: no fusion. Every slot also starts from the latest visible AR
        state (the one that predicted the anchor token). A stream with a domain adapter needs each row's
        domain (N,), an index into `domains`."""
        N, L, _ = z.shape
        x = z + self.time_mlp(timestep_embedding(t, self.d_model).to(z.dtype))
        if context is not None:
            latest = (context_mask * torch.arange(context_mask.shape[1], device=z.device)).argmax(1)
            x = x + self.warm(context[torch.arange(N, device=z.device), latest]).unsqueeze(1)
            kv = kv or self.context_kv(context, context_tokens)
        if self.adapter is not None:
            if domain is None:
                raise DiffarError(f"this diffusion stream drafts for the domains {', '.join(self.domains)}: "
                                  f"choose one (--domain)")
            x = self.adapter(x, domain)
        cos, sin = rope_angles(self.rope_cos, self.rope_sin, torch.arange(L, device=x.device), x.dtype)
        everything = torch.ones(1, 1, L, L, dtype=torch.bool, device=z.device)  # bidirectional
        mask = None if context is None else context_mask.view(N, 1, 1, -1)
        for i, block in enumerate(self.blocks):
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, everything, None, use_reentrant=False)
            else:
                x = block(x, cos, sin, everything, None)
            if context is not None and str(i) in self.fusion:
                x = self.fusion[str(i)](x, kv[str(i)], mask)
        return self.out(self.norm(x))

    def logits(self, x0_hat: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
        """Round predicted embeddings against the table: similarity to every token's embedding. `table`: a
        copy of the embedding table to round against instead (drafting uses a bf16 one, see DiffusionDrafter)."""
        table = self.tok_emb.weight if table is None else table
        flat = x0_hat.reshape(-1, self.d_model).to(table.dtype)  # one 2-D matmul (a strided 3-D one is a slow bmm)
        return (F.linear(flat, table).to(x0_hat.dtype) * self.logit_scale.exp()).view(*x0_hat.shape[:-1], -1)


class RefusionModel(nn.Module):
    loss_is_nll = False  # the trainer logs no perplexity for a sum of CE, MSE and KL terms

    def __init__(self, cfg: RefusionConfig):
        super().__init__()
        self.config = cfg
        self.ar = Transformer(cfg.ar)
        self.diffuser = TextDiffuser(cfg)
        self.ar_fusion = nn.ModuleDict({
            str(i): CrossAttentionFusion(cfg.ar.d_model, cfg.d_model, cfg.fusion_heads, gate_init=0.0,
                                         eps=cfg.ar.norm_eps)
            for i in cfg.ar_fusion_layers
        })
        self.loss_parts: dict[str, float] = {}
        self.ar.gradient_checkpointing = cfg.grad_checkpoint
        self._freeze()

    def _freeze(self) -> None:
        if self.config.freeze_ar or self.config.stage == "diffusion":
            self.ar.requires_grad_(False)
        self.diffuser.tok_emb.requires_grad_(False)

    def init_from_ar(self, ar: Transformer, embeddings: bool = True) -> None:
        """Start from a trained AR model: its weights become the AR stream, and (`embeddings`, when the widths
        agree) its embedding table the diffusion space."""
        if ar.config.to_dict() != self.config.ar.to_dict():
            raise DiffarError("the AR checkpoint's shape does not match this ReFusion preset's AR stream")
        self.ar.load_state_dict(ar.state_dict())
        if embeddings and ar.config.d_model == self.config.d_model:
            self.diffuser.set_embeddings(ar.tok_emb.weight)
        self._freeze()

    @property
    def lossless(self) -> bool:
        """Whether the AR stream alone decides (no AR-side fusion): drafts then cannot change the text."""
        return not self.ar_fusion

    def ar_hidden(self, tokens: torch.Tensor, block_states: torch.Tensor | None = None,
                  block_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """The AR stream's final hidden states; with AR-side fusion, reading `block_states`."""
        def fuse(i: int, x: torch.Tensor) -> torch.Tensor:
            if str(i) not in self.ar_fusion:
                return x
            layer = self.ar_fusion[str(i)]
            return layer(x, layer.keys_values(block_states), block_mask)
        reads_block = bool(self.ar_fusion) and block_states is not None
        return self.ar.hidden_states(tokens, fuse=fuse if reads_block else None, **kwargs)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor,
                domain: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced training pass -> (the diffusion stream's logits at the drafted slots (M, V), loss).
        A frozen AR stream (the default) gets no CE_AR term: it would be a constant. `domain` (B,): each
        sequence's domain, for a stream with a domain adapter."""
        cfg, d = self.config, self.diffuser
        B, T = tokens.shape
        L = cfg.block + 1
        known = targets != IGNORE_INDEX
        # anchors: position p; slot j of its block is the token at position p + 1 + j = targets[p + j]
        p = torch.multinomial(known.float(), cfg.anchors, replacement=True).reshape(-1)  # (N,)
        rows = torch.arange(B, device=tokens.device).repeat_interleave(cfg.anchors)
        offs = p.unsqueeze(1) + torch.arange(L, device=tokens.device)
        block = targets[rows.unsqueeze(1), offs.clamp(max=T - 1)]
        in_block = (offs < T) & (block != IGNORE_INDEX)
        block = block.where(in_block, 0)
        x0 = d.embed(block)
        N = len(p)
        t = torch.where(torch.rand(N, device=x0.device) < cfg.full_noise_prob, 1.0, torch.rand(N, device=x0.device))
        z = d.schedule.q_sample(x0, t, torch.randn_like(x0))
        z = torch.cat([x0[:, :1], z[:, 1:]], dim=1)  # the anchor slot is given clean
        t_slots = torch.cat([t.new_zeros(N, 1), t.unsqueeze(1).expand(N, L - 1)], dim=1)

        parts = {}
        if cfg.stage == "diffusion":
            context = context_mask = context_tokens = None
        else:
            block_states = block_mask = None
            if self.ar_fusion:  # AR position q reads block slots holding tokens at positions <= q
                block_states = z.reshape(B, cfg.anchors * L, -1)
                token_pos = (offs + 1).reshape(B, 1, 1, -1)
                block_mask = (token_pos <= torch.arange(T, device=z.device).view(1, 1, T, 1)) \
                    & in_block.reshape(B, 1, 1, -1)
                block_mask = block_mask | ~block_mask.any(-1, keepdim=True)  # keep every query's softmax finite
            train_ar = torch.is_grad_enabled() and not cfg.freeze_ar
            with torch.set_grad_enabled(train_ar):
                h = self.ar_hidden(tokens, block_states, block_mask)
            if not cfg.freeze_ar:  # a frozen AR stream's CE is a constant: not worth its 8k-way softmax
                ar_logits = self.ar.lm_head(h)
                parts["ce_ar"] = F.cross_entropy(ar_logits.float().flatten(0, 1), targets.reshape(-1),
                                                 ignore_index=IGNORE_INDEX)
            context = h[rows]
            context_mask = torch.arange(T, device=z.device).unsqueeze(0) <= p.unsqueeze(1)
            following = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)  # position p's is the anchor token
            context_tokens = torch.stack([tokens, following], dim=-1)[rows]

        x0_hat = d(z, t_slots, context, context_mask, context_tokens,
                   domain=None if domain is None else domain[rows])[:, 1:]
        m = in_block[:, 1:]
        logits = d.logits(x0_hat[m]).float()  # (M, V) over the block slots holding real tokens
        truth = block[:, 1:][m]
        parts["mse"] = ((x0_hat[m] - x0[:, 1:][m]) ** 2).mean()
        logq = F.log_softmax(logits, dim=-1)
        if context is None:
            parts["kl"] = F.nll_loss(logq, truth)
        else:  # the AR stream's next-token distribution at the position before each slot
            teacher = self.ar.lm_head(h[rows.unsqueeze(1), offs[:, 1:].clamp(max=T - 1)][m]).detach().float()
            parts["kl"] = F.kl_div(logq, F.log_softmax(teacher, dim=-1), log_target=True, reduction="batchmean")
        loss = cfg.mse_weight * parts["mse"] + cfg.kl_weight * parts["kl"]
        if "ce_ar" in parts:
            loss = loss + cfg.ar_weight * parts["ce_ar"]
        self.loss_parts = {k: float(v.detach()) for k, v in parts.items()}
        self.loss_parts["draft_acc"] = float((logits.argmax(-1) == truth).float().mean())
        return logits, loss
