"""A block drafter for any diffar AR model: ReFusion's diffusion stream redesigned after DFlash
(z-lab/dflash, arXiv 2602.06036) — one denoising pass from a fully masked block to `block - 1` drafted tokens.

- Input: the block's first slot holds the token the target has just chosen (the anchor, clean); the other
  slots hold a learned mask embedding. Positions continue the text's, so RoPE is shared with the context.
- Context: the target's residual stream after several of its layers (`feature_layers`, spread through its
  depth), concatenated and fused by one linear map and a norm (`fc`, `context_norm`). Every draft layer's
  own key/value projections read the fused context next to the block itself, so the block attends to the
  whole text so far (as keys/values) and to itself bidirectionally; nothing is causal within the block.
- The target's token embedding and output layer are shared and frozen; only the draft layers, the fusion,
  the mask embedding and the norms train. `draft_vocab` > 0 restricts the output to the N most frequent
  tokens of the training data (FR-Spec): a smaller output matmul, and tokens outside it are never drafted.

The target is attached, not owned (`attach`): a drafter checkpoint holds the drafter's weights only and
names the AR checkpoint it drafts for, so shipping one for a 135M-parameter model costs a few tens of MB.

Training (`forward`): the frozen target runs the sequence once (`teacher`: its features and its greedy token
after each position; or they come precomputed, training/feature_cache.py); `anchors` random positions per
sequence each start a block, which sees the context before its anchor only; the label of slot j is the target's
own greedy choice there (what verification will accept), up to the first slot where the text leaves the target's
greedy chain (`on_chain`: so any text teaches it, not only the target's own), and slot j's cross-entropy is
weighted by exp(-(j - 1) / loss_decay): acceptance is a prefix, so early slots matter most (DFlash's decaying loss).
With `kl_weight` > 0 each slot also learns the target's distribution there, not only its argmax: KL from the
target's TEACHER_TOP likeliest tokens (renormalised) to the drafter, weighted alike. Its runners-up are what a
tree verifies next to the argmax, so the drafter's second choices should be the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from diffar.config import Config
from diffar.data.batching import IGNORE_INDEX
from diffar.errors import DiffarError
from diffar.models.packed_linear import PackedLinear, can_pack
from diffar.models.precision import draft_dtype, place
from diffar.models.transformer import Block, RMSNorm, Transformer, TransformerConfig, apply_rope, rope_angles

TEACHER_TOP = 8  # the target's likeliest tokens per position that the KL term reads

PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=1, block=4, anchors=4),  # tests
    "block": dict(n_layer=2, block=16, anchors=8),  # DFlash-style, sized for SmolLM2-135M on a CPU
}


def spread_layers(n_target: int, n: int = 3) -> tuple[int, ...]:
    """n target layers spread from the second to the fourth-last (DFlash's choice), fewer for shallow targets."""
    lo, hi = min(1, n_target - 1), max(min(1, n_target - 1), n_target - 4)
    picks = sorted({round(lo + i * (hi - lo) / max(n - 1, 1)) for i in range(n)})
    return tuple(picks)


@dataclass
class DrafterConfig(Config, presets=PRESETS, nested={"target": TransformerConfig}):
    target: TransformerConfig = field(default_factory=TransformerConfig)  # the AR model it drafts for
    n_layer: int = 2
    block: int = 16  # slots per pass: the anchor and block - 1 drafted tokens
    feature_layers: tuple[int, ...] | None = None  # target layers read as context; None: 3 spread (spread_layers)
    draft_vocab: int = 0  # 0: the target's whole vocabulary; N: its N most frequent training tokens
    anchors: int = 8  # training blocks per sequence
    loss_decay: float = 7.0  # slot j's loss weight is exp(-(j - 1) / loss_decay)
    kl_weight: float = 0.0  # + kl_weight * KL(the target's top TEACHER_TOP, renormalised || drafter) per slot
    preset: str = ""

    def __post_init__(self):
        if isinstance(self.target, dict):
            self.target = TransformerConfig.from_dict(self.target)
        if self.feature_layers is None:
            self.feature_layers = spread_layers(self.target.n_layer)
        self.feature_layers = tuple(self.feature_layers)
        super().__post_init__()

    def checks(self):
        return [
            (self.n_layer > 0, f"n_layer must be positive, got {self.n_layer}"),
            (self.block >= 2, f"block must hold the anchor and at least one draft, got {self.block}"),
            (self.anchors > 0, f"anchors must be positive, got {self.anchors}"),
            (0 <= self.draft_vocab <= self.target.vocab_size,
             f"draft_vocab must be in 0..{self.target.vocab_size}, got {self.draft_vocab}"),
            (bool(self.feature_layers) and all(0 <= i < self.target.n_layer for i in self.feature_layers),
             f"feature_layers {self.feature_layers} must name target layers in 0..{self.target.n_layer - 1}"),
            (self.loss_decay > 0, f"loss_decay must be positive, got {self.loss_decay}"),
            *self.nonnegative("kl_weight"),
        ]


def on_chain(text: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Which slots of blocks are labelled by the target's own chain: text (N, J) the text's next token and
    greedy (N, J) the target's greedy one after each of a block's J label positions -> (N, J), True up to and
    including the first slot where the text leaves the target's greedy chain.

    Verification keeps slot j's draft only if the drafts before it were the target's greedy tokens, so slot j's
    label is the target's choice after that chain. On the target's own greedy text (`distill data`) the chain
    is the text and every slot is labelled; on any other text the slots after the first disagreement would
    learn what the target says after tokens it would not have written, and are left out: any text then
    teaches the drafter exactly, at the cost of the labels past a disagreement (on Python source SmolLM2-135M
    agrees with 61 % of the tokens: 3.6 labelled slots of 15 per block)."""
    agree = (text == greedy) & (text != IGNORE_INDEX)  # no output there: no chain through it
    return torch.cat([torch.ones_like(agree[:, :1]), agree[:, :-1].long().cumprod(1).bool()], dim=1)


class ContextAttention(nn.Module):
    """Block queries over [context; block] keys/values, both made by the same projections (GQA as the target)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.kv = nn.Linear(cfg.d_model, 2 * cfg.n_kv_head * cfg.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, S, d) at the positions of cos/sin -> rotated keys and values (N, H_kv, S, head_dim)."""
        N, S, _ = x.shape
        k, v = self.kv(x).view(N, S, 2 * self.n_kv_head, self.head_dim).split(self.n_kv_head, dim=2)
        return apply_rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, cos, sin, context: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """x (N, L, d) the block; context: keys/values (N, H_kv, S, hd); mask (N, 1, 1 or L, S + L), True = see."""
        N, L, _ = x.shape
        q = apply_rope(self.q(x).view(N, L, self.n_head, self.head_dim), cos, sin).transpose(1, 2)
        k, v = self.keys_values(x, cos, sin)
        k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv_head != self.n_head)
        return self.proj(y.transpose(1, 2).reshape(N, L, -1))


class BlockDrafter(nn.Module):
    loss_is_nll = False  # a weighted sum over slots: no perplexity

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config, t = cfg, cfg.target
        self.fc = nn.Linear(len(cfg.feature_layers) * t.d_model, t.d_model, bias=False)
        self.context_norm = RMSNorm(t.d_model, t.norm_eps)
        self.mask_emb = nn.Parameter(torch.randn(t.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(t, ContextAttention) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(t.d_model, t.norm_eps)
        # the output rows it may draft (FR-Spec); set from the training data by `set_vocab`
        self.register_buffer("vocab", torch.arange(cfg.draft_vocab or t.vocab_size))
        self.loss_parts: dict[str, float] = {}
        self.target: Transformer | None = None
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def attach(self, target: Transformer) -> None:
        """Draft for `target` (frozen; kept outside this module's weights, so checkpoints hold the drafter only)."""
        if target.config.to_dict() != self.config.target.to_dict():
            raise DiffarError("this drafter was built for another AR model (its config differs)")
        self.__dict__["target"] = target.requires_grad_(False)
        self.__dict__["_head"] = None  # made again from this target's output layer

    def _apply(self, fn, recurse=True):
        """The attached target follows the drafter's moves (`.to(device)` in the trainer; dtype in `place`)."""
        if self.target is not None:
            self.target._apply(fn, recurse)
        return super()._apply(fn, recurse)

    def placed(self, dtype: str = "fp32", device: str = "cpu") -> BlockDrafter:
        """For inference: the target at `dtype` on `device` (precision.place), the drafter's own layers at
        `draft_dtype` (bf16 beside an fp32 target on most CPUs): its drafts are verified, whatever their precision."""
        target = self.target
        self.__dict__["target"] = None  # placed on its own (`_apply` would move it along)
        drafter = place(self, draft_dtype(dtype, device), device)
        drafter.attach(place(target, dtype, device))
        return drafter

    @torch.no_grad()
    def init_from_target(self) -> None:
        """Start each draft layer from one of the target's last layers (same shapes), a warm start."""
        for mine, theirs in zip(self.blocks, self.target.blocks[-len(self.blocks):]):
            q_width = theirs.attn.widths[0]
            mine.attn.q.weight.copy_(theirs.attn.qkv.weight[:q_width])
            mine.attn.kv.weight.copy_(theirs.attn.qkv.weight[q_width:])
            mine.attn.proj.weight.copy_(theirs.attn.proj.weight)
            mine.ffn.load_state_dict(theirs.ffn.state_dict())
            mine.attn_norm.load_state_dict(theirs.attn_norm.state_dict())
            mine.ffn_norm.load_state_dict(theirs.ffn_norm.state_dict())
        self.norm.load_state_dict(self.target.norm.state_dict())

    @torch.no_grad()
    def set_vocab(self, counts: torch.Tensor) -> float:
        """Draft over the `draft_vocab` most frequent tokens by `counts` (V,); returns the share of counted
        tokens inside that vocabulary."""
        if not self.config.draft_vocab:
            return 1.0
        top = counts.topk(self.config.draft_vocab).indices.sort().values
        self.vocab.copy_(top)
        self.__dict__["_head"] = None
        return float(counts[top].sum() / counts.sum().clamp(min=1))

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features at some positions (N, S, n_features * d) -> the fused context (N, S, d)."""
        return self.context_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each draft layer's keys/values of a fused context (N, S, d) at positions (N, S): a decoder caches them."""
        cos, sin = rope_angles(self.target.rope_cos, self.target.rope_sin, positions, context.dtype)
        return [block.attn.keys_values(context, cos, sin) for block in self.blocks]

    def draft_hidden(self, anchor: torch.Tensor, positions: torch.Tensor, kv: list[tuple], mask: torch.Tensor):
        """anchor (N,) tokens at positions (N,) -> the block's final states (N, block, d); kv from `context_kv`,
        mask (N, 1, 1, S) the context positions each block sees."""
        N, L = len(anchor), self.config.block
        x = self.mask_emb.expand(N, L, -1).clone()
        x[:, 0] = self.target.tok_emb(anchor.to(self.target.tok_emb.weight.device)).to(x.dtype)
        pos = (positions.unsqueeze(1) + torch.arange(L, device=positions.device)).clamp(
            max=self.target.config.max_seq_len - 1)  # slots past the context are never used
        cos, sin = rope_angles(self.target.rope_cos, self.target.rope_sin, pos, x.dtype)
        mask = torch.cat([mask, mask.new_ones(N, 1, 1, L)], dim=-1)
        for block, context in zip(self.blocks, kv):
            x = block(x, cos, sin, context, mask)
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft states (..., d) -> logits over the draft vocabulary (..., len(vocab)), by the target's output layer."""
        if torch.is_grad_enabled():  # training: a plain product the gradient flows through (a packed one has none)
            w = self.target.lm_head.weight
            return F.linear(h.to(w.dtype), w[self.vocab] if self.config.draft_vocab else w)
        head = self._draft_head()
        return head(h.to(head.weight.dtype))

    def _draft_head(self) -> nn.Module:
        """The target's output layer, or its draft-vocabulary rows as a layer of their own at the drafter's
        precision, made once for inference (packed for oneDNN where it can be)."""
        if not self.config.draft_vocab:
            return self.target.lm_head
        head = self.__dict__.get("_head")
        if head is None:
            w, dtype = self.target.lm_head.weight, self.norm.weight.dtype
            head = nn.Linear(w.shape[1], len(self.vocab), bias=False, device=w.device, dtype=dtype)
            head.weight = nn.Parameter(w[self.vocab].detach().to(dtype), requires_grad=False)
            head = PackedLinear(head) if can_pack(head.weight) else head
            self.__dict__["_head"] = head
        return head

    @torch.no_grad()
    def teacher(self, tokens: torch.Tensor, targets: torch.Tensor, top: int = 0) -> dict[str, torch.Tensor]:
        """All that training reads of the frozen target, from one pass over (B, T) sequences: its `features`
        (B, T, n_features * d) and its `greedy` token after each position (B, T), IGNORE_INDEX where `targets` is
        (nothing is output there); with `top` > 0 also its `top` likeliest tokens there, `top_ids` (B, T, top),
        and their log-probabilities `top_logp`. It depends on the sequence only, so it may be computed once and
        cached."""
        h, features = self.target.hidden_states(tokens, taps=self.config.feature_layers)
        greedy = torch.full_like(targets, IGNORE_INDEX)
        output = targets != IGNORE_INDEX
        logits = self.target.lm_head(h[output])
        greedy[output] = logits.argmax(-1)
        if not top:
            return {"features": features, "greedy": greedy}
        top_logp = torch.zeros(*targets.shape, top, device=tokens.device)
        top_ids = torch.full((*targets.shape, top), IGNORE_INDEX, dtype=torch.long, device=tokens.device)
        top_logp[output], top_ids[output] = torch.log_softmax(logits.float(), -1).topk(top, -1)
        return {"features": features, "greedy": greedy, "top_logp": top_logp, "top_ids": top_ids}

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, features: torch.Tensor | None = None,
                greedy: torch.Tensor | None = None, top_logp: torch.Tensor | None = None,
                top_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced training pass over (B, T) sequences -> (draft logits at the scored slots, loss).
        `features`, `greedy` (and, for the KL term, `top_logp`, `top_ids`): the target's `teacher` outputs for
        these sequences, if computed before."""
        if self.target is None:
            raise DiffarError("attach the target AR model before training the drafter")
        cfg, (B, T), dev = self.config, tokens.shape, tokens.device
        if features is None or greedy is None or (cfg.kl_weight and top_ids is None):
            teacher = self.teacher(tokens, targets, TEACHER_TOP if cfg.kl_weight else 0)
            features, greedy = teacher["features"], teacher["greedy"]
            top_logp, top_ids = teacher.get("top_logp"), teacher.get("top_ids")
        L = cfg.block
        # anchor s: the block holds token s (clean) and drafts s+1..s+L-1; it sees context positions < s.
        # Anchors sit where the loss applies (targets[s - 1] known: token s is output), s >= 1.
        known = torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=dev), targets[:, :-1] != IGNORE_INDEX], 1)
        if not known.any(1).all():
            raise DiffarError("a training sequence has no output tokens to draft")
        s = torch.multinomial(known.float(), cfg.anchors, replacement=True).reshape(-1)  # (N,)
        rows = torch.arange(B, device=dev).repeat_interleave(cfg.anchors)
        context = self.context(features)  # (B, T, d)
        kv = [(k[rows], v[rows]) for k, v in self.context_kv(context, torch.arange(T, device=dev).expand(B, T))]
        sees = (torch.arange(T, device=dev).unsqueeze(0) < s.unsqueeze(1)).view(-1, 1, 1, T)
        out = self.draft_hidden(tokens[rows, s], s, kv, sees)[:, 1:]  # (N, L - 1, d)
        # slot j's label: the target's greedy token after position s + j - 1, where that is output and the
        # text's tokens s + 1 .. s + j - 1 are the target's own greedy chain from s (`on_chain`)
        at = s.unsqueeze(1) + torch.arange(L - 1, device=dev)  # (N, L - 1)
        label_at = rows.unsqueeze(1), at.clamp(max=T - 1)
        text, chain = targets[label_at], greedy[label_at]
        inside = (at < T) & (text != IGNORE_INDEX) & on_chain(text, chain)
        greedy = self._in_vocab(chain[inside])
        logits = self.logits(out[inside]).float()
        weight = torch.exp(-torch.arange(L - 1, device=dev, dtype=torch.float) / cfg.loss_decay).expand(len(s), -1)
        weight = weight[inside] * (greedy != IGNORE_INDEX)
        ce = F.cross_entropy(logits, greedy.clamp(min=0), reduction="none")
        loss = (ce * weight).sum() / weight.sum().clamp(min=1e-6)
        hits = torch.zeros_like(inside, dtype=torch.float)
        hits[inside] = (logits.argmax(-1) == greedy).float()
        self.loss_parts = {"slot1_acc": float(hits[:, 0].sum() / inside[:, 0].sum().clamp(min=1)),
                           "accepted": float(hits.cumprod(1).sum(1).mean())}  # drafts a chain would keep
        if cfg.kl_weight:
            kl = self._kl(logits, top_logp[label_at][inside], self._in_vocab(top_ids[label_at][inside]))
            kl = (kl * weight).sum() / weight.sum().clamp(min=1e-6)
            self.loss_parts.update(ce=loss.item(), kl=kl.item())
            loss = loss + cfg.kl_weight * kl
        return logits, loss

    def _in_vocab(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids -> their rows in the draft vocabulary (IGNORE_INDEX outside it)."""
        if not self.config.draft_vocab:
            return ids
        index = torch.full((self.target.config.vocab_size,), IGNORE_INDEX, dtype=torch.long, device=ids.device)
        index[self.vocab] = torch.arange(len(self.vocab), device=ids.device)
        return index[ids]

    @staticmethod
    def _kl(logits: torch.Tensor, top_logp: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
        """KL(p || q) per row: p the target's top tokens (M, K) renormalised over those the drafter can draft
        (top_ids not IGNORE_INDEX), q the drafter's distribution (M, V)."""
        draftable = top_ids != IGNORE_INDEX
        log_p = torch.log_softmax(top_logp.masked_fill(~draftable, -1e9), -1)
        log_q = torch.log_softmax(logits, -1).gather(1, top_ids.clamp(min=0))
        return (log_p.exp() * (log_p - log_q)).masked_fill(~draftable, 0).sum(-1)
