"""DD2 sampling (decoding/dd2.py): one step, DDIM, canvases, pins, hybrid, best of n."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import random_model
from dd2_helpers import EOS, VOCAB, random_dd2, sources
from diffar.data.batching import pad_right
from diffar.decoding.ar import generate, log_likelihoods
from diffar.decoding.dd2 import DD2Sampling, adaptive_steps, best_of_generate, dd2_generate, hybrid_generate
from diffar.errors import DiffarError
from diffar.generation.dd2 import CONTINUATION_ROOM, DD2Method


def test_sampling_policies():
    assert DD2Sampling.from_preset("speed") == DD2Sampling(steps=30, tau_max=0.7, guidance_scale=1.5)
    assert DD2Sampling.from_preset("quality", steps=7).steps == 7
    assert [adaptive_steps(n) for n in (10, 300, 600)] == [51, 80, 100]
    assert DD2Sampling(adaptive=True).steps_for(300) == 80
    s = DD2Sampling(tau_max=0.7, tau_min=0.1)
    assert (s.tau(1.0), s.tau(0.5), s.tau(0.0)) == (0.1, pytest.approx(0.35), 0.7)
    for bad, message in [(dict(steps=0), "steps must be positive"), (dict(guidance_scale=-1.0), "guidance"),
                         (dict(sampler="euler"), "unknown sampler"), (dict(tau_max=-0.1), "temperatures")]:
        with pytest.raises(DiffarError, match=message):
            DD2Sampling(**bad)
    with pytest.raises(DiffarError, match="unknown sampling preset"):
        DD2Sampling.from_preset("fast")


@pytest.mark.parametrize("sampling", [DD2Sampling(), DD2Sampling(steps=5, guidance_scale=2.0),
                                      DD2Sampling(steps=4, sampler="ddpm", tau_max=0.5)])
def test_generate_is_deterministic_and_counts_passes(sampling):
    model = random_dd2(eos_id=EOS)
    src = sources()
    runs = [dd2_generate(model, src, 50, sampling=sampling, eos_id=EOS, generator=torch.Generator().manual_seed(9))
            for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].extra["steps"] == runs[0].forward_passes == sampling.steps and runs[0].passes["decoder"] == 1
    width = max(model.config.vqvae.width(len(s)) for s in src)
    assert all(len(row) <= width and EOS not in row for row in runs[0].tokens)
    other = dd2_generate(model, src, 50, sampling=sampling, eos_id=EOS, generator=torch.Generator().manual_seed(10))
    assert other.tokens != runs[0].tokens  # the noise matters


def test_one_step_is_the_network_output_decoded():
    """One step from t = 1: the x0 network's output read out by argmax, each row cut at its first <eos>."""
    model = random_dd2(prediction="x0", eos_id=EOS)
    src = sources(2)
    result = dd2_generate(model, src, 50, eos_id=EOS, generator=torch.Generator().manual_seed(5))
    width = max(model.config.vqvae.width(len(s)) for s in src)
    z = torch.randn(2, width, model.config.vqvae.d_latent, generator=torch.Generator().manual_seed(5))
    source = torch.zeros(2, max(map(len, src)), dtype=torch.long)
    mask = torch.zeros_like(source, dtype=torch.bool)
    for i, s in enumerate(src):
        source[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), True
    widths = [model.config.vqvae.width(len(s)) for s in src]
    canvas = torch.arange(width) < torch.tensor(widths)[:, None]
    with torch.no_grad():
        ids = model.decode(model.denoiser(z, torch.ones(2), source, mask, canvas), canvas).argmax(-1).tolist()
    ids = [row[:w] for row, w in zip(ids, widths)]
    ends = [next((i for i, t in enumerate(row) if t in (EOS, 0)), len(row)) for row in ids]
    assert result.tokens == [row[:end] for row, end in zip(ids, ends)]


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_batched_rows_do_not_see_each_others_canvas(guidance):
    """A batch shares the longest row's canvas width; the positions past a row's own width are masked out of
    the denoiser and the decoder, so each row's logits are those it gets alone."""
    model = random_dd2(prediction="x0", eos_id=EOS)
    src = [[7, 8, 9], list(range(10, 40)), [41, 42, 43, 44, 45, 46]]
    widths = [model.config.vqvae.width(len(s)) for s in src]
    z = torch.randn(3, max(widths), model.config.vqvae.d_latent, generator=torch.Generator().manual_seed(2))
    source, mask = pad_right(src, 0)
    canvas = torch.arange(max(widths)) < torch.tensor(widths)[:, None]
    with torch.no_grad():
        batched = model.decode(model.predict(z, torch.ones(3), source, mask, guidance, canvas), canvas)
        for i, (s, w) in enumerate(zip(src, widths)):
            alone = model.decode(model.predict(z[i:i + 1, :w], torch.ones(1), torch.tensor([s]),
                                               torch.ones(1, len(s), dtype=torch.bool), guidance))
            torch.testing.assert_close(batched[i, :w], alone[0], atol=1e-4, rtol=1e-4)


def test_seq2seq_text_ends_at_eos_or_padding():
    """A one-step canvas often marks the end of its text by padding alone: the text stops at the first <eos>
    or <pad> (so padding is never counted as generated tokens); a continuation canvas has no end."""
    canvases = torch.tensor([[7, 8, 0, 9, EOS, 0], [7, EOS, 8, 0, 0, 0], [7, 8, 9, 10, 11, 12]])
    model = random_dd2(prediction="x0", eos_id=EOS)
    model.decode = lambda z0, canvas_mask=None: F.one_hot(canvases[:, :z0.shape[1]], VOCAB).float()
    src = [[5, 6, 7]] * 3
    assert dd2_generate(model, src, 50, eos_id=EOS).tokens == [[7, 8], [7], [7, 8, 9, 10, 11, 12]]
    assert dd2_generate(model, src, 50, eos_id=None).tokens == canvases.tolist()
    # a pin past the end: the canvas may not end before it (<pad> and <eos> ruled out there)
    wide = F.pad(canvases, (0, model.config.canvas_width(3) - canvases.shape[1]))  # pinning re-encodes it all
    model.decode = lambda z0, canvas_mask=None: F.one_hot(wide, VOCAB).float()
    pinned = dd2_generate(model, src, 50, eos_id=EOS, fixed=[{4: 30}, {}, {}]).tokens
    assert pinned == [[7, 8, 1, 9, 30], [7], [7, 8, 9, 10, 11, 12]]


def test_snapshots_and_max_new():
    model = random_dd2(eos_id=None)
    seen = []
    result = dd2_generate(model, sources(2), 7, sampling=DD2Sampling(steps=3),
                          generator=torch.Generator().manual_seed(0), on_step=lambda i, rows: seen.append(i))
    assert seen == [0, 1, 2] and all(len(row) == 7 for row in result.tokens)
    # watching a sampled run (tau > 0) does not change it: snapshots draw nothing from its generator
    hot = DD2Sampling(steps=3, tau_max=1.0, tau_min=0.5)
    watched = dd2_generate(model, sources(2), 7, sampling=hot, generator=torch.Generator().manual_seed(0),
                           on_step=lambda i, rows: None)
    assert watched.tokens == dd2_generate(model, sources(2), 7, sampling=hot,
                                          generator=torch.Generator().manual_seed(0)).tokens
    with pytest.raises(DiffarError, match="max_new"):
        dd2_generate(model, sources(2), 0)
    with pytest.raises(DiffarError, match="at least one token"):
        dd2_generate(model, [[5], []], 4)


def test_continuation_past_one_canvas_samples_canvas_after_canvas(tokenizer):
    """A continuation longer than the canvas: each canvas reads the last prompt_len tokens of the prompt and
    the text so far, and draws its noise from the same generator in turn; pins and snapshots are placed at
    their output positions."""
    model = random_dd2(eos_id=None)
    vq = model.config.vqvae  # tiny: canvases of 32 tokens after prompts of 16
    src, sampling = sources(2), DD2Sampling(steps=2)
    g = torch.Generator().manual_seed(0)
    expected, prompts = [[], []], src
    for n in (32, 32, 16):
        part = dd2_generate(model, prompts, n, sampling=sampling, generator=g).tokens
        expected = [e + p for e, p in zip(expected, part)]
        prompts = [(s + e)[-vq.prompt_len:] for s, e in zip(src, expected)]
    seen = []
    result = dd2_generate(model, src, 80, sampling=sampling, generator=torch.Generator().manual_seed(0),
                          on_step=lambda i, rows: seen.append([len(r) for r in rows]))
    assert result.tokens == expected and len(result.tokens[0]) == 80
    assert (result.extra["steps"], result.forward_passes) == (2, 6)
    assert seen == [[32, 32]] * 2 + [[64, 64]] * 2 + [[80, 80]] * 2  # each step: the text so far plus this canvas
    pinned = dd2_generate(model, src, 80, sampling=sampling, fixed=[{40: 7, 79: 9}, {}],
                          generator=torch.Generator().manual_seed(0))
    assert (pinned.tokens[0][40], pinned.tokens[0][79]) == (7, 9) and pinned.tokens[0][:32] == expected[0][:32]
    with pytest.raises(DiffarError, match="within the 80 tokens"):
        dd2_generate(model, src, 80, fixed=[{80: 7}, {}])
    # served, a continuation request may ask for more than one canvas; a seq2seq one for its canvas
    assert DD2Method(model, tokenizer, "continuation").room(src[0]) == CONTINUATION_ROOM
    seq2seq = random_dd2(eos_id=EOS)
    assert DD2Method(seq2seq, tokenizer, "seq2seq").room(src[0]) == seq2seq.config.canvas_width(len(src[0]))


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("prediction", ["x0", "eps"])
def test_pinned_tokens_are_kept_and_change_only_their_row(steps, prediction):
    model = random_dd2(prediction=prediction, eos_id=EOS)
    src = sources(3)
    sampling = DD2Sampling(steps=steps)
    free = dd2_generate(model, src, 40, sampling=sampling, eos_id=EOS, generator=torch.Generator().manual_seed(0))
    pins = [{1: 7, 5: 9}, {}, {0: free.tokens[2][0]}]
    pinned = dd2_generate(model, src, 40, sampling=sampling, eos_id=EOS, fixed=pins,
                          generator=torch.Generator().manual_seed(0))
    assert pinned.tokens[0][1] == 7 and pinned.tokens[0][5] == 9 and pinned.tokens[0] != free.tokens[0]
    assert pinned.tokens[1] == free.tokens[1]  # rows without pins sample as before
    assert pinned.tokens[2][0] == free.tokens[2][0]
    assert pinned.passes["decoder"] == free.passes["decoder"] + steps  # the pins are re-encoded after every step
    with pytest.raises(DiffarError, match="within its canvas"):
        dd2_generate(model, src, 40, eos_id=EOS, fixed=[{}, {99: 5}, {}])


def test_hybrid_is_one_step_prefix_then_ar_continuation():
    model, ar = random_dd2(eos_id=None), random_model(1)
    src = sources(3)
    prompts = [s[-8:] for s in src]
    hybrid = hybrid_generate(model, ar, src, prompts, 20, prefix=6, generator=torch.Generator().manual_seed(2))
    one = dd2_generate(model, src, 6, generator=torch.Generator().manual_seed(2))
    rest = generate(ar, [p + t for p, t in zip(prompts, one.tokens)], 14, pad_id=0, eos_id=None)
    assert hybrid.tokens == [t + r for t, r in zip(one.tokens, rest.tokens)]
    assert hybrid.forward_passes == one.forward_passes + rest.forward_passes
    assert hybrid.origins == [["diffusion"] * 6 + ["ar"] * 14] * 3  # who wrote which


def test_hybrid_continues_the_seq2seq_texts_that_did_not_end():
    """A seq2seq canvas that filled its width without marking an end (<eos> or <pad>) is cut text: AR
    continues it, even when the canvas is narrower than the prefix. A text that ended is done."""
    model, ar = random_dd2(eos_id=EOS), random_model(1)
    src = sources(6)
    prompts = [s + [3] for s in src]
    hybrid = hybrid_generate(model, ar, src, prompts, 30, prefix=50, eos_id=EOS,
                             generator=torch.Generator().manual_seed(0))
    one = dd2_generate(model, src, 30, eos_id=EOS, generator=torch.Generator().manual_seed(0))
    assert any(one.ended) and not all(one.ended)
    for i, (prompt, toks) in enumerate(zip(prompts, one.tokens)):
        assert one.ended[i] == (len(toks) < model.config.canvas_width(len(src[i])))
        rest = [] if one.ended[i] else generate(ar, [prompt + toks], 30 - len(toks), pad_id=0, eos_id=EOS).tokens[0]
        assert hybrid.tokens[i] == toks + rest


@pytest.mark.parametrize("prediction", ["x0", "eps"])
def test_bf16_network_samples_like_fp32(prediction):
    """A bf16 network samples what its fp32 original does, but for rounding, at 1 step and at 100: the sample
    and the scheduler's math stay fp32 (in bf16, alpha_bar near t = 0 rounds to 1 and DDIM divides by 0)."""
    model, src = random_dd2(prediction=prediction), sources(3)
    for steps in (1, 100):
        sampling = DD2Sampling(steps=steps)
        full = dd2_generate(model, src, 12, sampling=sampling, generator=torch.Generator().manual_seed(0)).tokens
        half = dd2_generate(model.to(torch.bfloat16), src, 12, sampling=sampling,
                            generator=torch.Generator().manual_seed(0)).tokens
        model.float()
        same = sum(a == b for x, y in zip(full, half) for a, b in zip(x, y))
        assert same >= 0.8 * sum(map(len, full)), (steps, full, half)


@pytest.mark.parametrize("eos_id", [EOS, None])
def test_best_of_keeps_the_judges_likeliest_sample(eos_id):
    """Each row keeps, of its n samples (drawn as one batch with that row repeated n times), the one with
    the highest mean log-probability per token under the judge, the <eos> of a seq2seq text that ended
    counted."""
    model, judge, n = random_dd2(eos_id=eos_id), random_model(1), 4
    src = sources(3)
    prompts = [s + [3] for s in src]
    best = best_of_generate(model, judge, src, prompts, 12, sampling=DD2Sampling(best_of=n), eos_id=eos_id,
                            generator=torch.Generator().manual_seed(5))
    samples = dd2_generate(model, [s for s in src for _ in range(n)], 12, eos_id=eos_id,
                           generator=torch.Generator().manual_seed(5)).tokens
    assert any(len(set(map(tuple, samples[i * n:i * n + n]))) > 1 for i in range(len(src)))  # a choice to make
    widths = [min(12, model.config.canvas_width(len(s))) for s in src for _ in range(n)]
    scored = [t + [EOS] if eos_id is not None and len(t) < w else t  # a text that marked its end: with its <eos>
              for t, w in zip(samples, widths)]
    for i, prompt in enumerate(prompts):
        mine, texts = samples[i * n:i * n + n], scored[i * n:i * n + n]
        scores = log_likelihoods(judge, [prompt] * n, texts) / torch.tensor(list(map(len, texts)))
        assert best.tokens[i] == mine[int(scores.argmax())]
    assert best.forward_passes == 2  # one denoising pass over every sample, one judge pass
    one = best_of_generate(model, judge, src, prompts, 12, eos_id=eos_id, generator=torch.Generator().manual_seed(5))
    plain = dd2_generate(model, src, 12, eos_id=eos_id, generator=torch.Generator().manual_seed(5))
    assert one.tokens == plain.tokens and one.forward_passes == 1
    with pytest.raises(DiffarError, match="best_of must be >= 1"):
        DD2Sampling(best_of=0)
    with pytest.raises(DiffarError, match="needs best_of_generate"):
        dd2_generate(model, src, 12, sampling=DD2Sampling(best_of=2))


@pytest.mark.parametrize("eos_id", [EOS, None])
def test_best_of_without_a_judge_keeps_the_decoders_likeliest(eos_id):
    """Without a judge, each row keeps the sample whose read-out the decoder gave the highest mean
    log-probability (`confidence`, a row's own: the same alone as in a batch), with no extra pass."""
    model, n, src = random_dd2(eos_id=eos_id), 4, sources(3)
    best = best_of_generate(model, None, src, None, 12, sampling=DD2Sampling(best_of=n), eos_id=eos_id,
                            generator=torch.Generator().manual_seed(5))
    samples = dd2_generate(model, [s for s in src for _ in range(n)], 12, eos_id=eos_id,
                           generator=torch.Generator().manual_seed(5))
    assert all(c <= 0 for c in samples.extra["confidence"])
    for i in range(len(src)):
        mine = range(i * n, i * n + n)
        assert len({samples.extra["confidence"][j] for j in mine}) > 1  # a choice to make
        j = max(mine, key=lambda j: samples.extra["confidence"][j])
        assert best.tokens[i] == samples.tokens[j] and best.extra["confidence"][i] == samples.extra["confidence"][j]
    assert best.forward_passes == 1
    alone = dd2_generate(model, src[:1], 12, eos_id=eos_id, generator=torch.Generator().manual_seed(5))
    batched = dd2_generate(model, src, 12, eos_id=eos_id, generator=torch.Generator().manual_seed(5))
    assert alone.extra["confidence"][0] == pytest.approx(batched.extra["confidence"][0], abs=1e-5)


def test_bench_method_names():
    from diffar.evaluation.bench import dd2_options
    from diffar.generation import Options

    assert dd2_options("dd2-3") == Options(steps=3) and dd2_options("ar") is None
    assert dd2_options("dd2-1x4") == dd2_options("dd2-1x4-self") == Options(steps=1, best_of=4)
    for bad in ("dd2-0", "dd2-1x0", "dd2-1x", "dd2-2-self", "dd2-x2", "dd2-1x2-selfish", "dd2-\u00b2"):
        with pytest.raises(DiffarError, match="unknown method"):
            dd2_options(bad)


def test_best_of_keeps_pins_across_canvases():
    """A continuation longer than one canvas is sampled canvas after canvas for every sample; the kept
    sample has the full length and the pins."""
    model, judge, src = random_dd2(eos_id=None), random_model(1), sources(2)
    canvas = model.config.vqvae.target_len
    pins = [{1: 7, canvas + 2: 9}, {}]
    best = best_of_generate(model, judge, src, src, canvas + 5, sampling=DD2Sampling(best_of=3), fixed=pins,
                            generator=torch.Generator().manual_seed(1))
    assert [len(t) for t in best.tokens] == [canvas + 5] * 2
    assert best.tokens[0][1] == 7 and best.tokens[0][canvas + 2] == 9
