"""The committed checkpoints load from their folders alone and keep the quality docs/benchmarks.md reports
(checked on a slice of the held-out splits, so a broken decoder or a damaged checkpoint shows up here)."""

import pytest

from diffar.checkpoint import load_checkpoint
from diffar.evaluation.evaluate import evaluate_checkpoint
from tests.conftest import ROOT

KJV, SHAKESPEARE = ROOT / "checkpoints" / "ar-kjv2web", ROOT / "checkpoints" / "ar-shakespeare"
VQVAE, DD2 = ROOT / "checkpoints" / "vqvae-kjv2web", ROOT / "checkpoints" / "dd2-kjv2web"


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
    assert report["perplexity"] < 90  # measured: 69.0 on these 50 windows (spread over the three works)


def test_vqvae_rebuilds_unseen_verses():
    """The DD2 autoencoder gives back held-out canvases (measured on the full test split: 99.39% token
    accuracy, 83.7% exact; docs/results/vqvae-kjv2web-test.json)."""
    _, _, meta = load_checkpoint(VQVAE)
    assert meta["kind"] == "vqvae" and meta["task"] == "seq2seq" and meta["model"]["preset"] == "small"
    report = evaluate_checkpoint(str(VQVAE), None, "test", limit=128, batch_size=32)
    assert report["token_accuracy"] > 0.985 and report["exact_sequence_rate"] > 0.7
    assert report["code_usage"] > 0.5


def test_shakespeare_vqvae_rebuilds_unseen_windows():
    """Measured on the full test split: 99.96% token accuracy, 92.9% exact
    (docs/results/vqvae-shakespeare-test.json)."""
    report = evaluate_checkpoint(str(ROOT / "checkpoints" / "vqvae-shakespeare"), None, "test", limit=32,
                                 batch_size=16)
    assert report["task"] == "continuation" and report["token_accuracy"] > 0.995
    assert report["exact_sequence_rate"] > 0.75


def test_dd2_translates_in_one_step_within_the_shipped_autoencoder():
    """The one-step generator carries the shipped autoencoder unchanged (at bf16), and its BLEU-4 on the first
    64 test verses holds (measured here: 67.5 in one step, 67.7 in two, 67.6 for the AR model's pick of two
    one-step samples, 67.3 with both models in bf16; AR 65.2; the full figures are in docs/benchmarks.md).
    A broken sampler or decoder reads near 0, a generator without its energy stage ~57, one with the
    300-step stage shipped before it 65.9; the AR judge's pick of two must score above one sample."""
    from diffar.evaluation.bench import bench_dd2
    from diffar.models.dd2 import same_weights

    model, _, meta = load_checkpoint(DD2)
    vqvae, _, _ = load_checkpoint(VQVAE)
    assert meta["kind"] == "dd2" and meta["model"]["prediction"] == "x0" and same_weights(model.vqvae, vqvae)
    records = {r.method: r.extra["bleu4"] for r in bench_dd2(str(DD2), str(KJV), None, 64, 256, [16],
                                                              ["dd2-1", "dd2-2", "dd2-1x2"])}
    assert records["dd2-1"] > 66.5 and records["dd2-2"] > 66.5
    assert records["dd2-1x2"] > records["dd2-1"]
    [bf16] = bench_dd2(str(DD2), str(KJV), None, 64, 256, [16], ["dd2-1"], dtype="bf16")
    assert abs(bf16.extra["bleu4"] - records["dd2-1"]) < 1 and bf16.forward_passes == 1


@pytest.mark.parametrize("name, ar_name, corpus, floor", [
    ("refusion-kjv2web", "ar-kjv2web", "kjv2web", 1.6), ("refusion-shakespeare", "ar-shakespeare", "shakespeare", 1.3),
])
def test_refusion_drafts_for_its_own_ar_model(name, ar_name, corpus, floor):
    """The shipped ReFusion models verify with the shipped AR weights, unchanged, produce their text exactly,
    and their diffusion streams still get drafts accepted (measured on these prompts at batch 1: 2.38 and
    1.41 tokens per AR pass; docs/benchmarks.md has the full runs)."""
    import torch

    from diffar.data.batching import prompt_ids
    from diffar.data.corpora import load_corpus
    from diffar.decoding.ar import generate
    from diffar.decoding.refusion import refusion_generate

    model, tokenizer, meta = load_checkpoint(ROOT / "checkpoints" / name)
    ar, _, _ = load_checkpoint(ROOT / "checkpoints" / ar_name)
    assert meta["kind"] == "refusion" and meta["model"]["freeze_ar"]
    for a, b in zip(model.ar.state_dict().values(), ar.state_dict().values()):
        assert torch.equal(a, b)
    test = load_corpus(corpus, "test")
    texts = [p.source for p in test.pairs[:8]] if test.task == "seq2seq" else [d[:300] for d in test.documents]
    prompts = [prompt_ids(tokenizer, test.task, t) for t in texts]
    result = refusion_generate(model, prompts, 48, eos_id=tokenizer.eos_id)
    assert result.tokens == generate(ar, prompts, 48, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id).tokens
    alone = [refusion_generate(model, [p], 48, eos_id=tokenizer.eos_id) for p in prompts]  # batch 1
    assert sum(r.new_tokens for r in alone) / sum(r.passes["target"] for r in alone) > floor


@pytest.mark.parametrize("name, ar_name, corpus, floor", [
    ("drafter-kjv2web", "ar-kjv2web", "kjv2web", 2.4), ("drafter-shakespeare", "ar-shakespeare", "shakespeare", 1.4),
])
def test_block_drafter_drafts_for_the_shipped_ar_model(name, ar_name, corpus, floor):
    """The shipped 7M block drafters name the shipped AR models as their targets, decode their text exactly (chain,
    and tree with prompt lookup's copies) and get drafts accepted (measured on these prompts at batch 1: 2.89 and
    1.66 tokens per AR pass for the chain; docs/benchmarks.md has the full runs)."""
    from diffar.data.corpora import load_corpus
    from diffar.decoding.refusion import DraftSchedule
    from diffar.generation import ARMethod, Options, RefusionMethod

    drafter, tokenizer, meta = load_checkpoint(ROOT / "checkpoints" / name)
    test = load_corpus(corpus, "test")
    assert meta["kind"] == "drafter" and meta["target"] == f"checkpoints/{ar_name}" and meta["task"] == test.task
    texts = [p.source for p in test.pairs[:8]] if test.task == "seq2seq" else [d[:300] for d in test.documents]
    ar = ARMethod(drafter.target, tokenizer, meta["task"])
    prompts = [ar.prompt(t) for t in texts]
    settings = ar.settings(Options())
    plain = ar.generate(prompts, 48, settings).tokens
    for schedule in (DraftSchedule(), DraftSchedule(tree=24, lookup=True)):
        assert RefusionMethod(drafter, tokenizer, meta["task"], schedule=schedule).generate(
            prompts, 48, settings).tokens == plain
    chain = RefusionMethod(drafter, tokenizer, meta["task"])
    alone = [chain.generate([p], 48, settings) for p in prompts]  # batch 1
    assert sum(r.new_tokens + sum(r.ended) for r in alone) / sum(r.passes["target"] for r in alone) > floor
