"""Coupled distillation (`distill dd2 --coupled`): each example's target is the teacher's sample for a noise of
its own, which the generator reads at training and can be given at sampling."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_TRAIN, assert_clean_error, random_model, run_cli
from dd2_helpers import VOCAB, inputs, random_dd2, sources
from diffar.checkpoint import load_ar, load_checkpoint
from diffar.data.batching import CanvasDataset, canvas_examples
from diffar.data.corpora import load_corpus
from diffar.decoding.ar import generate
from diffar.decoding.dd2 import dd2_generate
from diffar.decoding.sampling import SamplingConfig
from diffar.errors import DiffarError
from diffar.models.dd2 import example_noise, token_noise
from diffar.tokenizer import Tokenizer
from diffar.training.distill import teacher_outputs

SAMPLING = SamplingConfig(temperature=1.0, top_p=0.9)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
BUDGETS = [6, 3, 5, 6]


def noise_for(seed, budgets=BUDGETS, d_latent=8):
    return [token_noise(example_noise(seed, i, budget, d_latent)) for i, budget in enumerate(budgets)]


def samples(cache, seed=0, sampling=SAMPLING):
    return teacher_outputs(random_model(0), PROMPTS, BUDGETS, cache, pad_id=0, eos_id=None, batch_size=3,
                           sampling=sampling, noise=noise_for(seed))


def test_example_noise_is_rebuilt_from_seed_and_index():
    assert torch.equal(example_noise(3, 7, 16, 8), example_noise(3, 7, 16, 8))
    assert not torch.equal(example_noise(3, 7, 16, 8), example_noise(3, 8, 16, 8))
    assert not torch.equal(example_noise(3, 7, 16, 8), example_noise(4, 7, 16, 8))
    z = example_noise(0, 0, 16, 8)
    assert torch.equal(token_noise(z), z[:, 0])


def test_the_teacher_samples_what_its_noise_determines(tmp_path):
    """Each output is the teacher's sample for that example's noise alone (batched with rows of other
    budgets, whose noise is padded): deterministic given the seed, another for another seed or example."""
    out = samples(tmp_path / "a.jsonl")
    teacher = random_model(0)
    for prompt, budget, noise, row in zip(PROMPTS, BUDGETS, noise_for(0), out):
        alone = generate(teacher, [prompt], budget, pad_id=0, eos_id=None, sampling=SAMPLING, noise=noise[None])
        assert row == alone.tokens[0]
    assert samples(tmp_path / "b.jsonl") == out
    assert samples(tmp_path / "c.jsonl", seed=1) != out
    greedy = teacher_outputs(teacher, PROMPTS, BUDGETS, tmp_path / "g.jsonl", pad_id=0, eos_id=None)
    assert greedy != out  # the samples are not the greedy text


def test_a_cache_of_other_sampling_or_noise_is_refused(tmp_path):
    cache = tmp_path / "teacher.jsonl"
    samples(cache)
    for other in (dict(seed=1), dict(sampling=SamplingConfig(temperature=0.5, top_p=0.9))):
        with pytest.raises(DiffarError, match="other data"):
            samples(cache, **other)
    with pytest.raises(DiffarError, match="other data"):  # nor do greedy outputs reuse it
        teacher_outputs(random_model(0), PROMPTS, BUDGETS, cache, pad_id=0, eos_id=None)


def test_canvases_carry_their_examples_noise(tokenizer_path):
    """A batch's noise is each kept example's own (by its index among the examples, whatever was left out)."""
    examples = [([5, 6], [7] * 4), ([8], [9] * 40), ([10, 11, 12], [13] * 4)]  # the second is too long

    def noise(i, width):
        return example_noise(0, i, width, 8)

    data = CanvasDataset(examples, Tokenizer.load(tokenizer_path), lambda n: 4, max_len=8, eos=False, noise=noise)
    batch = data.batch([1, 0])
    assert data.dropped == 1 and batch["noise"].shape == (2, 4, 8)
    assert torch.equal(batch["noise"][0], noise(2, 4)) and torch.equal(batch["noise"][1], noise(0, 4))


def denoiser_inputs(model, batch, noise, seed):
    """The z_t each denoiser pass of a training forward read, under torch seed `seed`."""
    seen = []
    hook = model.denoiser.register_forward_hook(lambda module, args, out: seen.append(args[0].clone()))
    torch.manual_seed(seed)
    model(**batch, noise=noise)
    hook.remove()
    return seen


def test_training_reads_the_examples_noise():
    """At t = 1 the denoiser reads the example's noise (up to alpha_bar(1)'s trace of z0), whatever the
    torch seed; a one-step draft to refine starts from it too. Without it, the noise is fresh."""
    model = random_dd2(prediction="x0", full_noise_prob=1.0, cond_drop=0.0)
    noise, _, source, source_mask = inputs(model, width=model.config.vqvae.target_len)
    batch = dict(source=source, source_mask=source_mask,
                 targets=torch.randint(5, VOCAB, noise.shape[:2], generator=torch.Generator().manual_seed(0)))
    first, again = denoiser_inputs(model, batch, noise, 0), denoiser_inputs(model, batch, noise, 1)
    assert torch.equal(first[0], again[0]) and torch.allclose(first[0], noise, atol=0.05)
    assert not torch.equal(denoiser_inputs(model, batch, None, 0)[0], denoiser_inputs(model, batch, None, 1)[0])
    model.config.full_noise_prob, model.config.refine_prob = 0.0, 1.0  # every row refines its draft
    assert torch.equal(denoiser_inputs(model, batch, noise, 2)[0], noise)


def test_sampling_takes_the_noise():
    """Given noise samples what the same noise drawn from a generator does; a continuation longer than a
    canvas reads one canvas of it per canvas; a noise of the wrong shape is a clear error."""
    model = random_dd2(prediction="x0")
    src, canvas, d = sources(2), model.config.vqvae.target_len, model.config.vqvae.d_latent
    first = torch.randn(2, canvas, d, generator=torch.Generator().manual_seed(4))
    drawn = dd2_generate(model, src, canvas, generator=torch.Generator().manual_seed(4))
    assert dd2_generate(model, src, canvas, noise=first).tokens == drawn.tokens
    z = torch.cat([first, torch.randn(2, canvas, d)], dim=1)
    two = dd2_generate(model, src, 2 * canvas, noise=z).tokens
    assert [row[:canvas] for row in two] == drawn.tokens
    with pytest.raises(DiffarError, match="noise must be"):
        dd2_generate(model, src, canvas, noise=z)


def test_cli_coupled(tiny_vqvae, tiny_shakespeare_run, tmp_path):
    """`distill dd2 --coupled` records its coupling in the checkpoint and distils the teacher's sample for
    each example's noise; a rerun with other sampling refuses the stale cache; sampling flags need --coupled."""
    out = tmp_path / "coupled"
    args = ("distill", "dd2", "--teacher", tiny_shakespeare_run, "--vqvae", tiny_vqvae, "--canvas-len", "16",
            "--corpus", "shakespeare", "--teacher-examples", "6", "--max-steps", "2", "--out", out, *TINY_TRAIN)
    proc = run_cli(*args, "--coupled", "--temperature", "1.5", "--refine-prob", "0.5")
    assert proc.returncode == 0, proc.stderr
    model, tokenizer, meta = load_checkpoint(out)
    cfg = model.config
    assert (cfg.coupled, cfg.teacher_temperature, cfg.teacher_top_p) == (True, 1.5, 0.95)
    teacher = load_ar(tiny_shakespeare_run, tokenizer, "--teacher")
    pairs = canvas_examples(load_corpus("shakespeare", "train"), tokenizer, cfg.vqvae.prompt_len, 16,
                            stride=cfg.vqvae.prompt_len)
    records = sorted((json.loads(line) for line in (out / "teacher.jsonl").read_text().splitlines()),
                     key=lambda r: r["i"])
    for i in (0, 5):
        noise = token_noise(example_noise(meta["train"]["seed"], i, 16, cfg.vqvae.d_latent))
        sample = generate(teacher, [pairs[i * len(pairs) // 6][0]], 16, pad_id=tokenizer.pad_id, eos_id=None,
                          sampling=SamplingConfig(temperature=1.5, top_p=0.95), noise=noise[None])
        assert records[i]["out"] == sample.tokens[0]
    assert_clean_error(run_cli(*args, "--coupled", "--temperature", "0.5"), "holds teacher outputs for other data")
    assert_clean_error(run_cli(*args, "--top-p", "0.9", "--out", tmp_path / "greedy"), "add --coupled")
