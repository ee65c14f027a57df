"""Decoder-only transformer: RoPE, RMSNorm, SwiGLU, tied embeddings, PyTorch SDPA; grouped-query attention
and an untied output layer for imported Llama-family models.

Used as the AR baseline and as the AR stream of the diffusion models. For seq2seq it reads
`source <sep> target` causally with the loss on the target only (data/batching.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from diffar.config import Config
from diffar.data.batching import IGNORE_INDEX
from diffar.errors import DiffarError
from diffar.models.kv_cache import KVCache

PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, n_head=4, d_model=64, max_seq_len=320),  # tests
    "small": dict(n_layer=6, n_head=8, d_model=256, max_seq_len=512),  # shipped models, ~6.9M params at 8k vocab
    "draft": dict(n_layer=2, n_head=8, d_model=256, max_seq_len=512),  # speculative-decoding drafter, ~3.7M
}
MAX_CONTEXT = 1 << 20  # the longest max_seq_len accepted (Llama 3's 131,072 fits; its RoPE tables are made eagerly)


@dataclass
class TransformerConfig(Config, presets=PRESETS):
    vocab_size: int = 8192
    n_layer: int = 6
    n_head: int = 8
    d_model: int = 256
    max_seq_len: int = 512
    ffn_hidden: int = field(default=0)  # 0: 8/3 * d_model rounded up to a multiple of 64 (LLaMA's SwiGLU sizing)
    rope_base: float = 10000.0  # Llama's rope_theta
    norm_eps: float = 1e-5
    n_kv_head: int = 0  # 0: n_head; fewer: grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245)
    head_dim: int = 0  # 0: d_model // n_head; an imported model may set its own
    tie_embeddings: bool = True  # the output layer is the token embedding; imported Llamas may untie it
    preset: str = ""

    def checks(self):
        """Lazily, so that each rule may lean on the ones before it."""
        ints = ("vocab_size", "n_layer", "n_head", "d_model", "max_seq_len", "ffn_hidden", "n_kv_head", "head_dim")
        for name in ints:
            value = getattr(self, name)
            yield isinstance(value, int) and not isinstance(value, bool), f"{name} must be an integer, got {value!r}"
            optional = name in ("ffn_hidden", "n_kv_head", "head_dim")  # 0 means "derive it"
            yield value >= 0 if optional else value > 0, f"{name} must be {'>= 0' if optional else 'positive'}, got {value}"
        yield self.max_seq_len <= MAX_CONTEXT, f"max_seq_len must be at most {MAX_CONTEXT:,}, got {self.max_seq_len:,}"
        for name in ("rope_base", "norm_eps"):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
            yield ok, f"{name} must be a positive number, got {value!r}"
        yield bool(self.head_dim) or self.d_model % self.n_head == 0, \
            f"d_model {self.d_model} must split into {self.n_head} heads"
        yield (self.head_dim or self.d_model // self.n_head) % 2 == 0, \
            f"head_dim {self.head_dim or self.d_model // self.n_head} must be even (RoPE rotates pairs)"
        yield self.n_head % (self.n_kv_head or self.n_head) == 0, \
            f"n_kv_head {self.n_kv_head} must divide n_head {self.n_head}"

    def __post_init__(self):
        super().__post_init__()
        self.head_dim = self.head_dim or self.d_model // self.n_head
        self.n_kv_head = self.n_kv_head or self.n_head
        self.ffn_hidden = self.ffn_hidden or 64 * math.ceil(8 * self.d_model / 3 / 64)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim: int, max_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rope_angles(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables' rows at `positions` ((B, T) or (T,)), shaped (B or 1, T, 1, D/2) to broadcast over heads and
    cast to the activations' dtype: once per forward, not once per layer."""
    shape = (-1 if positions.dim() == 2 else 1, positions.shape[-1], 1, cos.shape[-1])
    return cos[positions].to(dtype).view(shape), sin[positions].to(dtype).view(shape)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, T, H, D) by angles from `rope_angles` (RoFormer, arXiv 2104.09864; half-split layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.widths = (cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim)
        self.qkv = nn.Linear(cfg.d_model, sum(self.widths), bias=False)
        self.proj = nn.Linear(self.widths[0], cfg.d_model, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x, cos, sin, attn_mask, cache_start):
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, -1, self.head_dim)
        rotated = self.n_head + self.n_kv_head  # queries and keys, rotated in one go
        q, k = apply_rope(qkv[:, :, :rotated], cos, sin).transpose(1, 2).split([self.n_head, self.n_kv_head], 1)
        v = qkv[:, :, rotated:].transpose(1, 2)
        if cache_start is not None:
            k, v = self.kv_cache.update(cache_start, k, v)
        if attn_mask is None and 1 < T != k.shape[2]:
            raise ValueError("a multi-token forward after cached tokens needs an explicit attn_mask")
        # Without a mask: causal, and a single new token sees the whole cache. (A branch, not a bool expression:
        # compiled with dynamic shapes, T > 1 is a symbol that only a branch turns into a constant.)
        causal = False
        if attn_mask is None and T > 1:
            causal = True
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                           enable_gqa=self.n_kv_head != self.n_head)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """Shazeer 2020, "GLU Variants Improve Transformer" (arXiv 2002.05202)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm attention + SwiGLU. `attention`: the attention module's class (a block drafter's reads a context
    too, models/drafter.py); whatever follows `sin` in `forward` is that module's."""

    def __init__(self, cfg: TransformerConfig, attention: type[nn.Module] = Attention):
        super().__init__()
        self.attn_norm, self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps), RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn, self.ffn = attention(cfg), SwiGLU(cfg)

    def forward(self, x, cos, sin, *attention_args):
        x = x + self.attn(self.attn_norm(x), cos, sin, *attention_args)
        return x + self.ffn(self.ffn_norm(x))


class BidirectionalStack(nn.Module):
    """Transformer blocks where every position sees every other (RoPE positions, final RMSNorm)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.max_len = cfg.max_seq_len
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, d); key_mask (B, T) True = may be attended to (default: all); positions (T,) for RoPE
        (default 0..T-1)."""
        B, T, _ = x.shape
        positions = torch.arange(T, device=x.device) if positions is None else positions
        if int(positions.max()) >= self.max_len:
            raise DiffarError(f"sequence of {int(positions.max()) + 1} positions exceeds the model's {self.max_len}")
        cos, sin = rope_angles(self.rope_cos, self.rope_sin, positions, x.dtype)
        mask = torch.ones(1, 1, T, T, dtype=torch.bool, device=x.device) if key_mask is None \
            else key_mask.view(B, 1, 1, T)
        for block in self.blocks:
            x = block(x, cos, sin, mask, None)
        return self.norm(x)


class Transformer(nn.Module):
    loss_is_nll = True  # the training loss is the next-token NLL (see training/trainer.Trainable)

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        self.loss_parts: dict[str, float] = {}  # one term: the loss itself
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.gradient_checkpointing = False  # recompute block activations in backward (less memory, ~1/3 slower)
        self.kv_pool: dict[int, list[KVCache]] | None = None  # KV caches by batch size, once compiled
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith(("attn.proj.weight", "ffn.down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def setup_cache(self, batch_size: int, max_len: int | None = None) -> None:
        """Give every layer a KV cache of at least `max_len` slots for `batch_size` rows. One left by an earlier
        call is kept when it fits (its stale slots are never read: a decoder attends to the slots it wrote).

        With the decoding step compiled (`kv_pool` set, models/precision.compile_decode), each graph is bound
        to the cache tensors it was traced with: every batch size keeps its own caches in the pool, grown to
        powers of two, so that a warm server meets no new graph."""
        max_len = max_len or self.config.max_seq_len
        weight = self.tok_emb.weight
        caches = [block.attn.kv_cache for block in self.blocks]
        if self.kv_pool is not None:
            caches = self.kv_pool.get(batch_size, caches)
        cache = caches[0]
        if cache is None or cache.k.shape[0] != batch_size or cache.max_len < max_len \
                or (cache.k.dtype, cache.k.device) != (weight.dtype, weight.device):
            if self.kv_pool is not None:
                max_len = max(256, 1 << (max_len - 1).bit_length())
            caches = [KVCache(batch_size, self.config.n_kv_head, max_len, self.config.head_dim, weight.dtype)
                      .to(weight.device) for _ in self.blocks]
            if self.kv_pool is not None:
                self.kv_pool[batch_size] = caches
        for block, cache in zip(self.blocks, caches):
            block.attn.kv_cache = cache

    def hidden_states(
        self,
        tokens: torch.Tensor | None = None,
        *,
        embeddings: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        cache_start: int | None = None,
        fuse: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
        taps: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens (B, T) -> final (normed) hidden states (B, T, d_model); arguments as in `forward`.

        `embeddings` (B, T, d_model) replace the tokens' own: soft tokens, such as a distribution's expected
        embedding (the DD2 energy loss reads a generator's relaxed output so). `fuse(i, x)`, if given, rewrites
        the residual stream after block i (ReFusion's AR-side fusion). With `taps`, returns the final states
        and the residual stream after each block in `taps`, concatenated (B, T, len(taps) * d_model): the
        features a block drafter reads (models/drafter.py).
        """
        if (tokens is None) == (embeddings is None):
            raise ValueError("pass exactly one of tokens and embeddings")
        device = self.tok_emb.weight.device  # a decoder's bookkeeping may live elsewhere: the model reads here
        tokens, positions, attn_mask = (t if t is None else t.to(device) for t in (tokens, positions, attn_mask))
        x = self.tok_emb(tokens) if embeddings is None else embeddings
        B, T = x.shape[:2]
        if positions is None:
            start = cache_start or 0
            positions = torch.arange(start, start + T, device=x.device).expand(B, T)
        # (a compiled decoding step skips the check, which would sync: its decoder checked the lengths first)
        if not torch.compiler.is_compiling() and int(positions.max()) >= self.config.max_seq_len:
            raise DiffarError(f"sequence longer than the model's context ({self.config.max_seq_len} tokens)")
        cos, sin = rope_angles(self.rope_cos, self.rope_sin, positions, x.dtype)
        states = []  # with taps, the residual stream after each block (indexed, not tested with `in`: compiled,
        # taps are symbols); without, none is kept alive past its block
        for i, block in enumerate(self.blocks):
            if self.gradient_checkpointing and torch.is_grad_enabled() and cache_start is None:
                x = checkpoint(block, x, cos, sin, attn_mask, None, use_reentrant=False)
            else:
                x = block(x, cos, sin, attn_mask, cache_start)
            if fuse is not None:
                x = fuse(i, x)
            if taps:
                states.append(x)
        return (self.norm(x), torch.cat([states[i] for i in taps], dim=-1)) if taps else self.norm(x)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        cache_start: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens (B, T) -> (logits (B, T, V), loss or None).

        positions (B, T): RoPE positions, default 0..T-1 (or cache_start.. when cached).
        attn_mask (B, 1, T, K) bool, True = attend; None means causal with no padding.
        cache_start: write keys/values at these cache slots and attend over slots [0, cache_start+T).
        """
        logits = self.lm_head(self.hidden_states(tokens, positions=positions, attn_mask=attn_mask,
                                                 cache_start=cache_start))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1),
                                   ignore_index=IGNORE_INDEX)
        return logits, loss

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, attn_mask: torch.Tensor | None,
               cache_start: int) -> torch.Tensor:
        """One cached decoding step: tokens (B, 1) at cache slot `cache_start` -> next-token logits (B, V). The
        pass a decoder repeats per token, and the one `--compile` compiles (models/precision.compile_decode)."""
        h = self.hidden_states(tokens, positions=positions, attn_mask=attn_mask, cache_start=cache_start)
        return self.lm_head(h[:, -1])

    def extend(self, tokens: torch.Tensor, positions: torch.Tensor, attn_mask: torch.Tensor | None,
               cache_start: int, taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Several cached tokens (B, T) at slots [cache_start, cache_start + T) -> their final states (B, T, d_model)
        and the features at `taps` (as in `hidden_states`; the final states again without taps). A draft-and-verify
        decoder's prefill and verification passes; `--compile` compiles it next to `decode`."""
        out = self.hidden_states(tokens, positions=positions, attn_mask=attn_mask, cache_start=cache_start, taps=taps)
        return out if taps else (out, out)
