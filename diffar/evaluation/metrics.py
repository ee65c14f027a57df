"""Text-quality metrics, computed by the reference libraries (sacrebleu, rouge-score), never re-implemented."""

from __future__ import annotations

import math

import sacrebleu
import torch
from rouge_score import rouge_scorer
from tqdm import tqdm

from diffar.data.batching import IGNORE_INDEX
from diffar.decoding.ar import log_likelihoods


def bleu4(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU-4 with sacrebleu's defaults (13a tokenisation, exponential smoothing), 0-100."""
    return sacrebleu.corpus_bleu(hypotheses, [references]).score


def chrf(hypotheses: list[str], references: list[str]) -> float:
    return sacrebleu.corpus_chrf(hypotheses, [references]).score


def rouge_l(hypotheses: list[str], references: list[str]) -> float:
    """Mean ROUGE-L F1 over sentence pairs, 0-100."""
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    scores = [scorer.score(ref, hyp)["rougeL"].fmeasure for hyp, ref in zip(hypotheses, references)]
    return 100 * sum(scores) / max(1, len(scores))


def text_metrics(hypotheses: list[str], references: list[str]) -> dict[str, float]:
    return {
        "bleu4": round(bleu4(hypotheses, references), 2),
        "chrf": round(chrf(hypotheses, references), 2),
        "rougeL": round(rouge_l(hypotheses, references), 2),
    }


def repetition(outputs: list[list[int]], n: int = 4) -> float:
    """seq-rep-n (Welleck et al. 2019, arXiv 1908.04319): the share of each output's n-grams that repeat an
    earlier one, 1 - distinct / total, averaged over outputs that have any; 0-100. A low perplexity can come
    from text that loops; this number tells."""
    scores = []
    for out in outputs:
        grams = [tuple(out[i:i + n]) for i in range(len(out) - n + 1)]
        if grams:
            scores.append(1 - len(set(grams)) / len(grams))
    return 100 * sum(scores) / max(1, len(scores))


def slot_agreement(outputs: list[list[int]], references: list[list[int]]) -> float:
    """The share of slots, position by position over each pair's common length, where an output has its
    reference's token (0-1): how closely a one-step canvas follows a given text."""
    pairs = [(a, b) for out, ref in zip(outputs, references) for a, b in zip(out, ref)]
    return sum(a == b for a, b in pairs) / len(pairs)


def unigram_entropy(outputs: list[list[int]]) -> float:
    """The entropy (nats) of each output's token frequencies, averaged over outputs that have any: low for
    text that repeats a few tokens (a collapsed generator), near the language's own for varied text. With
    a judge's perplexity and seq-rep-4 (as DD1 and MDLM report generated text), degenerate text cannot score
    well on all three."""
    scores = []
    for out in outputs:
        if out:
            p = torch.bincount(torch.tensor(out)).double() / len(out)
            scores.append(float(-(p[p > 0] * p[p > 0].log()).sum()))
    return sum(scores) / max(1, len(scores))


def perplexity(mean_nll: float) -> float:
    return math.exp(min(mean_nll, 50.0))


@torch.no_grad()
def mean_nll(model, dataset, batch_size: int, max_examples: int | None = None,
             device: torch.device | str = "cpu", progress: bool = False) -> float:
    """Token-weighted mean negative log-likelihood over the dataset's evaluation examples (`progress`: a bar)."""
    idx = dataset.eval_indices(max_examples or len(dataset))
    total, count = 0.0, 0
    for i in tqdm(range(0, len(idx), batch_size), desc="scoring", unit="batch", dynamic_ncols=True,
                  disable=not progress):
        batch = {k: v.to(device) for k, v in dataset.batch(idx[i:i + batch_size]).items()}
        n = int((batch["targets"] != IGNORE_INDEX).sum())
        _, loss = model(**batch)
        total, count = total + float(loss) * n, count + n
    return total / count


def conditional_perplexity(model, prompts: list[list[int]], outputs: list[list[int]], batch_size: int = 16) -> float:
    """Perplexity of each output given its prompt under an AR model, token-weighted over all rows."""
    total = sum(-float(log_likelihoods(model, prompts[i:i + batch_size], outputs[i:i + batch_size]).sum())
                for i in range(0, len(prompts), batch_size))
    count = sum(map(len, outputs))
    return perplexity(total / max(1, count))
