"""A datastore for prompt lookup: text the target model wrote before (or any text in its tokenizer), searched
for the last n-gram of a row's text when the row's own text holds no copy, as retrieval-based speculative
decoding does (REST, He et al., arXiv 2311.08252). What followed the n-gram's latest occurrence is the copy;
verification keeps what the target agrees with, so the output stays the target's own.

The store is its texts' tokens laid end to end, each text closed by a separator no n-gram crosses, and a table
from every n-gram (n <= max_ngram) to where its latest occurrence ends. Built from a corpus's train split:
`distill data` token records (their responses: the target's own greedy text), or a text corpus tokenized.
"""

from __future__ import annotations

from diffar.data.batching import check_token_ids
from diffar.data.corpora import load_corpus
from diffar.errors import DiffarError
from diffar.tokenizer import Tokenizer

SEPARATOR = -1  # between texts: never a token, so no n-gram or copy runs across it


class Datastore:
    def __init__(self, texts: list[list[int]], max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> the index just past its latest occurrence
        for text in texts:
            start = len(self.tokens)
            self.tokens += text
            for end in range(start + 1, len(self.tokens)):  # an n-gram with at least one token after it
                for n in range(1, min(max_ngram, end - start) + 1):
                    self.ends[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(SEPARATOR)
        if not self.ends:
            raise DiffarError("the datastore's texts hold no n-gram with a token after it")

    def copy(self, seq: list[int], k: int) -> tuple[int, list[int]]:
        """(n, the up to k tokens after the latest stored occurrence of `seq`'s last n tokens), n the longest
        n-gram stored; (0, []) if none is."""
        for n in range(min(self.max_ngram, len(seq)), 0, -1):
            end = self.ends.get(tuple(seq[-n:]))
            if end is not None:
                after = self.tokens[end:end + k]
                return n, after[:after.index(SEPARATOR)] if SEPARATOR in after else after
        return 0, []


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
