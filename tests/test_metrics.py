"""Metrics on inputs small enough to score by hand: each expected value is derived in its comment."""

import math

import pytest
import torch

from diffar.evaluation.metrics import bleu4, chrf, conditional_perplexity, perplexity, repetition, rouge_l, \
    text_metrics, unigram_entropy
from diffar.models.transformer import Transformer, TransformerConfig

SAME = ["The cat sat on the mat.", "Yahweh is my shepherd: I shall lack nothing."]


def test_identical_texts_score_100_and_disjoint_ones_0():
    assert text_metrics(SAME, SAME) == {"bleu4": 100.0, "chrf": 100.0, "rougeL": 100.0}
    assert text_metrics(["abc def"], ["xyz uvw"]) == {"bleu4": 0.0, "chrf": 0.0, "rougeL": 0.0}


def test_bleu_is_the_geometric_mean_of_the_ngram_precisions():
    # one word of five differs, the last: 1- to 4-gram precisions 4/5, 3/4, 2/3, 1/2; same length, so no
    # brevity penalty: 100 * (4/5 * 3/4 * 2/3 * 1/2) ** (1/4) = 100 * 5 ** -0.25
    assert bleu4(["one two three four five"], ["one two three four six"]) == pytest.approx(100 * 5 ** -0.25)


def test_bleu_brevity_penalty():
    # every n-gram of the 6-word hypothesis is in the 7-word reference: precisions 1, brevity exp(1 - 7/6)
    assert bleu4(["the cat sat on the mat"], ["the cat sat on the mat today"]) == pytest.approx(
        100 * math.exp(1 - 7 / 6))


def test_bleu_is_pooled_over_the_corpus_not_averaged():
    # the pair above plus an identical 5-word one: counts add up before the precisions are taken
    # (1-grams 9/10, 2-grams 7/8, 3-grams 5/6, 4-grams 3/4, lengths 10 = 10)
    score = bleu4(["one two three four five", "a b c d e"], ["one two three four six", "a b c d e"])
    assert score == pytest.approx(100 * (9 / 10 * 7 / 8 * 5 / 6 * 3 / 4) ** 0.25)


@pytest.mark.parametrize("hyp, ref, expected", [
    # character 1- to 3-grams match 2/3, 1/2, 0/1 both ways: precision = recall = (2/3 + 1/2 + 0) / 3
    ("abc", "abd", 7 / 18),
    # precision 1 at orders 1 and 2, recall (2/4 + 1/3) / 2 = 5/12; F-beta with beta 2 weighs recall:
    # 5 P R / (4 P + R) = 25/53
    ("ab", "abcd", 25 / 53),
])
def test_chrf_averages_character_ngram_precision_and_recall(hyp, ref, expected):
    assert chrf([hyp], [ref]) == pytest.approx(100 * expected)


def test_rouge_l_is_the_mean_lcs_f1_over_pairs():
    # longest common subsequence "the cat on the mat": 5 of 6 hypothesis words, 5 of 7 reference words,
    # F1 = 2 (5/6)(5/7) / (5/6 + 5/7) = 10/13 (punctuation and case are ignored)
    one = rouge_l(["The cat sat on the mat."], ["the cat is sitting on the mat"])
    assert one == pytest.approx(100 * 10 / 13)
    assert rouge_l(["The cat sat on the mat.", "x"], ["the cat is sitting on the mat", "x"]) == \
        pytest.approx((100 * 10 / 13 + 100) / 2)


def test_repetition_is_the_share_of_repeated_ngrams():
    assert repetition([[1, 2, 3, 4, 5, 6]]) == 0.0
    assert repetition([[7] * 10]) == pytest.approx(100 * 6 / 7)  # 7 four-grams, one distinct
    # (1 2 3 4) comes back once among 5 four-grams; outputs shorter than n are left out of the mean
    assert repetition([[1, 2, 3, 4, 1, 2, 3, 4], [1, 2]]) == pytest.approx(100 * 1 / 5)
    assert repetition([[1, 2, 1, 2]], n=2) == pytest.approx(100 * 1 / 3)


def test_unigram_entropy_is_low_for_collapsed_text():
    assert unigram_entropy([[7] * 10]) == 0.0
    assert unigram_entropy([[1, 2, 3, 4]]) == pytest.approx(math.log(4))
    # averaged over outputs; an empty output is left out
    assert unigram_entropy([[1, 1, 2, 2], [5, 5], []]) == pytest.approx(math.log(2) / 2)


def test_perplexity_is_exp_of_the_mean_nll_capped():
    assert perplexity(math.log(7.0)) == pytest.approx(7.0)
    assert perplexity(1000.0) == math.exp(50.0)  # a diverged model still gives a finite number


def test_conditional_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    # all-zero weights give all-zero logits: every token has probability 1/100, whatever the context
    model = Transformer(TransformerConfig.from_preset("tiny", vocab_size=100)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    prompts, outputs = [[5, 6, 7], [8]], [[9, 10], [11, 12, 13, 14]]
    assert conditional_perplexity(model, prompts, outputs) == pytest.approx(100.0, rel=1e-5)
