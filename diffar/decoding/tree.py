"""Token trees for draft-and-verify decoding: many candidate continuations verified in one target pass.

A drafter that scores every position of a block at once (a diffusion stream) gives per-position marginals
p_1..p_k. Instead of verifying only the argmax chain, `best_first` grows the tree of the most probable
prefixes under a node budget (score of a prefix: the product of its tokens' marginals), as DDTree does
for DFlash's drafts (SpecInfer, arXiv 2305.09781, and Medusa, arXiv 2401.10774, verify trees too). The target
reads all nodes in one pass, each attending to its ancestors only (`ancestor_mask`), and `walk` keeps the
longest path the target itself would have written.

A tree is `(tokens, parents)`: node i (from 1) holds tokens[i-1] and hangs under node parents[i-1] < i;
node 0 is the text's last token, already decided. A chain of n drafts is parents = [0, 1, ..., n-1].
"""

from __future__ import annotations

import heapq
from typing import Callable

import torch

from diffar.decoding.sampling import SamplingConfig, probabilities


def chain(n: int) -> list[int]:
    """The parents of a chain of n drafts."""
    return list(range(n))


def depths(parents: list[int]) -> list[int]:
    """Each node's distance from node 0 (node 0 included, depth 0)."""
    out = [0]
    for p in parents:
        out.append(out[p] + 1)
    return out


def ancestor_mask(parents: list[int], size: int) -> torch.Tensor:
    """(size, size) bool: node i sees node j iff j is i or one of its ancestors. Rows past the tree (padding,
    when rows of a batch have trees of different sizes) see only themselves."""
    mask = torch.eye(size, dtype=torch.bool)
    for i, p in enumerate(parents, start=1):
        mask[i] |= mask[p]
    return mask


Children = Callable[[list[int]], list[tuple[int, float]]]  # a prefix -> its likeliest next tokens, log-prob first


def grow(children: Children, budget: int) -> tuple[list[int], list[int]]:
    """The `budget` likeliest prefixes under a model of next tokens (score of a prefix: the sum of its tokens'
    log-probs), as a tree; `children(prefix)` lists a prefix's candidates, likeliest first. Lazy enumeration: a
    node's successors are its next sibling (the next likelier token, same parent) and its first child; both score
    no higher than the node, so nodes come out in order of decreasing score."""
    tokens: list[int] = []
    parents: list[int] = []
    prefixes: list[list[int]] = [[]]  # node -> its tokens from the root
    options = {0: children([])}  # node -> its children's candidates
    # heap entries: (-score, tie-break, parent node, rank among its candidates, parent's score)
    heap = [(-options[0][0][1], 0, 0, 0, 0.0)] if budget > 0 and options[0] else []
    tie = 1
    while heap and len(tokens) < budget:
        neg, _, parent, rank, parent_score = heapq.heappop(heap)
        tokens.append(options[parent][rank][0])
        parents.append(parent)
        node = len(tokens)
        if rank + 1 < len(options[parent]):
            heapq.heappush(heap, (-(parent_score + options[parent][rank + 1][1]), tie, parent, rank + 1, parent_score))
            tie += 1
        prefixes.append(prefixes[parent] + [tokens[-1]])
        options[node] = children(prefixes[node])
        if options[node]:
            heapq.heappush(heap, (neg - options[node][0][1], tie, node, 0, -neg))
            tie += 1
    return tokens, parents


def best_first(marginals: torch.Tensor, budget: int) -> tuple[list[int], list[int]]:
    """The `budget` most probable prefixes of a block whose positions are independent with the given
    distributions (k, V), as a tree (`grow`)."""
    top_p, top_t = marginals.float().topk(min(max(budget, 1), marginals.shape[1]), dim=-1)
    ranked = [list(zip(t, p)) for t, p in zip(top_t.tolist(), top_p.clamp_min(1e-30).log().tolist())]
    return grow(lambda prefix: ranked[len(prefix)] if len(prefix) < len(ranked) else [], budget)


def walk(logits: torch.Tensor, tokens: list[int], parents: list[int], sampling: SamplingConfig,
         generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Verify a tree against the target's logits at its nodes (1 + len(tokens), V).

    From node 0, the target picks its next token (greedy: its argmax; sampling: a draw from its own
    distribution); if a child holds that token the walk moves there and goes on, else it stops and the pick
    is the target's own next token. Returns (the accepted nodes, in order; that token). Every token is the
    target's own choice given the text before it, so the output is exactly the target's, greedy or sampled.
    """
    children: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(tokens, parents), start=1):
        children.setdefault(p, {}).setdefault(t, i)
    path, node = [], 0
    while True:
        if sampling.greedy:
            pick = int(logits[node].argmax())
        else:
            pick = int(torch.multinomial(probabilities(logits[node:node + 1], sampling)[0], 1, generator=generator))
        nxt = children.get(node, {}).get(pick)
        if nxt is None:
            return path, pick
        path.append(nxt)
        node = nxt


def graft(tokens: list[int], parents: list[int], more: list[int],
          more_parents: list[int] | None = None) -> tuple[list[int], list[int]]:
    """The tree with another tree (`more`, `more_parents`; by default a chain) hung from node 0: each of its nodes
    follows the node that already holds its token under the same parent, or is appended (so every parent still
    comes before its children)."""
    tokens, parents = list(tokens), list(parents)
    child: dict[tuple[int, int], int] = {}
    for i, (t, p) in enumerate(zip(tokens, parents), start=1):
        child.setdefault((p, t), i)  # the first such child, as `walk` picks
    at = [0]  # node of `more` -> its node in the tree
    for t, p in zip(more, chain(len(more)) if more_parents is None else more_parents):
        if (at[p], t) not in child:
            tokens.append(t)
            parents.append(at[p])
            child[at[p], t] = len(tokens)
        at.append(child[at[p], t])
    return tokens, parents
