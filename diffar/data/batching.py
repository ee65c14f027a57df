"""Token datasets the trainer samples from: fixed-length windows (continuation) and
source<sep>target<eos> sequences with the loss on the target only (seq2seq).

Each dataset maps a list of example indices to a batch dict the model's forward takes
(`tokens`, `targets`; targets of -100 are ignored by the loss; for a model with domain adapters, `domain`:
each row's domain index).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from diffar.data.corpora import Corpus, domain_name
from diffar.errors import DiffarError
from diffar.tokenizer import Tokenizer

IGNORE_INDEX = -100


class WindowDataset:
    """All length-`block_size` windows of the concatenated documents (eos between documents); with `domains`
    (each token's domain index), a window's domain is its first token's."""

    def __init__(self, tokens: torch.Tensor, block_size: int, domains: torch.Tensor | None = None):
        if tokens.numel() <= block_size + 1:
            raise DiffarError(f"corpus has {tokens.numel()} tokens, fewer than one window of {block_size + 1}")
        self.tokens, self.block_size, self.domains = tokens, block_size, domains

    def __len__(self) -> int:
        return self.tokens.numel() - self.block_size - 1

    def sample_indices(self, generator: torch.Generator, n: int) -> list[int]:
        return torch.randint(len(self), (n,), generator=generator).tolist()

    def eval_indices(self, max_examples: int) -> list[int]:
        """Non-overlapping windows: every token scored once; fewer, spread evenly over the text (every document of
        a mixture's)."""
        windows = range(0, len(self), self.block_size)
        return [windows[i * len(windows) // max_examples] for i in range(min(max_examples, len(windows)))]

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        offsets = torch.tensor(indices).unsqueeze(1) + torch.arange(self.block_size + 1)
        seq = self.tokens[offsets]
        batch = {"tokens": seq[:, :-1], "targets": seq[:, 1:]}
        return batch if self.domains is None else {**batch, "domain": self.domains[torch.tensor(indices)]}


class PairDataset:
    """source <sep> target <eos>, right-padded per batch; the loss covers target tokens and eos. `joined`:
    the pairs are a model's prompt and response ids, already complete (token records): prompt + response."""

    def __init__(self, examples: list[tuple[list[int], list[int]]], tokenizer: Tokenizer, block_size: int,
                 joined: bool = False, domains: list[int] | None = None):
        self.pad_id = tokenizer.pad_id
        self.seqs, self.prefix, self.domains = [], [], None if domains is None else []
        for i, (src, tgt) in enumerate(examples):
            seq = src + tgt if joined else src + [tokenizer.sep_id] + tgt + [tokenizer.eos_id]
            if len(seq) <= block_size + 1 and len(seq) > len(src) + (not joined):
                self.seqs.append(seq)
                self.prefix.append(len(src) + (not joined))
                if domains is not None:
                    self.domains.append(domains[i])
        if not self.seqs:
            raise DiffarError(f"no source/target pair fits in a block of {block_size} tokens")
        self.dropped = len(examples) - len(self.seqs)
        self.by_length = sorted(range(len(self.seqs)), key=lambda i: len(self.seqs[i]))

    def __len__(self) -> int:
        return len(self.seqs)

    def sample_indices(self, generator: torch.Generator, n: int) -> list[int]:
        """n examples of similar length (a random run of the length-sorted order): little padding."""
        start = int(torch.randint(max(1, len(self) - n + 1), (1,), generator=generator))
        run = self.by_length[start:start + n]
        return (run * (n // len(run) + 1))[:n]

    def eval_indices(self, max_examples: int) -> list[int]:
        return list(range(len(self)))[:max_examples]

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        width = max(len(self.seqs[i]) for i in indices) - 1
        tokens = torch.full((len(indices), width), self.pad_id, dtype=torch.long)
        targets = torch.full((len(indices), width), IGNORE_INDEX, dtype=torch.long)
        for row, i in enumerate(indices):
            seq, p = torch.tensor(self.seqs[i]), self.prefix[i]
            tokens[row, : len(seq) - 1] = seq[:-1]
            targets[row, p - 1 : len(seq) - 1] = seq[p:]
        batch = {"tokens": tokens, "targets": targets}
        return batch if self.domains is None else {**batch, "domain": torch.tensor([self.domains[i] for i in indices])}


def domain_labels(corpus: Corpus, domains: tuple[str, ...]) -> list[int]:
    """Each record's index in `domains` (a model's domain names): its mixture label, or the corpus's own name."""
    labels = corpus.domains or [domain_name(corpus.name)] * len(corpus.documents or corpus.pairs or corpus.sequences)
    unknown = sorted(set(labels) - set(domains))
    if unknown:
        raise DiffarError(f"the model's domains are {', '.join(domains)}; the data is also of {', '.join(unknown)}")
    return [domains.index(label) for label in labels]


def check_token_ids(corpus: Corpus, tokenizer: Tokenizer) -> None:
    """A token-id corpus (`distill data` records) must hold this tokenizer's ids."""
    if corpus.tokenizer != tokenizer.sha256[:16]:
        raise DiffarError(f"{corpus.name} holds token ids of another tokenizer than this model's")


def build_dataset(corpus: Corpus, tokenizer: Tokenizer, block_size: int,
                  domains: tuple[str, ...] = ()) -> WindowDataset | PairDataset:
    """`domains`: a domain-adapted model's domain names; every batch then says each row's (`domain_labels`)."""
    labels = domain_labels(corpus, domains) if domains else None
    if corpus.sequences is not None:
        check_token_ids(corpus, tokenizer)
        return PairDataset(corpus.sequences, tokenizer, block_size, joined=True, domains=labels)
    if corpus.task == "continuation":
        ids: list[int] = []
        starts = []  # where each document begins
        for doc in corpus.documents:
            starts.append(len(ids))
            ids.extend(tokenizer.encode(doc))
            ids.append(tokenizer.eos_id)
        owners = None if labels is None else torch.tensor(labels).repeat_interleave(
            torch.tensor(starts[1:] + [len(ids)]) - torch.tensor(starts))  # each token's document's domain
        return WindowDataset(torch.tensor(ids, dtype=torch.long), block_size, owners)
    sources = tokenizer.encode_batch([p.source for p in corpus.pairs])
    targets = tokenizer.encode_batch([p.target for p in corpus.pairs])
    return PairDataset(list(zip(sources, targets)), tokenizer, block_size, domains=labels)


def prompt_ids(tokenizer: Tokenizer, task: str, text: str) -> list[int]:
    """The token ids a model of `task` is prompted with: the source plus <sep> for seq2seq."""
    return ar_prompt(tokenizer, task, tokenizer.encode(text))


def ar_prompt(tokenizer: Tokenizer, task: str, ids: list[int]) -> list[int]:
    """What an AR model of `task` reads before its output: the source ids plus <sep> for seq2seq."""
    return ids + [tokenizer.sep_id] if task == "seq2seq" else ids


class CanvasDataset:
    """(source, canvas) pairs for the latent-diffusion models: the canvas is the target, <eos>, then <pad>
    up to `width(len(source))` (at least the target plus <eos>); a batch's canvases share the widest row's
    width. Continuation pairs (a prompt window and the window after it) get no <eos>: `eos=False`. Pairs whose
    canvas exceeds `max_len` or whose source exceeds `max_source` are left out (`dropped` counts them).

    Batches: {"source": (B, S) right-padded, "source_mask": (B, S) True at real tokens, "targets": (B, N)};
    with `with_source=False` only "targets" (the autoencoder's input). With `noise` (example index, canvas
    width -> that example's latent noise (width, d_latent): a coupled distillation's), also "noise" (B, N,
    d_latent), zero past a row's own canvas."""

    def __init__(self, examples: list[tuple[list[int], list[int]]], tokenizer: Tokenizer, width, max_len: int,
                 eos: bool = True, with_source: bool = True, max_source: int | None = None,
                 noise: Callable[[int, int], torch.Tensor] | None = None):
        self.pad_id, self.with_source, self.noise = tokenizer.pad_id, with_source, noise
        self.sources, self.canvases, self.examples = [], [], []  # examples: the index in `examples` of each
        for i, (src, tgt) in enumerate(examples):
            canvas = tgt + [tokenizer.eos_id] if eos else list(tgt)
            canvas += [self.pad_id] * (width(len(src)) - len(canvas))
            if src and len(canvas) <= max_len and len(src) <= (max_source or len(src)):
                self.sources.append(src)
                self.canvases.append(canvas)
                self.examples.append(i)
        if not self.canvases:
            raise DiffarError(f"no example fits in a canvas of {max_len} positions")
        self.dropped = len(examples) - len(self.canvases)
        self.by_length = sorted(range(len(self)), key=lambda i: (len(self.canvases[i]), len(self.sources[i])))

    def __len__(self) -> int:
        return len(self.canvases)

    sample_indices = PairDataset.sample_indices

    def eval_indices(self, max_examples: int) -> list[int]:
        return list(range(len(self)))[:max_examples]

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        width = max(len(self.canvases[i]) for i in indices)
        targets = torch.tensor([self.canvases[i] + [self.pad_id] * (width - len(self.canvases[i]))
                                for i in indices])
        if not self.with_source:
            return {"targets": targets}
        source, source_mask = pad_right([self.sources[i] for i in indices], self.pad_id)
        batch = {"source": source, "source_mask": source_mask, "targets": targets}
        if self.noise is not None:
            rows = [self.noise(self.examples[i], len(self.canvases[i])) for i in indices]
            batch["noise"] = torch.stack([F.pad(z, (0, 0, 0, width - len(z))) for z in rows])
        return batch


def pad_right(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows -> (B, longest) ids right-padded with pad_id, and the mask of real tokens."""
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
    mask = torch.arange(width).unsqueeze(0) < torch.tensor([len(r) for r in rows]).unsqueeze(1)
    return ids, mask


def canvas_examples(corpus: Corpus, tokenizer: Tokenizer, prompt_len: int, target_len: int,
                    stride: int) -> list[tuple[list[int], list[int]]]:
    """(source, target) token pairs: a seq2seq corpus's pairs, or for continuation every `stride` tokens a
    window of `prompt_len` prompt tokens and the `target_len` tokens after it."""
    if corpus.task == "seq2seq":
        return list(zip(tokenizer.encode_batch([p.source for p in corpus.pairs]),
                        tokenizer.encode_batch([p.target for p in corpus.pairs])))
    pairs = []
    for ids in tokenizer.encode_batch(corpus.documents):
        for i in range(0, len(ids) - prompt_len - target_len + 1, stride):
            pairs.append((ids[i:i + prompt_len], ids[i + prompt_len:i + prompt_len + target_len]))
    return pairs
