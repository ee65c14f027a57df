"""Tree verification (decoding/tree.py): the best-first tree holds the likeliest prefixes, and verifying
trees is lossless: greedy output equals plain AR greedy, batched rows with trees of their own; sampled
output follows the target's law. Prompt lookup's copies grafted onto a drafter's drafts keep all of that."""

import copy
import itertools
import math

import pytest
import torch

from diffar.decoding.ar import generate
from diffar.decoding.sampling import SamplingConfig
from diffar.decoding.speculative import DecodeState, Draft, WithPromptLookup, speculative_generate
from diffar.decoding.tree import ancestor_mask, best_first, chain, depths, graft, walk
from tests.conftest import random_model
from tests.test_speculative import assert_follows_the_ar_law

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [40, 41, 40, 41, 40]]


class TreeDrafter:
    """A proposer drafting trees: a noisy model's distributions along its own greedy chain, taken as the
    per-position marginals of `best_first` (as a one-pass drafter's would be)."""

    name, needs_hidden, taps = "tree", False, ()

    def __init__(self, model, budget: int):
        self.model, self.tree, self.passes = model, budget, 0

    def start(self, batch_size, max_len):
        self.passes = 0

    @torch.no_grad()
    def propose(self, state, k, sampling, generator):
        drafts = []
        for r, seq in enumerate(state.seqs):
            seq, marginals = list(seq), []
            for _ in range(0 if state.done[r] else k):
                p = torch.softmax(self.model(torch.tensor([seq]))[0][0, -1].float(), -1)
                marginals.append(p)
                seq.append(int(p.argmax()))
            tokens, parents = best_first(torch.stack(marginals), self.tree) if marginals else ([], [])
            drafts.append(Draft(tokens, parents=parents))
        self.passes += 1
        return drafts


def test_best_first_keeps_the_likeliest_prefixes():
    torch.manual_seed(0)
    marginals = torch.softmax(torch.randn(3, 4) * 2, -1)
    tokens, parents = best_first(marginals, 10)
    d = depths(parents)
    scores = []
    for i in range(1, len(d)):  # a node's score: the product along its path
        node, score = i, 1.0
        while node:
            score *= float(marginals[d[node] - 1, tokens[node - 1]])
            node = parents[node - 1]
        scores.append(score)
    every = sorted((math.prod(float(marginals[j, t]) for j, t in enumerate(prefix))
                    for n in range(1, 4) for prefix in itertools.product(range(4), repeat=n)), reverse=True)
    assert scores == sorted(scores, reverse=True)  # found in order of decreasing score
    assert scores == pytest.approx(every[:10])  # and they are the ten best of all 84 prefixes
    assert all(p < i for i, p in enumerate(parents, start=1))
    assert ancestor_mask(parents, 12)[len(parents)].sum() == d[-1] + 1  # itself and its ancestors


def test_walk_follows_the_target():
    logits = torch.full((4, 5), -10.0)
    logits[0, 2] = logits[1, 3] = logits[3, 1] = 10.0  # node 0 wants 2, node 1 (token 2) wants 3, ...
    path, token = walk(logits, [2, 4, 3], [0, 0, 1], SamplingConfig())
    assert (path, token) == ([1, 3], 1)


def noisy_copy(model, scale: float):
    """A drafter: the model with Gaussian noise of `scale` added to every weight (seed 1)."""
    drafter = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * scale)
    return drafter


@pytest.mark.parametrize("budget", [1, 6, 20])
def test_greedy_trees_equal_ar(budget):
    target = random_model(0)
    drafter = noisy_copy(target, 0.1)
    plain = generate(target, PROMPTS, 30, pad_id=0, eos_id=None).tokens
    tree = speculative_generate(target, TreeDrafter(drafter, budget), PROMPTS, 30, k=6, eos_id=None, adaptive=False)
    assert tree.tokens == plain
    perfect = speculative_generate(target, TreeDrafter(copy.deepcopy(target), budget), PROMPTS, 30, k=6, eos_id=None,
                                   adaptive=False)
    assert perfect.tokens == plain
    # the root's likeliest child is the target's own next token: at least 2 tokens per pass after the prefill
    assert perfect.passes["target"] <= 1 + 30 // 2


def test_sampled_trees_follow_the_ar_law():
    assert_follows_the_ar_law(lambda drafter: TreeDrafter(drafter, 6))


def paths(tokens, parents):
    """Every root-to-node token path of a tree."""
    out = {0: ()}
    for i, (t, p) in enumerate(zip(tokens, parents), start=1):
        out[i] = out[p] + (t,)
    return set(out.values())


def test_graft_shares_what_the_tree_holds():
    tokens, parents = [7, 8, 9, 3], [0, 1, 0, 2]  # 7-8-3 and 9
    grafted, new_parents = graft(tokens, parents, [7, 8, 5, 6])
    assert grafted[:4] == tokens and new_parents[:4] == parents  # the tree is kept, nodes appended
    assert (grafted[4:], new_parents[4:]) == ([5, 6], [2, 5])  # the copy follows 7-8, then branches off
    assert paths(grafted, new_parents) == paths(tokens, parents) | {(7, 8, 5), (7, 8, 5, 6)}
    assert graft(tokens, parents, [9]) == (tokens, parents)  # a copy the tree already holds adds nothing
    assert graft([], [], [4, 4]) == ([4, 4], chain(2))


class Fixed:
    """A proposer drafting one fixed chain (or tree) for every row."""

    name, needs_hidden, taps, passes = "fixed", False, (), 0

    def __init__(self, draft: Draft):
        self.draft, self.tree = draft, len(draft.tokens) if draft.parents else 0

    def start(self, batch_size, max_len):
        pass

    def propose(self, state, k, sampling, generator):
        return [Draft([]) if done else self.draft for done in state.done]


class Asked(Fixed):
    """A Fixed proposer that keeps the rows it was asked to draft for."""

    def propose(self, state, k, sampling, generator):
        self.asked = [r for r, done in enumerate(state.done) if not done]
        return super().propose(state, k, sampling, generator)


def test_prompt_lookup_joins_the_drafts():
    seqs = [[1, 2, 3, 4, 1, 2], [5, 6, 7], [1, 2, 3, 1, 2]]  # row 1 has nothing to copy; row 2 is done
    state = DecodeState(seqs=seqs, prompt_lengths=[0, 0, 0], max_new_tokens=8, valid=torch.zeros(3, 1, dtype=bool),
                        hidden=None, write=0, done=[False, False, True])
    chained = WithPromptLookup(Fixed(Draft([3, 9])), k=3, trusted=None)
    assert chained.tree == 6 and chained.name == "fixed+prompt-lookup"
    a, b, c = chained.propose(state, 2, SamplingConfig(), None)
    assert paths(a.tokens, a.parents) == {(), (3,), (3, 9), (3, 4), (3, 4, 1)}  # the copy 3 4 1 shares the 3
    assert (b.tokens, b.parents) == ([3, 9], None) and c.tokens == []  # no copy: the draft as it was
    tree = Draft([3, 5, 9], parents=[0, 0, 1])
    a, _, _ = WithPromptLookup(Fixed(tree), k=2, trusted=None).propose(state, 2, SamplingConfig(), None)
    assert paths(a.tokens, a.parents) == paths(tree.tokens, tree.parents) | {(3, 4)}
    # row 0's copy comes from a 2-token match (1 2): trusted from 2 tokens, it is verified alone
    inner = Asked(Draft([3, 9]))
    a, b, c = WithPromptLookup(inner, k=3, trusted=2).propose(state, 2, SamplingConfig(), None)
    assert (a.tokens, a.parents, b.tokens, c.tokens) == ([3, 4, 1], None, [3, 9], []) and inner.asked == [1]
    # from 3 tokens, it is not: grafted as before
    a, _, _ = WithPromptLookup(Asked(Draft([3, 9])), k=3, trusted=3).propose(state, 2, SamplingConfig(), None)
    assert paths(a.tokens, a.parents) == {(), (3,), (3, 9), (3, 4), (3, 4, 1)}


def test_copies_first_skip_the_drafting_pass():
    """By default any copy is verified alone; the inner proposer is not called when every row has one."""
    state = DecodeState(seqs=[[1, 2, 3, 1], [4, 5, 4]], prompt_lengths=[0, 0], max_new_tokens=8,
                        valid=torch.zeros(2, 1, dtype=bool), hidden=None, write=0, done=[False, False])
    inner = Asked(Draft([7]))
    inner.asked = None
    drafts = WithPromptLookup(inner, k=2).propose(state, 2, SamplingConfig(), None)
    assert [d.tokens for d in drafts] == [[2, 3], [5, 4]] and inner.asked is None


@pytest.mark.parametrize("trusted", [None, 1, 3])
@pytest.mark.parametrize("budget", [0, 6])
def test_greedy_with_prompt_lookup_equals_ar(budget, trusted):
    target = random_model(0)
    drafter = noisy_copy(target, 0.3)
    plain = generate(target, PROMPTS, 30, pad_id=0, eos_id=None).tokens
    inner = TreeDrafter(drafter, budget) if budget else Fixed(Draft([1, 2, 3]))
    out = speculative_generate(target, WithPromptLookup(inner, k=6, trusted=trusted), PROMPTS, 30, k=6, eos_id=None)
    assert out.tokens == plain and out.extra["drafted"] > 0


@pytest.mark.parametrize("trusted", [None, 1])
def test_sampled_with_prompt_lookup_follows_the_ar_law(trusted):
    assert_follows_the_ar_law(lambda drafter: WithPromptLookup(TreeDrafter(drafter, 3), k=2, trusted=trusted))
