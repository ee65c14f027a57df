"""The committed checkpoints load from their folders alone and keep the quality docs/benchmarks.md reports
(checked on a slice of the held-out splits, so a broken decoder or a damaged checkpoint shows up here)."""

import pytest

from diffar.checkpoint import load_checkpoint
from diffar.evaluation.evaluate import evaluate_checkpoint
from tests.conftest import ROOT

KJV, SHAKESPEARE = ROOT / "checkpoints" / "ar-kjv2web", ROOT / "checkpoints" / "ar-shakespeare"


@pytest.mark.parametrize("name, task, preset", [
    ("ar-kjv2web", "seq2seq", "small"), ("ar-shakespeare", "continuation", "small"),
    ("draft-kjv2web", "seq2seq", "draft"), ("draft-shakespeare", "continuation", "draft"),
])
def test_checkpoint_is_self_contained(name, task, preset):
    model, tokenizer, meta = load_checkpoint(ROOT / "checkpoints" / name)
    assert meta["task"] == task and meta["model"]["preset"] == preset
    assert 3e6 < model.num_params() < 10e6 and tokenizer.vocab_size == model.config.vocab_size


def test_kjv2web_beats_copying_the_source():
    report = evaluate_checkpoint(str(KJV), None, "test", limit=64, batch_size=16)
    assert report["model"]["bleu4"] > report["copy_source_baseline"]["bleu4"] + 8  # measured: 65.2 vs 51.0
    assert report["perplexity"] < 4


def test_shakespeare_perplexity_on_unseen_works():
    report = evaluate_checkpoint(str(SHAKESPEARE), None, "test", limit=50, batch_size=16)
    assert report["perplexity"] < 90  # measured: 71.1 on these 50 windows
