"""Lossless draft-and-verify decoding (speculative decoding): a cheap proposer drafts k tokens, the target
model scores them all in one cached forward pass, and the longest acceptable prefix plus one token of the
target's own is kept (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318).

Greedy: the output equals plain greedy AR, token for token. Sampling: the accept / resample-the-residual
rule makes the output distribution exactly the target's. Rejected drafts are rolled back for free: their
cache slots are simply written over by the next verification.

Proposers: a small AR draft model with its own KV cache, or prompt lookup — n-gram copies from the text so
far, the trivial peer for input-grounded tasks (Saxena 2023, "Prompt Lookup Decoding").
Batch size 1: each row accepts a different number of drafts per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diffar.decoding.ar import Batch, check_lengths, prefill
from diffar.decoding.sampling import SamplingConfig, probabilities, sample_next
from diffar.models.transformer import Transformer


@dataclass
class SpeculativeResult:
    tokens: list[int]  # new tokens, eos excluded
    prompt_tokens: int
    target_passes: int  # prefill + one verification per step
    draft_passes: int
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens kept
    seconds: float

    @property
    def tokens_per_target_pass(self) -> float:
        return len(self.tokens) / self.target_passes

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("inf")


def _feed(model: Transformer, tokens: list[int], start: int) -> torch.Tensor:
    """Run `tokens` at cache slots [start, start+len) of a one-row, unpadded cache; logits (len, V)."""
    one_row = Batch(torch.tensor([tokens]), torch.zeros(1, dtype=torch.long))
    logits, _ = model(one_row.tokens, positions=one_row.positions(start, len(tokens)),
                      attn_mask=one_row.attn_mask(start, len(tokens)), cache_start=start)
    return logits[0]


class DraftModel:
    """Drafts with a small AR model of the same tokenizer, keeping its own KV cache in step with the text."""

    def __init__(self, model: Transformer):
        self.model, self.cached, self.passes = model, 0, 0

    def start(self, max_len: int) -> None:
        self.model.setup_cache(1, max_len)
        self.cached, self.passes = 0, 0

    def propose(self, seq: list[int], k: int, sampling: SamplingConfig, generator) -> tuple[list[int], list]:
        """k drafts following `seq`, with the distributions they were drawn from (None when greedy)."""
        logits = _feed(self.model, seq[self.cached:], self.cached)[-1]
        self.cached, self.passes = len(seq), self.passes + 1
        drafts, dists = [], []
        for i in range(k):
            if sampling.greedy:
                token, dist = int(logits.argmax()), None
            else:
                dist = probabilities(logits.unsqueeze(0), sampling)[0]
                token = int(torch.multinomial(dist, 1, generator=generator))
            drafts.append(token)
            dists.append(dist)
            if i < k - 1:
                logits = _feed(self.model, [token], self.cached)[-1]
                self.cached, self.passes = self.cached + 1, self.passes + 1
        return drafts, dists

    def keep(self, valid: int) -> None:
        """Only the first `valid` tokens of the text are still right; later cache slots get rewritten."""
        self.cached = min(self.cached, valid)


class PromptLookup:
    """Drafts by copying what followed the latest earlier occurrence of the text's last n-gram."""

    passes = 0  # drafting costs no forward pass

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, max_len: int) -> None:
        pass

    def propose(self, seq: list[int], k: int, sampling: SamplingConfig, generator) -> tuple[list[int], list]:
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start:start + n] == tail:
                    drafts = seq[start + n:start + n + k]
                    return drafts, [None] * len(drafts)  # a copy is certain: q is one-hot
        return [], []

    def keep(self, valid: int) -> None:
        pass


def accept(logits: torch.Tensor, drafts: list[int], dists: list, sampling: SamplingConfig,
           generator: torch.Generator | None = None) -> tuple[int, int]:
    """Verify drafts against the target's logits (len(drafts)+1, V).

    Returns (how many drafts are accepted, the target's own next token). Greedy: a draft stands if it is
    the target's argmax. Sampling: draft d with proposal q is kept with probability min(1, p(d)/q(d));
    at the first rejection the token is drawn from the residual max(0, p - q), renormalised; after all
    are kept, the bonus token is drawn from p. A one-hot q (None) is a deterministic copy.
    """
    if sampling.greedy:
        for i, d in enumerate(drafts):
            if int(logits[i].argmax()) != d:
                return i, int(logits[i].argmax())
        return len(drafts), int(logits[len(drafts)].argmax())
    p = probabilities(logits, sampling)
    for i, (d, q) in enumerate(zip(drafts, dists)):
        q_d = 1.0 if q is None else float(q[d])
        if float(torch.rand((), generator=generator)) * q_d < float(p[i, d]):
            continue
        residual = p[i].clone()
        if q is None:
            residual[d] = 0.0
        else:
            residual = (residual - q).clamp(min=0.0)
        if float(residual.sum()) <= 0:  # p == q exactly: any draw from p is right
            residual = p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator))


@torch.inference_mode()
def speculative_generate(
    target: Transformer,
    proposer: DraftModel | PromptLookup,
    prompt: list[int],
    max_new_tokens: int,
    *,
    k: int,
    eos_id: int | None,
    sampling: SamplingConfig = SamplingConfig(),
    generator: torch.Generator | None = None,
    on_token: Callable[[int, int], object] | None = None,
) -> SpeculativeResult:
    """Draft-and-verify generation for one prompt; `on_token(0, token)` streams accepted tokens."""
    if k <= 0:
        raise ValueError(f"draft length k must be positive, got {k}")
    check_lengths(target, [prompt], max_new_tokens)
    t0 = time.perf_counter()
    max_len = len(prompt) + max_new_tokens
    target.setup_cache(1, max_len)
    proposer.start(max_len)
    seq, out = list(prompt), []
    token = int(sample_next(prefill(target, Batch.from_prompts([prompt], 0)), sampling, generator)[0])
    passes, drafted, accepted_total = 1, 0, 0

    def emit(t: int) -> bool:
        """Append a token; False once generation is over (eos or the budget)."""
        if t == eos_id:
            return False
        out.append(t)
        seq.append(t)
        if on_token:
            on_token(0, t)
        return len(out) < max_new_tokens

    while emit(token):
        # the target's cache holds seq[:-1]; seq[-1] is the token to feed next
        drafts, dists = proposer.propose(seq, min(k, max_new_tokens - len(out)), sampling, generator)
        logits = _feed(target, [seq[-1]] + drafts, len(seq) - 1)
        passes, drafted = passes + 1, drafted + len(drafts)
        n_ok, token = accept(logits, drafts, dists, sampling, generator)
        accepted_total += n_ok
        if not all(emit(d) for d in drafts[:n_ok]):
            break
        proposer.keep(len(seq))
    return SpeculativeResult(out, len(prompt), passes, proposer.passes, drafted, accepted_total,
                             time.perf_counter() - t0)
