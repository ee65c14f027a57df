"""A datastore for prompt lookup: text the target model wrote before (or any text in its tokenizer), as an n-gram
model of what follows what, searched for the row's last tokens, as retrieval-based speculative decoding does
(REST, He et al., arXiv 2311.08252). Its drafts are a tree of the likeliest continuations (tree.grow: each
node's children the tokens that most often followed the longest stored n-gram ending there); verification keeps
the path the target agrees with, so the output stays the target's own.

Built from a corpus's train split: `distill data` token records (their responses: the target's own greedy text),
or a text corpus tokenized. n-grams never run across two texts.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

from diffar.data.batching import check_token_ids
from diffar.data.corpora import load_corpus
from diffar.decoding.tree import grow
from diffar.errors import DiffarError
from diffar.tokenizer import Tokenizer


class Datastore:
    def __init__(self, texts: list[list[int]], max_ngram: int = 4, top: int = 4):
        """Every n-gram (n <= max_ngram) of the texts with a token after it -> its `top` likeliest next tokens."""
        counts: defaultdict[tuple[int, ...], Counter] = defaultdict(Counter)
        for text in texts:
            for end in range(1, len(text)):
                for n in range(1, min(max_ngram, end) + 1):
                    counts[tuple(text[end - n:end])][text[end]] += 1
        if not counts:
            raise DiffarError("the datastore's texts hold no n-gram with a token after it")
        self.max_ngram = max_ngram
        # n-gram -> its next tokens as (token, log frequency), likeliest first
        self.next: dict[tuple[int, ...], list[tuple[int, float]]] = {}
        for gram, after in counts.items():
            total = sum(after.values())
            self.next[gram] = [(t, math.log(c / total)) for t, c in after.most_common(top)]

    def children(self, seq: list[int]) -> list[tuple[int, float]]:
        """What followed the longest stored n-gram `seq` ends with, likeliest first; [] if none is stored."""
        for n in range(min(self.max_ngram, len(seq)), 0, -1):
            after = self.next.get(tuple(seq[-n:]))
            if after is not None:
                return after
        return []

    def tree(self, seq: list[int], nodes: int, depth: int) -> tuple[list[int], list[int]]:
        """The `nodes` likeliest continuations of `seq`, at most `depth` tokens long, as a tree (decoding/tree.py)."""
        tail = seq[-self.max_ngram:]
        return grow(lambda prefix: self.children(tail + prefix) if len(prefix) < depth else [], nodes)


def load_datastore(path: str, tokenizer: Tokenizer) -> Datastore:
    """The datastore of a corpus's train split (its valid split stays out: prompts may be drawn from it): the
    responses of `distill data` token records (checked to be this tokenizer's), a continuation corpus's documents
    or a seq2seq corpus's targets."""
    corpus = load_corpus(path, "train")
    if corpus.sequences is not None:
        check_token_ids(corpus, tokenizer)
        texts = [response for _, response in corpus.sequences]
    else:
        texts = tokenizer.encode_batch(corpus.documents if corpus.task == "continuation" else
                                       [p.target for p in corpus.pairs])
    return Datastore(texts)
