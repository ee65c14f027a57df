"""ReFusion decoding: the diffusion stream drafts a block, the AR stream verifies it (lossless).

The drafter reads the AR stream's hidden states, which the verifier keeps per cache slot next to its KV
cache (the cache mechanism of the ReFusion seed post, seeds/refusion.zh.txt: nothing is recomputed to
draft). From pure noise it denoises a block of `block` token embeddings after the AR stream's own latest
token in `steps` DDIM steps (one by default) and rounds them to tokens; `speculative_generate` verifies
them, so greedy output equals plain AR greedy and sampled output follows the AR distribution, whatever
the drafts.

That post's dynamic schedule decides per row how hard to draft: `full_steps` denoising steps in the first
20 % of the output, 1..`mid_steps` by the last draft's confidence up to 70 %, then none (pure AR); rows
whose prompt has fewer than 15 words are decoded by the AR stream alone.

Plan-and-infill (after ReFusion, arXiv 2512.13586): a draft is cut into slots of `plan_slot` contiguous tokens
(the paper's granularity; 1 plans token by token). The diffusion stream plans the slots it is confident of
(every token's max probability >= `plan_threshold`) and keeps them without verification; in the same pass
the AR stream infills the other slots token by token, each token conditioned on the block before it, and
the block ends at the first infilled token that disagrees with its draft. Faster, and no longer lossless:
quality is measured against the references, not assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffar.decoding.datastore import Datastore
from diffar.decoding.sampling import SamplingConfig, probabilities
from diffar.decoding.result import GenerationResult
from diffar.decoding.speculative import DecodeState, Draft, PromptLookup, WithPromptLookup, speculative_generate
from diffar.decoding.tree import best_first
from diffar.diffusion.scheduler import DDIMScheduler
from diffar.errors import DiffarError
from diffar.models.refusion import RefusionModel, TextDiffuser


@dataclass(frozen=True)
class DraftSchedule:
    steps: int = 1  # denoising steps per draft (lossless mode)
    dynamic: bool = False  # the ReFusion seed post's schedule below instead
    early: float = 0.2  # share of the output drafted with full_steps
    late: float = 0.7  # share after which decoding is pure AR
    full_steps: int = 4
    mid_steps: int = 2  # the most steps in the middle phase (1 when the last draft was confident)
    min_prompt_words: int = 15  # dynamic: prompts of fewer words are decoded by the AR stream alone
    plan_threshold: float | None = None  # plan-and-infill: keep drafts this confident unverified (lossy)
    plan_slot: int = 1  # plan-and-infill: tokens per slot, planned (kept) or infilled as a whole
    tree: int = 0  # > 0: verify a tree of this many likeliest drafts (decoding/tree.py) instead of one chain
    lookup: bool = False  # prompt lookup's copies join the drafts as free tree candidates (WithPromptLookup)

    def __post_init__(self):
        if min(self.steps, self.full_steps, self.mid_steps) <= 0:
            raise DiffarError("denoising steps must be positive")
        if not 0 <= self.early <= self.late <= 1:
            raise DiffarError(f"schedule thresholds must satisfy 0 <= early <= late <= 1, got {self.early}, "
                              f"{self.late}")
        if self.plan_threshold is not None and not 0 < self.plan_threshold <= 1:
            raise DiffarError(f"the plan-and-infill threshold must be in (0, 1], got {self.plan_threshold}")
        if self.plan_slot <= 0:
            raise DiffarError(f"the plan-and-infill slot must be at least 1 token, got {self.plan_slot}")
        if self.tree < 0:
            raise DiffarError(f"a draft tree needs a node budget >= 0, got {self.tree}")
        if (self.tree or self.lookup) and self.plan_threshold is not None:
            raise DiffarError("plan-and-infill keeps chain drafts unverified: it cannot join a tree or prompt lookup")

    def steps_for(self, progress: float, confidence: float) -> int:
        """Denoising steps for a row `progress` of the way through its output (0: do not draft)."""
        if not self.dynamic:
            return self.steps
        if progress < self.early:
            return self.full_steps
        if progress < self.late:
            return 1 + round((self.mid_steps - 1) * (1 - confidence))
        return 0


def plan_slots(confidence: torch.Tensor, threshold: float, slot: int) -> list[bool]:
    """Plan-and-infill's plan for one draft (confidence (k,)): per token, whether its slot of `slot` tokens
    (the last one may be shorter) is kept unverified, i.e. every token in the slot is >= `threshold` sure."""
    ok = confidence >= threshold
    whole = torch.cat([ok, ok.new_ones(-len(ok) % slot)]).view(-1, slot).all(1)
    return whole.repeat_interleave(slot)[:len(ok)].tolist()


def denoise_block(diffuser: TextDiffuser, context: torch.Tensor, context_mask: torch.Tensor,
                  kv: dict[str, tuple], anchor: torch.Tensor, noise: torch.Tensor, steps: int,
                  table: torch.Tensor | None = None, domain: torch.Tensor | None = None) -> torch.Tensor:
    """DDIM from pure noise (N, block, d) to token logits (N, block, V); the context as in TextDiffuser.
    The anchor slot holds the token each row's block follows (N,), clean; intermediate predictions snap to
    their nearest token embedding (Diffusion-LM's clamping) before being re-noised. `table`: the embedding
    table to round against (`TextDiffuser.logits`); `domain` (N,): each row's, for a stream with a domain adapter."""
    scheduler = DDIMScheduler(diffuser.schedule, prediction="x0")
    scheduler.set_timesteps(steps)
    anchor = diffuser.embed(anchor).unsqueeze(1)
    z = noise
    for t in scheduler.timesteps.tolist():
        times = torch.full((len(z), z.shape[1] + 1), t, device=z.device)
        times[:, 0] = 0.0
        x0 = diffuser(torch.cat([anchor, z], dim=1), times, context, context_mask, kv=kv, domain=domain)[:, 1:]
        logits = diffuser.logits(x0, table)
        if scheduler.next_time(t) > 0:
            z = scheduler.step(diffuser.embed(logits.argmax(-1)), t, z)
    return logits


class DiffusionDrafter:
    """A proposer for `speculative_generate`: ReFusion's diffusion stream (drafting for `domain`, an index into the
    model's domains, where it has a domain adapter)."""

    name = "diffusion"
    needs_hidden, taps = True, ()

    def __init__(self, model: RefusionModel, schedule: DraftSchedule = DraftSchedule(),
                 prompt_words: list[int] | None = None, domain: int | None = None):
        if not model.lossless:
            raise DiffarError("this ReFusion model's AR stream reads the diffusion stream (AR-side fusion), so its "
                              "drafts would change the text: lossless decoding needs ar_fusion_layers = ()")
        self.model, self.schedule, self.prompt_words, self.domain = model, schedule, prompt_words, domain
        self.tree = schedule.tree
        self.passes = 0
        # Rounding a block against the 8k-row table is the stream's largest matmul; in bf16 it runs several
        # times faster on CPUs with bf16 dot products, and a draft's precision cannot change the verified text.
        self.table = model.diffuser.tok_emb.weight.to(torch.bfloat16)

    def start(self, batch_size: int, max_len: int) -> None:
        self.passes, self.confidence = 0, [1.0] * batch_size
        self.noise = torch.Generator().manual_seed(0)  # drafts are reproducible; verification decides anyway
        self.kv: dict[str, tuple] = {}  # the fusion layers' keys/values per cache slot, filled up to kv_upto
        self.kv_upto, self.kv_compactions = 0, 0

    def _update_kv(self, state: DecodeState) -> None:
        """Compute the fusion keys/values of the slots written since the last draft (all after a compaction).
        A valid slot's features never change: its AR state, its token and the token after it are final."""
        if state.compactions != self.kv_compactions:
            self.kv_upto, self.kv_compactions = 0, state.compactions
        lo, hi = self.kv_upto, state.write
        if hi <= lo:
            return
        B = len(state.seqs)
        tokens = torch.zeros(B, hi - lo, 2, dtype=torch.long)
        for r, seq in enumerate(state.seqs):  # the valid slots hold seq[:-1] in order
            if state.done[r]:  # never drafts again
                continue
            valid = state.valid[r, lo:hi]
            first = int(state.valid[r, :lo].sum())
            n = int(valid.sum())
            if n:
                seq_t = torch.tensor(seq[first:first + n + 1])
                tokens[r, valid] = torch.stack([seq_t[:-1], seq_t[1:]], dim=-1)
        new = self.model.diffuser.context_kv(state.hidden[:, lo:hi], tokens.to(state.hidden.device))
        for i, (k, v) in new.items():
            if i not in self.kv:
                shape = (B, k.shape[1], state.valid.shape[1], k.shape[3])
                self.kv[i] = (k.new_zeros(shape), v.new_zeros(shape))
            self.kv[i][0][:, :, lo:hi], self.kv[i][1][:, :, lo:hi] = k, v
        self.kv_upto = hi

    def propose(self, state: DecodeState, k: int, sampling: SamplingConfig, generator) -> list[Draft]:
        B, schedule = len(state.seqs), self.schedule
        steps = [0 if state.done[r] or (schedule.dynamic and self.prompt_words
                                        and self.prompt_words[r] < schedule.min_prompt_words)
                 else schedule.steps_for(state.progress(r), self.confidence[r]) for r in range(B)]
        rows = [r for r in range(B) if steps[r] > 0]
        out = [Draft([]) for _ in range(B)]
        if not rows:
            return out
        d = self.model.diffuser
        index = torch.tensor(rows)
        noise = torch.randn(len(rows), self.model.config.block, d.d_model, generator=self.noise).to(d.tok_emb.weight)
        anchor = torch.tensor([state.seqs[r][-1] for r in rows], device=noise.device)
        self._update_kv(state)
        w = state.write
        kv = {i: (k[index, :, :w], v[index, :, :w]) for i, (k, v) in self.kv.items()}
        domain = None if self.domain is None else torch.full((len(rows),), self.domain, device=noise.device)
        logits = denoise_block(d, state.hidden[index, :w], state.valid[index, :w].to(noise.device), kv, anchor, noise,
                               max(steps), self.table, domain)[:, :k].float()
        self.passes += max(steps)
        confidence = torch.softmax(logits, -1).amax(-1) if schedule.dynamic or schedule.plan_threshold else None
        for i, r in enumerate(rows):
            if schedule.tree:  # every node's token is verified as the target's own choice, greedy or sampled
                tokens, parents = best_first(torch.softmax(logits[i], -1), schedule.tree)
                draft = Draft(tokens, parents=parents)
            elif sampling.greedy:
                draft = Draft(logits[i].argmax(-1).tolist())
            else:
                q = probabilities(logits[i], sampling)
                draft = Draft(torch.multinomial(q, 1, generator=generator).squeeze(1).tolist(), list(q))
            if schedule.dynamic:
                self.confidence[r] = float(confidence[i].mean())
            if schedule.plan_threshold:
                draft.planned = plan_slots(confidence[i], schedule.plan_threshold, schedule.plan_slot)
            out[r] = draft
        return out


def refusion_generate(model: RefusionModel, prompts: list[list[int]], max_new_tokens: int, *, k: int | None = None,
                      eos_id: int | None, schedule: DraftSchedule = DraftSchedule(),
                      prompt_words: list[int] | None = None, pad_id: int = 0,
                      sampling: SamplingConfig = SamplingConfig(),
                      generator: torch.Generator | None = None, on_token=None,
                      adaptive: bool = True, fixed: list[dict[int, int]] | None = None,
                      domain: int | None = None, datastore: Datastore | None = None) -> GenerationResult:
    """ReFusion decoding of a batch, lossless unless `schedule.plan_threshold` is set; k (default: the model's
    block) caps the drafts verified per AR pass. `on_token`, `fixed` (pinned tokens) and `pad_id` as in
    `speculative_generate`; `domain`: the domain the stream drafts for (an index into its domains); `datastore`:
    where `schedule.lookup`'s prompt lookup also drafts from."""
    k = model.config.block if k is None else k
    if k > model.config.block:
        raise DiffarError(f"block size {k} exceeds the {model.config.block} tokens this model drafts per pass")
    proposer = DiffusionDrafter(model, schedule, prompt_words, domain)
    if schedule.lookup:
        proposer = WithPromptLookup(proposer, k, PromptLookup(datastore=datastore))
    return speculative_generate(model.ar, proposer, prompts, max_new_tokens, k=k, eos_id=eos_id, pad_id=pad_id,
                                sampling=sampling, generator=generator, on_token=on_token, adaptive=adaptive,
                                fixed=fixed)
