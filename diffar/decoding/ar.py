"""Autoregressive decoding with a preallocated KV cache, one small function per phase (as gpt-fast):
`prefill` -> `decode_one_token` -> `decode_n_tokens`; `generate` composes them.

Batches are left-padded: cache slot s of row b holds prompt/generated token s - pad[b], so every row
decodes at the same slot while its RoPE positions and attention ignore its padding. A batched run is
therefore the same computation as running each prompt alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diffar.data.batching import pad_right
from diffar.decoding.result import AR, PINNED, GenerationResult, written_by
from diffar.decoding.sampling import SamplingConfig, sample_coupled, sample_next
from diffar.errors import DiffarError
from diffar.models.precision import model_device
from diffar.models.transformer import Transformer

# (row, token id, who wrote it: decoding/result.py's origins), called as each token is produced; returning False
# stops that row (a stop string, its own token budget, a client that went away) while the other rows go on.
TokenCallback = Callable[[int, int, str], bool | None]


@dataclass
class Batch:
    """Left-padded prompts and where each row's real tokens start."""

    tokens: torch.Tensor  # (B, T)
    pad: torch.Tensor  # (B,)

    @classmethod
    def from_prompts(cls, prompts: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> Batch:
        """On `device`: the model's, so that positions and masks are made where the model reads them."""
        width = max(len(p) for p in prompts)
        tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        for row, p in enumerate(prompts):
            tokens[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        return cls(tokens.to(device), torch.tensor([width - len(p) for p in prompts], device=device))

    @property
    def padded(self) -> bool:
        return bool(self.pad.any())

    def positions(self, start: int, length: int) -> torch.Tensor:
        """RoPE positions (B, length) of cache slots [start, start+length)."""
        steps = torch.arange(start, start + length, device=self.pad.device)
        return (steps.unsqueeze(0) - self.pad.unsqueeze(1)).clamp(min=0)

    def attn_mask(self, start: int, length: int) -> torch.Tensor | None:
        """(B, 1, length, start+length) bool: causal, blind to padding. None when plain causal attention
        does the same: nothing padded, and either one new token or no cached ones before these."""
        if not self.padded and (length == 1 or start == 0):
            return None
        q = torch.arange(start, start + length, device=self.pad.device).view(1, -1, 1)
        k = torch.arange(start + length, device=self.pad.device).view(1, 1, -1)
        real = k >= self.pad.view(-1, 1, 1)
        # A padding query attends to itself only, so its (unused) output stays finite.
        return ((k <= q) & (real | (k == q))).unsqueeze(1)


def check_lengths(model: Transformer, prompts: list[list[int]], max_new_tokens: int) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise DiffarError("empty prompt: give at least one token of text")
    if max_new_tokens <= 0:
        raise DiffarError(f"max_new_tokens must be positive, got {max_new_tokens}")
    longest, ctx = max(len(p) for p in prompts), model.config.max_seq_len
    if longest + max_new_tokens > ctx:
        raise DiffarError(
            f"prompt ({longest} tokens) + max new tokens ({max_new_tokens}) exceeds the model's context of {ctx}"
        )


def prefill(model: Transformer, batch: Batch) -> torch.Tensor:
    """Run the prompts through the model, filling cache slots [0, T). Returns last-position logits (B, V)."""
    T = batch.tokens.shape[1]
    logits, _ = model(batch.tokens, positions=batch.positions(0, T), attn_mask=batch.attn_mask(0, T), cache_start=0)
    return logits[:, -1]


def decode_one_token(model: Transformer, batch: Batch, token: torch.Tensor, slot: int) -> torch.Tensor:
    """Feed one token per row (B,) at cache slot `slot`. Returns next-token logits (B, V)."""
    return model.decode(token.unsqueeze(1), batch.positions(slot, 1), batch.attn_mask(slot, 1), slot)


def decode_n_tokens(
    model: Transformer,
    batch: Batch,
    logits: torch.Tensor,
    n: int,
    sampling: SamplingConfig,
    eos_id: int | None,
    on_token: TokenCallback | None = None,
    generator: torch.Generator | None = None,
    step: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    fixed: list[dict[int, int]] | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[list[list[int]], int, list[bool]]:
    """Sample up to n tokens per row from `logits` onwards; rows stop independently at eos.

    `step(token, slot)` produces the next logits; the default is `decode_one_token` on the KV cache.
    `fixed[row]` maps output positions to tokens a person pinned: those are emitted instead of sampled,
    and decoding continues from them. `noise` (B, n) standard normal, if given, determines each sampled
    token instead of `generator` (`sample_coupled`). Returns (new tokens per row, forward passes made, the
    rows that ended at eos).
    """
    step = step or (lambda token, slot: decode_one_token(model, batch, token, slot))
    B, slot = batch.tokens.shape
    out: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool)
    ended = [False] * B
    passes = 0
    last_pin = [max(pins, default=-1) for pins in (fixed or ())]
    for i in range(n):
        if eos_id is not None and any(p > i for p in last_pin):
            logits = logits.clone()  # a row may not end before the tokens pinned further on
            for row, p in enumerate(last_pin):
                if p > i:
                    logits[row, eos_id] = float("-inf")
        token = sample_next(logits, sampling, generator) if noise is None else \
            sample_coupled(logits, sampling, noise[:, i])
        pinned = [row for row, pins in enumerate(fixed or ()) if i in pins]
        for row in pinned:
            token[row] = fixed[row][i]
        for row in range(B):
            if done[row]:
                continue
            t = int(token[row])
            if t == eos_id:
                done[row] = ended[row] = True
                continue
            out[row].append(t)
            if on_token and on_token(row, t, PINNED if row in pinned else AR) is False:
                done[row] = True
        if bool(done.all()) or i == n - 1:
            break
        logits = step(token, slot + i)
        passes += 1
    return out, passes, ended


def _uncached_step(model: Transformer, batch: Batch) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """A `decode_n_tokens` step that recomputes the whole sequence every token (the no-cache baseline)."""
    seq = batch.tokens

    def step(token: torch.Tensor, slot: int) -> torch.Tensor:
        nonlocal seq
        seq = torch.cat([seq, token.unsqueeze(1)], dim=1)
        T = seq.shape[1]
        logits, _ = model(seq, positions=batch.positions(0, T), attn_mask=batch.attn_mask(0, T))
        return logits[:, -1]

    return step


@torch.inference_mode()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    pad_id: int,
    eos_id: int | None,
    sampling: SamplingConfig = SamplingConfig(),
    on_token: TokenCallback | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    fixed: list[dict[int, int]] | None = None,
    noise: torch.Tensor | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` after each prompt (a list of token ids per row); see
    `decode_n_tokens` for `fixed` (pinned tokens) and `noise` (the tokens a given noise determines)."""
    check_lengths(model, prompts, max_new_tokens)
    if noise is not None and tuple(noise.shape) != (len(prompts), max_new_tokens):
        raise DiffarError(f"noise must be (rows, new tokens) = ({len(prompts)}, {max_new_tokens}), "
                          f"got {tuple(noise.shape)}")
    batch = Batch.from_prompts(prompts, pad_id, model_device(model))
    t0 = time.perf_counter()
    if use_cache:
        model.setup_cache(len(prompts), batch.tokens.shape[1] + max_new_tokens)
        logits = prefill(model, batch)
        step = None
    else:
        T = batch.tokens.shape[1]
        logits = model(batch.tokens, positions=batch.positions(0, T), attn_mask=batch.attn_mask(0, T))[0][:, -1]
        step = _uncached_step(model, batch)
    tokens, passes, ended = decode_n_tokens(model, batch, logits, max_new_tokens, sampling, eos_id, on_token,
                                            generator, step, fixed, noise)
    return GenerationResult(tokens, time.perf_counter() - t0, {"target": passes + 1}, ended,
                            origins=written_by(tokens, AR, fixed))


@torch.inference_mode()
def log_likelihoods(model: Transformer, prompts: list[list[int]], outputs: list[list[int]],
                    pad_id: int = 0) -> torch.Tensor:
    """Teacher-forced scoring: log p(output | prompt) summed over each row's output tokens (B,), every row
    in one causal pass over prompt + output (but its last token), right-padded (a causal position never
    sees the padding after it). The output layer runs only at the positions that predict an output token."""
    if len(prompts) != len(outputs):
        raise DiffarError(f"{len(prompts)} prompts but {len(outputs)} outputs to score")
    if any(not p for p in prompts):
        raise DiffarError("empty prompt: give at least one token of text")
    seqs = [p + o for p, o in zip(prompts, outputs)]
    if max(map(len, seqs)) - 1 > model.config.max_seq_len:
        raise DiffarError(f"prompt + output exceeds the model's context of {model.config.max_seq_len} tokens")
    ids, _ = pad_right(seqs, pad_id)
    device = model_device(model)
    hidden = model.hidden_states(ids[:, :-1].to(device))
    rows = torch.tensor([r for r, o in enumerate(outputs) for _ in o], dtype=torch.long)
    cols = torch.tensor([len(p) + j for p, o in zip(prompts, outputs) for j in range(len(o))], dtype=torch.long)
    logits = model.lm_head(hidden[rows, cols - 1]).float()
    nll = torch.nn.functional.cross_entropy(logits, ids[rows, cols].to(device), reduction="none")
    return -torch.zeros(len(outputs), device=device).index_add_(0, rows.to(device), nll).cpu()
