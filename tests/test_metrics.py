import math

import pytest

import sacrebleu
from rouge_score import rouge_scorer

from diffar.evaluation.metrics import bleu4, chrf, perplexity, repetition, rouge_l, text_metrics

HYP = ["The cat sat on the mat.", "Yahweh is my shepherd: I shall lack nothing."]
REF = ["The cat is sitting on the mat.", "Yahweh is my shepherd; I shall lack nothing."]


def test_bleu_and_chrf_equal_sacrebleu():
    assert bleu4(HYP, REF) == sacrebleu.corpus_bleu(HYP, [REF]).score
    assert chrf(HYP, REF) == sacrebleu.corpus_chrf(HYP, [REF]).score
    assert 0 < bleu4(HYP, REF) < 100


def test_hand_computed_bleu():
    # every n-gram of the 6-word hypothesis is in the 7-word reference: precisions 1, brevity 1 - 7/6
    assert bleu4(["the cat sat on the mat"], ["the cat sat on the mat today"]) == pytest.approx(
        100 * math.exp(1 - 7 / 6), abs=1e-6)


def test_known_values():
    assert bleu4(REF, REF) == pytest.approx(100.0)
    assert bleu4(["completely different words here"], ["nothing shared at all today"]) == 0.0
    assert perplexity(math.log(7.0)) == pytest.approx(7.0)


def test_rouge_l_is_mean_f1():
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    expected = 100 * sum(scorer.score(r, h)["rougeL"].fmeasure for h, r in zip(HYP, REF)) / 2
    assert rouge_l(HYP, REF) == expected
    assert set(text_metrics(HYP, REF)) == {"bleu4", "chrf", "rougeL"}


def test_repetition_is_the_share_of_repeated_ngrams():
    assert repetition([[1, 2, 3, 4, 5, 6]]) == 0.0
    assert repetition([[7] * 10]) == pytest.approx(100 * 6 / 7)  # 7 four-grams, one distinct
    # (1 2 3 4) comes back once among 5 four-grams; outputs shorter than n are left out of the mean
    assert repetition([[1, 2, 3, 4, 1, 2, 3, 4], [1, 2]]) == pytest.approx(100 * 1 / 5)
    assert repetition([[1, 2, 1, 2]], n=2) == pytest.approx(100 * 1 / 3)
