"""Lossless draft-and-verify decoding (speculative decoding): a cheap proposer drafts up to k tokens per row,
the target model scores them all in one cached forward pass, and the longest acceptable prefix plus one token
of the target's own is kept (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318).

Greedy: the output equals plain greedy AR, token for token. Sampling: the accept / resample-the-residual
rule makes the output distribution exactly the target's.

Batched, with per-row progress: every row's block is written at the same cache slots, and each row marks
the slots it accepted as valid. Rejected drafts stay behind as invalid slots that attention skips, which
rolls them back without recomputing anything; when the cache fills up, `DecodeState.compact` squeezes the
invalid slots out. Proposers: prompt lookup (n-gram copies from the text so far, the trivial peer for
input-grounded tasks), a small AR draft model (batch 1), and ReFusion's diffusion stream
(diffar/decoding/refusion.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from diffar.decoding.ar import Batch, TokenCallback, check_lengths
from diffar.decoding.datastore import Datastore
from diffar.decoding.result import AR, DRAFT, PINNED, GenerationResult
from diffar.decoding.sampling import SamplingConfig, probabilities, sample_next
from diffar.decoding.tree import ancestor_mask, chain, depths, graft, walk
from diffar.errors import DiffarError
from diffar.models.transformer import Transformer



@dataclass
class Draft:
    """One row's proposal: a chain of tokens, or a tree of them (`parents`, as in decoding/tree.py)."""

    tokens: list[int]
    dists: list | None = None  # the distribution each token was drawn from; None: greedy, or a certain copy
    planned: list[bool] | None = None  # tokens kept without verification (plan-and-infill: not lossless)
    parents: list[int] | None = None  # a tree: node i + 1 holds tokens[i] under node parents[i]; None: a chain

    def shape(self) -> list[int]:
        """Its nodes' parents as a tree (a chain's, for a chain)."""
        return chain(len(self.tokens)) if self.parents is None else self.parents

    def within(self, n: int) -> Draft:
        """The draft cut to its first n positions (a tree: its nodes at depth <= n)."""
        if self.parents is None:
            return Draft(self.tokens[:n], self.dists and self.dists[:n], self.planned and self.planned[:n])
        depth = depths(self.parents)
        keep = [i for i in range(1, len(depth)) if depth[i] <= n]
        renumber = {0: 0, **{old: new for new, old in enumerate(keep, start=1)}}
        return Draft([self.tokens[i - 1] for i in keep], parents=[renumber[self.parents[i - 1]] for i in keep])


@dataclass
class DecodeState:
    """Where a batch stands. Row b's text is seqs[b]: its prompt and output so far, all in the cache but
    the last token (fed with the next block). Cache slot s of row b holds one of its tokens iff valid[b, s]."""

    seqs: list[list[int]]
    prompt_lengths: list[int]
    max_new_tokens: int
    valid: torch.Tensor  # (B, slots) bool
    hidden: torch.Tensor | None  # (B, slots, width) the target states a drafter reads (see `run`), or None
    write: int  # the next free slot
    done: list[bool]  # rows that are over (eos or budget): their seqs and slots no longer change
    compactions: int = 0  # slot contents move at each: caches keyed by slot must be rebuilt
    taps: tuple[int, ...] = ()  # `hidden` keeps these target layers' outputs, concatenated; (): the final states

    def new_tokens(self, row: int) -> int:
        return len(self.seqs[row]) - self.prompt_lengths[row]

    def progress(self, row: int) -> float:
        return self.new_tokens(row) / self.max_new_tokens

    def feed(self, target: Transformer, blocks: torch.Tensor,
             tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Run (B, n) tokens at slots [write, write+n), each row at its own positions, attending to its valid
        slots and causally within the block, or, for `tree` = (which block nodes each node sees (B, n, n),
        each node's depth (B, n)), to its ancestors at positions by depth; returns the final hidden states
        (B, n, d)."""
        B, n = blocks.shape
        within, offsets = tree or (torch.ones(n, n, dtype=torch.bool).tril().expand(B, n, n), torch.arange(n))
        positions = torch.tensor([len(s) - 1 for s in self.seqs]).unsqueeze(1) + offsets
        mask = torch.cat([self.valid[:, None, :self.write].expand(B, n, self.write), within], dim=2)
        return self.run(target, blocks, positions, mask.unsqueeze(1))

    def run(self, target: Transformer, tokens: torch.Tensor, positions: torch.Tensor,
            attn_mask: torch.Tensor | None) -> torch.Tensor:
        """The target over `tokens` at slots [write, write + T) (`Transformer.extend`) -> its final states;
        what the drafter reads of them goes to `hidden`."""
        h, kept = target.extend(tokens, positions, attn_mask, self.write, self.taps if self.hidden is not None else ())
        if self.hidden is not None:
            self.hidden[:, self.write:self.write + tokens.shape[1]] = kept
        return h

    def compact(self, target: Transformer) -> None:
        """Move each row's valid slots to the end of [0, w), w the longest row, and set write = w."""
        order = torch.sort(self.valid.int(), dim=1, stable=True).indices  # invalid slots first, order kept
        w = int(self.valid.sum(1).max())
        keep = order[:, order.shape[1] - w:]
        for block in target.blocks:
            block.attn.kv_cache.compact(keep)
        if self.hidden is not None:
            index = keep.to(self.hidden.device).unsqueeze(-1).expand(-1, -1, self.hidden.shape[2])
            self.hidden[:, :w] = self.hidden.gather(1, index)
        self.valid[:, :w] = self.valid.gather(1, keep)
        self.valid[:, w:] = False
        self.write = w
        self.compactions += 1


class Proposer(Protocol):
    """What `speculative_generate` needs of a drafter."""

    name: str  # what drafts, in labels: prompt-lookup, draft, diffusion
    needs_hidden: bool  # whether it reads the target's hidden states (`DecodeState.hidden`)
    taps: tuple[int, ...]  # which: the outputs of these target layers, concatenated; (): the final states
    tree: int  # the most nodes one of its tree drafts holds (0: it drafts chains only)
    passes: int  # the forward passes it has made since `start`

    def start(self, batch_size: int, max_len: int) -> None:
        """Get ready for a new batch whose texts grow to at most `max_len` tokens."""

    def propose(self, state: DecodeState, k: int, sampling: SamplingConfig, generator) -> list[Draft]:
        """Up to k drafts per row following its text (`state.seqs`); rows that are done get none."""


class DraftModel:
    """Drafts with a small AR model of the same tokenizer. It keeps its own KV cache with the verifier's
    per-row bookkeeping (a `DecodeState` over the draft model): before drafting, each row's cached tokens
    are checked against its text, slots past the first difference are invalidated (a rollback), and the
    rest of the text is fed in one pass for all rows; then k - 1 single-token steps draft for every row."""

    name = "draft"
    needs_hidden, taps, tree = False, (), 0

    def __init__(self, model: Transformer):
        self.model, self.passes = model, 0

    def start(self, batch_size: int, max_len: int) -> None:
        self.slots = 2 * max_len + 8  # room for rejected drafts between compactions
        self.model.setup_cache(batch_size, self.slots)
        self.state = DecodeState(seqs=[[0] for _ in range(batch_size)], prompt_lengths=[0] * batch_size,
                                 max_new_tokens=max_len, valid=torch.zeros(batch_size, self.slots, dtype=torch.bool),
                                 hidden=None, write=0, done=[False] * batch_size)
        self.passes = 0

    def _feed(self, blocks: list[list[int]]) -> torch.Tensor:
        """Feed each row's tokens (as many as it has, maybe none) at the same slots -> each row's logits after
        its last one (B, V); rows with no tokens get garbage."""
        ds, n = self.state, max(map(len, blocks))
        if ds.write + n > self.slots:
            ds.compact(self.model)
        tokens = torch.zeros(len(blocks), n, dtype=torch.long)
        for r, block in enumerate(blocks):
            tokens[r, :len(block)] = torch.tensor(block, dtype=torch.long)
        h = ds.feed(self.model, tokens)
        for r, block in enumerate(blocks):
            ds.valid[r, ds.write:ds.write + len(block)] = True
        ds.write += n
        self.passes += 1
        return self.model.lm_head(h[torch.arange(len(blocks)), torch.tensor([max(len(b), 1) - 1 for b in blocks])])

    def propose(self, state: DecodeState, k: int, sampling: SamplingConfig, generator) -> list[Draft]:
        """k drafts per row following its text, with the distributions they were drawn from (None: greedy)."""
        ds, B = self.state, len(state.seqs)
        rows = [r for r in range(B) if not state.done[r]]
        blocks: list[list[int]] = [[] for _ in range(B)]
        for r in rows:
            text, cached = state.seqs[r], ds.seqs[r][:-1]
            same = next((i for i, (a, b) in enumerate(zip(cached, text)) if a != b), min(len(cached), len(text)))
            same = min(same, len(text) - 1)  # the text's last token is always fed: the drafts follow it
            ds.valid[r, ds.valid[r].nonzero().squeeze(1)[same:]] = False
            ds.seqs[r] = text[:same + 1]  # DecodeState's convention: all in the cache but the last token
            blocks[r] = text[same:]
        logits = self._feed(blocks)
        drafts: list[list[int]] = [[] for _ in range(B)]
        dists: list[list] = [[] for _ in range(B)]
        # no row drafts past what the verifier can still take (nor, so, past the model's context)
        wanted = {r: max(1, min(k, state.max_new_tokens - state.new_tokens(r) - 1)) for r in rows}
        for i in range(max(wanted.values(), default=0)):
            rows = [r for r in rows if i < wanted[r]]
            for r in rows:
                if sampling.greedy:
                    token, dist = int(logits[r].argmax()), None
                else:
                    dist = probabilities(logits[r:r + 1], sampling)[0]
                    token = int(torch.multinomial(dist, 1, generator=generator))
                drafts[r].append(token)
                dists[r].append(dist)
                ds.seqs[r] = (ds.seqs[r] if i else list(state.seqs[r])) + [token]  # the new token is not fed yet
            if any(i + 1 < wanted[r] for r in rows):
                logits = self._feed([[drafts[r][-1]] if i + 1 < wanted.get(r, 0) else [] for r in range(B)])
        return [Draft(drafts[r], dists[r]) for r in range(B)]


DATASTORE_NODES = 8  # a datastore's draft tree (SmolLM2 bf16, 2 CPU cores: a pass of 9 tokens ~1.2 AR steps, 13 ~1.4)


class PromptLookup:
    """Drafts by copying what followed the latest earlier occurrence of the text's last n-gram. With a
    `datastore` (decoding/datastore.py), the copy is grafted onto a tree of the datastore's likeliest
    continuations, `nodes` in all: a tree of certain drafts, verified like any other (`walk`: lossless)."""

    passes = 0  # drafting costs no forward pass
    needs_hidden, taps = False, ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, datastore: Datastore | None = None,
                 nodes: int = DATASTORE_NODES):
        self.max_ngram, self.min_ngram, self.datastore, self.nodes = max_ngram, min_ngram, datastore, nodes
        self.name = "prompt-lookup+datastore" if datastore else "prompt-lookup"
        self.tree = nodes if datastore else 0

    def start(self, batch_size: int, max_len: int) -> None:
        pass

    def propose(self, state: DecodeState, k: int, sampling: SamplingConfig, generator) -> list[Draft]:
        return [Draft([]) if done else self.draft(seq, self.lookup(seq, k)[1], k)
                for seq, done in zip(state.seqs, state.done)]

    def lookup(self, seq: list[int], k: int) -> tuple[int, list[int]]:
        """(n, the up to k tokens that followed the latest earlier occurrence of the text's last n tokens), n the
        longest n-gram that has one; (0, []) if none has."""
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start:start + n] == tail:
                    return n, seq[start + n:start + n + k]
        return 0, []

    def draft(self, seq: list[int], copy: list[int], k: int) -> Draft:
        """The row's draft: its own `copy` (a chain: certain, q one-hot), grafted onto the datastore's tree of
        continuations up to k tokens deep when there is a datastore."""
        if self.datastore is None:
            return Draft(copy)
        tokens, parents = self.datastore.tree(seq, self.nodes - len(copy), k)
        tokens, parents = graft(tokens, parents, copy)
        return Draft(tokens, parents=parents)


TRUSTED_NGRAM = 1  # WithPromptLookup: a copy found from a match this long is verified alone


class WithPromptLookup:
    """Another proposer's drafts with prompt lookup's: where prompt lookup has a draft of its own (a copy found
    from a match of at least `trusted` tokens, by default any copy, on its datastore's tree when it has one; or,
    where the text holds no copy, the datastore's tree alone), it is verified alone and the inner proposer does
    not draft for that row (when no row needs it, it makes no pass); elsewhere the row gets the inner proposer's
    draft with prompt lookup's grafted on as free candidates: the draft becomes a tree (a chain is one) with
    prompt lookup's hung from its root, so one verification pass tries both and keeps the longer path the target
    agrees with (`walk`: lossless, greedy or sampled). The copy is up to `k` tokens long (8, as
    `ar+prompt-lookup` verifies) whatever the block the inner proposer is asked for: it costs no drafting pass,
    only verified positions.

    Copies first: on the shipped 7M models' valid prompts a drafting pass costs half a verification pass and adds
    0.5-1.4 tokens to a copy the target accepts, less than it costs; where there is no copy, the drafter's
    tokens are all there is (docs/benchmarks.md). `trusted` None grafts every copy onto the drafts, for targets
    whose verification costs the same for a few more nodes and whose drafter is cheap beside it (a GPU)."""

    def __init__(self, inner: Proposer, k: int = 8, lookup: PromptLookup | None = None,
                 trusted: int | None = TRUSTED_NGRAM):
        self.inner, self.k, self.lookup, self.trusted = inner, k, lookup or PromptLookup(), trusted
        self.name = f"{inner.name}+{self.lookup.name}"
        self.needs_hidden, self.taps = inner.needs_hidden, inner.taps
        self.tree = max(inner.tree, k) + max(self.lookup.tree, k)  # nodes: the inner tree (or a chain) and lookup's

    @property
    def passes(self) -> int:
        return self.inner.passes

    def start(self, batch_size: int, max_len: int) -> None:
        self.inner.start(batch_size, max_len)

    def propose(self, state: DecodeState, k: int, sampling: SamplingConfig, generator) -> list[Draft]:
        found = [(0, []) if done else self.lookup.lookup(seq, self.k) for seq, done in zip(state.seqs, state.done)]
        own = [Draft([]) if done else self.lookup.draft(seq, copy, self.k)
               for seq, done, (_, copy) in zip(state.seqs, state.done, found)]
        alone = [self.trusted is not None and mine.tokens != [] and (n >= self.trusted or copy == [])
                 for (n, copy), mine in zip(found, own)]
        skip = [d or a for d, a in zip(state.done, alone)]  # the inner proposer drafts for the other rows alone
        drafts = [Draft([]) for _ in skip] if all(skip) else \
            self.inner.propose(replace(state, done=skip), k, sampling, generator)
        for r, (draft, mine) in enumerate(zip(drafts, own)):
            if alone[r]:
                drafts[r] = mine
            elif mine.tokens:
                tokens, parents = graft(draft.tokens, draft.shape(), mine.tokens, mine.parents)
                drafts[r] = Draft(tokens, parents=parents)
        return drafts


def accept(logits: torch.Tensor, drafts: list[int], dists: list | None, sampling: SamplingConfig,
           generator: torch.Generator | None = None, planned: list[bool] | None = None) -> tuple[int, int]:
    """Verify drafts against the target's logits (len(drafts)+1, V).

    Returns (how many drafts are accepted, the target's own next token). Greedy: a draft stands if it is
    the target's argmax. Sampling: draft d with proposal q is kept with probability min(1, p(d)/q(d));
    at the first rejection the token is drawn from the residual max(0, p - q), renormalised; after all
    are kept, the bonus token is drawn from p. A one-hot q (None) is a deterministic copy. Drafts marked
    `planned` are kept unverified (the later ones were scored after them, so the rule still applies to
    them), which makes the output no longer the target's alone.
    """
    dists = dists or [None] * len(drafts)
    planned = planned or [False] * len(drafts)
    if sampling.greedy:
        for i, d in enumerate(drafts):
            if not planned[i] and int(logits[i].argmax()) != d:
                return i, int(logits[i].argmax())
        return len(drafts), int(logits[len(drafts)].argmax())
    p = probabilities(logits, sampling)
    for i, (d, q) in enumerate(zip(drafts, dists)):
        q_d = 1.0 if q is None else float(q[d])
        if planned[i] or float(torch.rand((), generator=generator)) * q_d < float(p[i, d]):
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


class AdaptiveBlock:
    """The number of drafts to verify next: about 1.5x what rows have recently accepted, plus one, within
    [1, k_max]. Verifying a long block that will mostly be rejected costs target compute for nothing."""

    def __init__(self, k_max: int, adaptive: bool = True):
        self.k_max, self.adaptive, self.recent = k_max, adaptive, float(k_max)

    @property
    def k(self) -> int:
        return min(self.k_max, math.ceil(1.5 * self.recent) + 1) if self.adaptive else self.k_max

    def update(self, accepted: list[int]) -> None:
        if accepted:
            self.recent = 0.5 * self.recent + 0.5 * sum(accepted) / len(accepted)


@torch.inference_mode()
def speculative_generate(
    target: Transformer,
    proposer: Proposer,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    k: int,
    eos_id: int | None,
    pad_id: int = 0,
    sampling: SamplingConfig = SamplingConfig(),
    generator: torch.Generator | None = None,
    on_token: TokenCallback | None = None,
    adaptive: bool = False,
    fixed: list[dict[int, int]] | None = None,
) -> GenerationResult:
    """Draft-and-verify generation for a batch of prompts; `on_token(row, token, origin)` streams accepted tokens,
    each an accepted draft or the target's own (returning False ends that row); the result's `origins` say the same.

    The proposer drafts up to k tokens per row (`adaptive`: fewer when little gets accepted); rows finish
    independently (eos, `max_new_tokens`, or the callback). `fixed[row]` pins output positions to tokens as
    in `decode_n_tokens`: a pin replaces whatever the block holds at its position and ends the block there,
    so greedy output with pins equals plain AR greedy with the same pins. `pad_id` fills the left padding of
    shorter prompts (masked: it never changes the output).

    One loop, kept whole (~110 lines): draft, verify, accept and roll back all update the same batch state.
    """
    if k <= 0:
        raise DiffarError(f"block size (draft length) k must be positive, got {k}")
    if getattr(proposer, "model", None) is target:
        raise DiffarError("the draft model cannot be the target model object itself: they would share one KV cache")
    check_lengths(target, prompts, max_new_tokens)
    t0 = time.perf_counter()
    B = len(prompts)
    batch = Batch.from_prompts(prompts, pad_id)
    width = batch.tokens.shape[1]
    slots = width + max_new_tokens + 4 * (max(k, proposer.tree) + 1)  # room for rejected blocks between compactions
    target.setup_cache(B, slots)
    proposer.start(B, max(map(len, prompts)) + max_new_tokens + k)
    state = DecodeState(
        seqs=[list(p) for p in prompts], prompt_lengths=[len(p) for p in prompts], max_new_tokens=max_new_tokens,
        valid=torch.zeros(B, slots, dtype=torch.bool),
        hidden=target.tok_emb.weight.new_zeros(B, slots, target.config.d_model * max(1, len(proposer.taps)))
        if proposer.needs_hidden else None, write=0, done=[False] * B, taps=proposer.taps)
    state.valid[:, :width] = torch.arange(width) >= batch.pad.unsqueeze(1)
    h = state.run(target, batch.tokens, batch.positions(0, width), batch.attn_mask(0, width))
    state.write = width
    pins = fixed or [{} for _ in prompts]
    last_pin = [max(p, default=-1) for p in pins]

    def no_early_eos(row: int, logits: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """A row's logits for its next output positions (`offsets` ahead; default 0, 1, ...), eos ruled out
        before its last pin."""
        before = last_pin[row] - state.new_tokens(row)
        if eos_id is None or before <= 0:
            return logits
        logits = logits.clone()
        offsets = torch.arange(len(logits)) if offsets is None else offsets
        logits[offsets < before, eos_id] = float("-inf")
        return logits

    last = target.lm_head(h[:, -1:])
    first = sample_next(torch.cat([no_early_eos(r, last[r]) for r in range(B)]), sampling, generator).tolist()
    first = [pins[r].get(0, t) for r, t in enumerate(first)]
    done, ended = state.done, [False] * B
    passes, drafted, accepted_total = 1, 0, 0
    block = AdaptiveBlock(k, adaptive)
    origins: list[list[str]] = [[] for _ in range(B)]  # per row, who wrote each token emitted

    def emit(row: int, t: int, origin: str) -> bool:
        """Append a token to a row; False once the row is over (eos or its budget)."""
        if t == eos_id:
            done[row] = ended[row] = True
            return False
        state.seqs[row].append(t)
        origins[row].append(origin)
        stopped = on_token is not None and on_token(row, t, origin) is False
        done[row] = stopped or state.new_tokens(row) >= max_new_tokens
        return not done[row]

    for row, t in enumerate(first):
        emit(row, t, PINNED if 0 in pins[row] else AR)
    draft_seconds = 0.0
    while not all(done):
        t_draft = time.perf_counter()
        proposals = proposer.propose(state, block.k, sampling, generator)
        draft_seconds += time.perf_counter() - t_draft
        room = [max_new_tokens - state.new_tokens(r) - 1 for r in range(B)]  # the target adds a token of its own
        proposals = [Draft([]) if done[r] else p.within(room[r]) for r, p in enumerate(proposals)]
        n = 1 + max(len(p.tokens) for p in proposals)
        if state.write + n > slots:
            state.compact(target)
        blocks = torch.zeros(B, n, dtype=torch.long)
        for r, p in enumerate(proposals):
            blocks[r, 0] = state.seqs[r][-1]
            blocks[r, 1:1 + len(p.tokens)] = torch.tensor(p.tokens, dtype=torch.long)
        tree = None
        if any(p.parents is not None for p in proposals):  # every row as a tree (a chain is one too)
            shapes = [p.shape() for p in proposals]
            offsets = torch.tensor([depths(s) + [0] * (n - 1 - len(s)) for s in shapes])  # padding nodes: 0
            tree = (torch.stack([ancestor_mask(s, n) for s in shapes]), offsets)
        logits = target.lm_head(state.feed(target, blocks, tree))
        passes += 1
        used, accepted_now = 0, []  # used: the block's slots up to the furthest one any row keeps
        for r, p in enumerate(proposals):
            if done[r]:
                continue
            d = p.tokens
            if p.parents is None:
                n_ok, token = accept(no_early_eos(r, logits[r, :len(d) + 1]), d, p.dists, sampling, generator,
                                     p.planned)
                path = list(range(1, n_ok + 1))
            else:
                path, token = walk(no_early_eos(r, logits[r, :len(d) + 1], offsets[r, :len(d) + 1]), d, p.parents,
                                   sampling, generator)
            at = state.new_tokens(r)  # the output position of the first draft
            pin = next((j for j in range(len(path) + 1) if at + j in pins[r]), None)
            if pin is not None:  # the pin stands in for the token at its position; what follows it is unverified
                path, token = path[:pin], pins[r][at + pin]
            state.valid[r, state.write + torch.tensor([0] + path)] = True
            used = max(used, 1 + max(path, default=0))
            drafted, accepted_total = drafted + len(d), accepted_total + len(path)
            if d:
                accepted_now.append(len(path))
            written = [DRAFT] * len(path) + [AR if pin is None else PINNED]
            for t, origin in zip([d[i - 1] for i in path] + [token], written):
                if not emit(r, t, origin):
                    break
        state.write += used
        block.update(accepted_now)
    out = [seq[n:] for seq, n in zip(state.seqs, state.prompt_lengths)]
    return GenerationResult(out, time.perf_counter() - t0, {"target": passes, "draft": proposer.passes}, ended,
                            {"drafted": drafted, "accepted": accepted_total, "draft_seconds": draft_seconds}, origins)
