"""Decoding with a block drafter (models/drafter.py): one drafter pass per verification drafts a whole block
from the target's features, and `speculative_generate` verifies it, so the text is the target's own.

The target keeps the features of every cache slot next to its KV cache (`DecodeState.hidden`, the layers the
drafter taps); the drafter turns each slot's features into its layers' keys/values once, when the slot is
written, and keeps them per slot as the target keeps its own (rebuilt after a compaction). Drafting is then
a pass over the block's slots alone. Greedy, the drafts are the drafter's argmax chain, or with `tree` > 0
the tree of its likeliest prefixes under that node budget (decoding/tree.py); sampled, each draft is drawn
from the drafter's distribution and kept by the rejection rule, so the output follows the target's law.
"""

from __future__ import annotations

import torch

from diffar.decoding.sampling import SamplingConfig, probabilities
from diffar.decoding.speculative import DecodeState, Draft
from diffar.decoding.tree import best_first
from diffar.models.drafter import BlockDrafter


class BlockProposer:
    """A proposer for `speculative_generate`: a `BlockDrafter` with its target attached."""

    name = "drafter"
    needs_hidden = True

    def __init__(self, drafter: BlockDrafter, tree: int = 0):
        self.drafter, self.tree = drafter, tree
        self.taps = drafter.config.feature_layers
        self.passes = 0

    def start(self, batch_size: int, max_len: int) -> None:
        self.passes = 0
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per draft layer, per cache slot (B, H, slots, hd)
        self.kv_upto, self.kv_compactions = 0, 0

    def _update_kv(self, state: DecodeState) -> None:
        """Keys/values of the slots written since the last draft (of every slot after a compaction). A slot's
        features and position never change once written below `state.write`."""
        if state.compactions != self.kv_compactions:
            self.kv_upto, self.kv_compactions = 0, state.compactions
        lo, hi = self.kv_upto, state.write
        if hi <= lo:
            return
        # a valid slot's position is the count of valid slots before it (they hold the text in order)
        positions = (state.valid[:, :hi].long().cumsum(1) - 1).clamp(min=0)[:, lo:].to(state.hidden.device)
        new = self.drafter.context_kv(self.drafter.context(state.hidden[:, lo:hi]), positions)
        if not self.kv:
            slots = state.valid.shape[1]
            self.kv = [(k.new_zeros(*k.shape[:2], slots, k.shape[3]), v.new_zeros(*v.shape[:2], slots, v.shape[3]))
                       for k, v in new]
        for (k_all, v_all), (k, v) in zip(self.kv, new):
            k_all[:, :, lo:hi], v_all[:, :, lo:hi] = k, v
        self.kv_upto = hi

    def propose(self, state: DecodeState, k: int, sampling: SamplingConfig, generator) -> list[Draft]:
        out = [Draft([]) for _ in state.seqs]
        rows = [r for r in range(len(state.seqs)) if not state.done[r]]
        if not rows:
            return out
        d = self.drafter
        self._update_kv(state)
        device, w = state.hidden.device, state.write
        index = torch.tensor(rows, device=device)
        kv = [(k_all[index, :, :w], v_all[index, :, :w]) for k_all, v_all in self.kv]
        anchor = torch.tensor([state.seqs[r][-1] for r in rows], device=device)
        positions = torch.tensor([len(state.seqs[r]) - 1 for r in rows], device=device)
        mask = state.valid[rows, :w].to(device).view(len(rows), 1, 1, w)
        logits = d.logits(d.draft_hidden(anchor, positions, kv, mask)[:, 1:k + 1]).float()
        self.passes += 1
        vocab = d.vocab.to(logits.device)
        for i, r in enumerate(rows):
            if self.tree:  # every node's token is verified as the target's own choice, greedy or sampled
                picks, parents = best_first(torch.softmax(logits[i], -1), self.tree)
                out[r] = Draft(vocab[picks].tolist(), parents=parents)
            elif sampling.greedy:
                out[r] = Draft(vocab[logits[i].argmax(-1)].tolist())
            else:  # the rejection rule needs each proposal over the target's whole vocabulary
                q = logits.new_zeros(len(logits[i]), d.target.config.vocab_size)
                q[:, vocab] = probabilities(logits[i], sampling)
                out[r] = Draft(torch.multinomial(q, 1, generator=generator).squeeze(1).tolist(), list(q))
        return out
