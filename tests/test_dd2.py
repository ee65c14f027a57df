"""DD2: guidance, the distillation loss, sampling (one step, DDIM, hybrid, best of n), checkpoints and the CLI."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_TRAIN, assert_clean_error, random_model, run_cli, start_server
from diffar.checkpoint import load_checkpoint, write_checkpoint
from diffar.cli import _dd2_start, build_parser
from diffar.data.batching import pad_right
from diffar.decoding.ar import generate, log_likelihoods
from diffar.decoding.dd2 import DD2Sampling, adaptive_steps, best_of_generate, dd2_generate, hybrid_generate
from diffar.errors import DiffarError
from diffar.models.dd2 import DD2Config, DD2Model, expected_bleu_risk, same_weights, semantic_distance, \
    teacher_energy
from diffar.models.transformer import TransformerConfig
from diffar.models.vqvae import TextVQVAE, VQVAEConfig
from diffar.serving.methods import CONTINUATION_ROOM, DD2Method

VOCAB = 512
EOS = 2


def random_dd2(seed=0, encoder=False, **overrides) -> DD2Model:
    """A `tiny` DD2 model with large random weights, so that different inputs give different tokens;
    `encoder`: with a `tiny` AR model as its source encoder."""
    torch.manual_seed(seed)
    if encoder:
        overrides["source_encoder"] = TransformerConfig.from_preset("tiny", vocab_size=VOCAB)
    model = DD2Model(DD2Config.from_preset("tiny", VQVAEConfig.from_preset("tiny", VOCAB), **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


def sources(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, VOCAB, (int(length),), generator=g).tolist()
            for length in torch.randint(3, 12, (n,), generator=g)]


def inputs(model, batch=2, width=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, width, model.config.vqvae.d_latent, generator=g)
    source = torch.randint(5, VOCAB, (batch, 6), generator=g)
    return z, torch.full((batch,), 0.7), source, torch.ones_like(source, dtype=torch.bool)


# ---- the model ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("eos_id", [EOS, None])
def test_canvas_positions(eos_id):
    """A seq2seq canvas counts its positions from 0, like its source; a continuation canvas continues its
    source: slot 0 takes the position after each row's last source token (right padding aside)."""
    model = random_dd2(eos_id=eos_id)
    seen, forward = [], model.denoiser.stack.forward

    def spy(x, key_mask, positions):
        seen.append(positions)
        return forward(x, key_mask, positions)

    model.denoiser.stack.forward = spy
    source, mask = pad_right([[5, 6, 7], [8, 9, 10, 11, 12]], 0)
    model.denoiser(torch.randn(2, 4, model.config.vqvae.d_latent), torch.ones(2), source, mask)
    start = [3, 5] if eos_id is None else [0, 0]
    assert seen[0].tolist() == [list(range(5)) + list(range(s, s + 4)) for s in start]


def test_guidance_one_is_conditional_only_and_mixes_otherwise():
    model = random_dd2()
    z, t, source, mask = inputs(model)
    cond = model.denoiser(z, t, source, mask)
    uncond = model.denoiser(z, t, source, torch.zeros_like(mask))
    assert not torch.allclose(cond, uncond)  # the source matters
    torch.testing.assert_close(model.predict(z, t, source, mask, guidance_scale=1.0), cond)
    torch.testing.assert_close(model.predict(z, t, source, mask, guidance_scale=2.5),
                               uncond + 2.5 * (cond - uncond), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.predict(z, t, source, mask, guidance_scale=0.0), uncond, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("encoder", [False, True])
def test_padding_the_source_changes_nothing(encoder):
    model = random_dd2(encoder=encoder)
    z, t, source, mask = inputs(model, batch=1)
    padded = torch.cat([source, torch.zeros(1, 4, dtype=source.dtype)], 1)
    padded_mask = torch.cat([mask, torch.zeros(1, 4, dtype=torch.bool)], 1)
    torch.testing.assert_close(model.predict(z, t, padded, padded_mask), model.predict(z, t, source, mask))


def test_source_encoder_states_join_the_prefix_and_stay_frozen():
    """With a source encoder, the denoiser reads the encoder's hidden states over the source (other encoder
    weights, other output), `predict` makes them itself when not given, and training leaves the encoder as
    it was (no gradient, eval mode)."""
    model = random_dd2(encoder=True, prediction="x0")
    z, t, source, mask = inputs(model)
    states = model.encode_source(source)
    assert states.shape == (2, source.shape[1], model.config.source_encoder.d_model)
    out = model.predict(z, t, source, mask)
    torch.testing.assert_close(out, model.denoiser(z, t, source, mask, states=states))
    other = random_dd2(seed=1, encoder=True, prediction="x0")
    model.set_source_encoder(other.source_encoder)
    assert not torch.allclose(model.predict(z, t, source, mask), out)
    model.train()
    assert not model.source_encoder.training
    _, loss = model(source, mask, torch.randint(5, VOCAB, (2, 10)))
    loss.backward()
    assert model.denoiser.states_in.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.source_encoder.parameters())
    with pytest.raises(DiffarError, match="differs from the source encoder"):
        random_dd2().set_source_encoder(other.source_encoder)


@pytest.mark.parametrize("weights", [dict(mse_weight=2.0, ce_weight=0.5, bleu_weight=0.3, semantic_weight=0.7),
                                     dict(mse_weight=0.0, ce_weight=1.0, bleu_weight=0.0, semantic_weight=0.0)])
def test_distillation_loss_weights_are_applied_as_configured(weights):
    model = random_dd2(prediction="x0", **weights).train()
    z, t, source, mask = inputs(model)
    targets = torch.randint(5, VOCAB, (2, 10))
    torch.manual_seed(3)
    _, loss = model(source, mask, targets)
    parts = model.loss_parts
    expected = sum(weights[f"{k}_weight"] * parts[k] for k in ("mse", "ce", "bleu", "semantic") if k in parts)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    assert ("bleu" in parts) == bool(weights["bleu_weight"])
    assert ("semantic" in parts) == bool(weights["semantic_weight"])
    loss.backward()
    assert model.denoiser.latent_out.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.vqvae.parameters())  # the autoencoder stays frozen


@pytest.mark.parametrize("eos_id", [EOS, None])
def test_energy_of_a_one_hot_canvas_is_the_teachers_nll(eos_id):
    """The energy of a (near) one-hot canvas is the teacher's mean negative log-likelihood of its text after
    the prompt it reads (a seq2seq source and <sep>; a continuation prompt as it is), over the slots before
    the target's <eos>; rows of other lengths in the batch change nothing."""
    sep = 3
    model = random_dd2(prediction="x0", eos_id=eos_id)
    teacher = random_model(5)
    model.set_energy_model(teacher, sep if eos_id is not None else None)
    rows = sources(3, seed=7)
    source, mask = pad_right(rows, 0)
    canvas = torch.randint(5, VOCAB, (3, 9), generator=torch.Generator().manual_seed(8))
    targets = canvas.clone()
    targets[0, 6:], targets[2, 3:] = EOS, EOS  # ends at <eos> (a continuation canvas has none: EOS is a token)
    logits = F.one_hot(targets, VOCAB).float() * 1e4
    prompts = [row + [sep] if eos_id is not None else row for row in rows]
    texts = [t[:t.index(EOS)] if eos_id is not None and EOS in t else t for t in targets.tolist()]
    nll = -float(log_likelihoods(teacher, prompts, texts).sum())
    assert float(model._energy(logits, source, mask, targets)) == pytest.approx(nll / sum(map(len, texts)), rel=1e-4)
    # a softer canvas is scored by its expected embedding, and the gradient reaches its logits
    soft = (torch.randn(3, 9, VOCAB) * 3).requires_grad_()
    energy = teacher_energy(teacher, soft, source, mask.sum(1), torch.ones(3, 9, dtype=torch.bool))
    energy.backward()
    assert soft.grad.abs().sum() > 0 and all(p.grad is None for p in teacher.parameters())


def test_energy_loss_trains_the_denoiser_on_one_step_rows_and_is_not_saved(tmp_path, tokenizer):
    model = random_dd2(prediction="x0", energy_weight=0.5, full_noise_prob=1.0).train()
    source, mask = torch.randint(5, VOCAB, (2, 6)), torch.ones(2, 6, dtype=torch.bool)
    targets = torch.randint(5, VOCAB, (2, 10))
    with pytest.raises(DiffarError, match="needs the AR teacher"):
        model(source, mask, targets)
    teacher = random_model(5)
    model.set_energy_model(teacher, 3)
    _, loss = model(source, mask, targets)
    parts = model.loss_parts
    assert parts["energy"] > 0
    assert float(loss.detach()) == pytest.approx(parts["mse"] + parts["ce"] + 0.5 * parts["energy"], rel=1e-5)
    loss.backward()
    assert model.denoiser.latent_out.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in teacher.parameters())
    # only the rows at t = 1 that kept their source are scored
    model.config.full_noise_prob, model.config.cond_drop = 0.5, 0.5
    seen, forward, energy = {}, model.denoiser.forward, model._energy
    model.denoiser.forward = lambda z, t, s, m, **kw: seen.update(t=t, kept=m.any(1)) or forward(z, t, s, m, **kw)
    model._energy = lambda logits, *rest: seen.update(rows=len(logits)) or energy(logits, *rest)
    torch.manual_seed(0)
    model(torch.randint(5, VOCAB, (16, 6)), torch.ones(16, 6, dtype=torch.bool), torch.randint(5, VOCAB, (16, 10)))
    expected = int(((seen["t"] == 1) & seen["kept"]).sum())
    assert 0 < expected < 16 and seen["rows"] == expected
    model.config.full_noise_prob = 0.0  # no row at t = 1: no one-step output to score
    model(source, mask, targets)
    assert "energy" not in model.loss_parts
    write_checkpoint(tmp_path / "ckpt", model, {"kind": "dd2", "model": model.config.to_dict(), "task": "seq2seq",
                                                "corpus": "kjv2web"}, tokenizer)
    loaded, _, _ = load_checkpoint(tmp_path / "ckpt")  # strict: no teacher weights in the file
    assert loaded.energy_model is None and loaded.config.energy_weight == 0.5
    with pytest.raises(DiffarError, match="vocabulary"):
        model.set_energy_model(random_model(5, vocab=100), 3)


@pytest.mark.parametrize("refine_prob", [0.0, 1.0])
def test_refinement_examples_are_noised_one_step_drafts(refine_prob):
    """With refine_prob, a t < 1 example's input is what DDIM feeds its second step: the network's own
    one-step draft x1 from noise z1, noised to t with that same z1."""
    model = random_dd2(prediction="x0", full_noise_prob=0.0, refine_prob=refine_prob, cond_drop=0.0)
    calls, forward = [], model.denoiser.forward
    model.denoiser.forward = lambda z, t, s, m, **kw: calls.append((z.clone(), t.clone())) or forward(z, t, s, m)
    targets = torch.randint(5, VOCAB, (3, 10))
    source, mask = torch.randint(5, VOCAB, (3, 6)), torch.ones(3, 6, dtype=torch.bool)
    model(source, mask, targets)
    if not refine_prob:
        assert len(calls) == 1  # the true latents, noised: no draft made
        return
    (start, t1), (z_t, t) = calls
    assert torch.all(t1 == 1) and torch.all(t < 1)
    a = model.schedule.alpha_bar(t).view(-1, 1, 1)
    with torch.no_grad():
        torch.testing.assert_close(z_t, a.sqrt() * forward(start, t1, source, mask) + (1 - a).sqrt() * start)


def test_eps_loss_is_the_noise_mse():
    model = random_dd2(prediction="eps", cond_drop=0.0)
    targets = torch.randint(5, VOCAB, (2, 10))
    source, mask = torch.randint(5, VOCAB, (2, 6)), torch.ones(2, 6, dtype=torch.bool)
    torch.manual_seed(4)
    out, loss = model(source, mask, targets)
    torch.manual_seed(4)  # replay the same draws: t, then the noise
    z0 = model.latents(targets)
    t = torch.rand(2)
    noise = torch.randn_like(z0)
    torch.testing.assert_close(out, model.denoiser(model.schedule.q_sample(z0, t, noise), t, source, mask))
    assert float(loss.detach()) == pytest.approx(float(F.mse_loss(out, noise).detach()), rel=1e-5)


def test_bleu_risk_and_semantic_distance_rank_predictions():
    targets = torch.randint(5, 100, (3, 12))
    right = F.one_hot(targets, 100).float() * 30
    wrong = F.one_hot((targets + 7) % 100, 100).float() * 30
    assert float(expected_bleu_risk(right, targets, 4, None)) == pytest.approx(0.0, abs=1e-6)
    assert float(expected_bleu_risk(wrong, targets, 4, None)) > 0.9
    table = torch.randn(100, 16)
    assert float(semantic_distance(right, targets, table)) < 1e-4 < float(semantic_distance(wrong, targets, table))
    # only the text up to <eos> counts
    tail = targets.clone()
    tail[:, 6] = EOS
    noisy_tail = F.one_hot(torch.where(torch.arange(12) > 6, (tail + 1) % 100, tail), 100).float() * 30
    assert float(expected_bleu_risk(noisy_tail, tail, 4, EOS)) == pytest.approx(0.0, abs=1e-6)


def test_bleu_risk_gradient_favours_the_better_draw():
    """Minimum risk raises the probability of high-BLEU draws: one gradient step lowers the risk."""
    torch.manual_seed(0)
    targets = torch.randint(5, 20, (4, 8))
    logits = (F.one_hot(targets, 20).float() * 1.5).requires_grad_()
    risk = expected_bleu_risk(logits, targets, 8, None)
    before = float(risk.detach())
    risk.backward()
    with torch.no_grad():
        logits -= 50 * logits.grad
    torch.manual_seed(0)
    assert float(expected_bleu_risk(logits.detach(), targets, 8, None)) < before


@pytest.mark.parametrize("bad, message", [
    (dict(prediction="v"), "unknown prediction"), (dict(cond_drop=1.0), "cond_drop"),
    (dict(ce_weight=-1.0), "loss weights"), (dict(schedule="sqrt"), "unknown noise schedule"),
    (dict(bleu_samples=1), "bleu_samples"), (dict(refine_prob=1.5), "refine_prob"),
    (dict(energy_weight=float("nan")), "loss weights"),
    (dict(source_encoder=TransformerConfig.from_preset("tiny", vocab_size=100)), "source encoder's vocabulary"),
])
def test_bad_config(bad, message):
    with pytest.raises(DiffarError, match=message):
        DD2Config(**bad)
    with pytest.raises(DiffarError, match="unknown preset"):
        DD2Config.from_preset("huge", VQVAEConfig())


def test_same_weights_tells_autoencoders_apart_but_not_their_bf16_copies():
    torch.manual_seed(0)
    a, b = TextVQVAE(VQVAEConfig.from_preset("tiny", VOCAB)), TextVQVAE(VQVAEConfig.from_preset("tiny", VOCAB))
    copy = TextVQVAE(VQVAEConfig.from_preset("tiny", VOCAB))
    copy.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in a.state_dict().items()})
    assert same_weights(a, copy) and not same_weights(a, b)


@pytest.mark.parametrize("encoder", [False, True])
def test_save_and_load(tmp_path, tokenizer, encoder):
    model = random_dd2(eos_id=EOS, encoder=encoder)
    meta = {"kind": "dd2", "model": model.config.to_dict(), "task": "seq2seq", "corpus": "kjv2web"}
    write_checkpoint(tmp_path / "dd2", model, meta, tokenizer)
    loaded, _, meta2 = load_checkpoint(tmp_path / "dd2")
    assert loaded.config.to_dict() == model.config.to_dict()
    src = sources()
    a = dd2_generate(model, src, 20, eos_id=EOS, generator=torch.Generator().manual_seed(0))
    b = dd2_generate(loaded, src, 20, eos_id=EOS, generator=torch.Generator().manual_seed(0))
    assert a.tokens == b.tokens


# ---- sampling -----------------------------------------------------------------------------------------
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
    assert runs[0].steps == runs[0].forward_passes == sampling.steps and runs[0].decoder_passes == 1
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


def test_continuation_past_one_canvas_samples_canvas_after_canvas():
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
    assert (result.steps, result.forward_passes) == (2, 6)
    assert seen == [[32, 32]] * 2 + [[64, 64]] * 2 + [[80, 80]] * 2  # each step: the text so far plus this canvas
    pinned = dd2_generate(model, src, 80, sampling=sampling, fixed=[{40: 7, 79: 9}, {}],
                          generator=torch.Generator().manual_seed(0))
    assert (pinned.tokens[0][40], pinned.tokens[0][79]) == (7, 9) and pinned.tokens[0][:32] == expected[0][:32]
    with pytest.raises(DiffarError, match="within the 80 tokens"):
        dd2_generate(model, src, 80, fixed=[{80: 7}, {}])
    # served, a continuation request may ask for more than one canvas; a seq2seq one for its canvas
    assert DD2Method(model, None, "continuation").room(src[0]) == CONTINUATION_ROOM
    seq2seq = random_dd2(eos_id=EOS)
    assert DD2Method(seq2seq, None, "seq2seq").room(src[0]) == seq2seq.config.canvas_width(len(src[0]))


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
    assert pinned.decoder_passes == free.decoder_passes + steps  # the pins are re-encoded after every step
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
    assert all(c <= 0 for c in samples.confidence)
    for i in range(len(src)):
        mine = range(i * n, i * n + n)
        assert len({samples.confidence[j] for j in mine}) > 1  # a choice to make
        j = max(mine, key=lambda j: samples.confidence[j])
        assert best.tokens[i] == samples.tokens[j] and best.confidence[i] == samples.confidence[j]
    assert best.forward_passes == 1
    alone = dd2_generate(model, src[:1], 12, eos_id=eos_id, generator=torch.Generator().manual_seed(5))
    batched = dd2_generate(model, src, 12, eos_id=eos_id, generator=torch.Generator().manual_seed(5))
    assert alone.confidence[0] == pytest.approx(batched.confidence[0], abs=1e-5)


def test_bench_method_names():
    from diffar.evaluation.bench import dd2_method

    assert dd2_method("dd2-3") == DD2Sampling(steps=3) and dd2_method("ar") is None
    assert dd2_method("dd2-1x4") == dd2_method("dd2-1x4-self") == DD2Sampling(best_of=4)
    for bad in ("dd2-0", "dd2-1x0", "dd2-1x", "dd2-2-self", "dd2-x2", "dd2-1x2-selfish", "dd2-\u00b2"):
        with pytest.raises(DiffarError, match="unknown method"):
            dd2_method(bad)


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


# ---- the command line ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_vqvae(tokenizer_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "tiny-vqvae"
    proc = run_cli("train", "vqvae", "--corpus", "kjv2web", "--tokenizer", tokenizer_path, "--out", out,
                   "--max-steps", "6", *TINY_TRAIN)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def tiny_dd2(tiny_vqvae, tiny_run, tmp_path_factory):
    """Stage 2 (eps), then distillation from the AR teacher starting from it: the whole DD2 pipeline."""
    runs = tmp_path_factory.mktemp("runs")
    stage2 = run_cli("train", "dd2", "--vqvae", tiny_vqvae, "--corpus", "kjv2web", "--out", runs / "eps",
                     "--max-steps", "4", *TINY_TRAIN)
    assert stage2.returncode == 0, stage2.stderr
    distill = run_cli("distill", "dd2", "--teacher", tiny_run, "--init", runs / "eps", "--corpus", "kjv2web",
                      "--teacher-examples", "24", "--bleu-weight", "0.5", "--semantic-weight", "0.5",
                      "--energy-weight", "0.5", "--full-noise-prob", "0.9",
                      "--out", runs / "x0", "--max-steps", "4", *TINY_TRAIN)
    assert distill.returncode == 0, distill.stderr
    return runs


def test_cli_pipeline(tiny_dd2, tiny_vqvae, tiny_run):
    eps, _, meta = load_checkpoint(tiny_dd2 / "eps")
    x0, _, meta2 = load_checkpoint(tiny_dd2 / "x0")
    vq, _, _ = load_checkpoint(tiny_vqvae)
    assert (meta["kind"], eps.config.prediction, x0.config.prediction) == ("dd2", "eps", "x0")
    assert x0.config.eos_id is not None and (x0.config.bleu_weight, x0.config.full_noise_prob) == (0.5, 0.9)
    for a, b in zip(x0.vqvae.state_dict().values(), vq.state_dict().values()):
        assert torch.equal(a, b)  # the autoencoder rides along unchanged
    teacher = [json.loads(line) for line in (tiny_dd2 / "x0" / "teacher.jsonl").read_text().splitlines()]
    assert len(teacher) == 24
    metrics = [json.loads(line) for line in (tiny_dd2 / "x0" / "metrics.jsonl").read_text().splitlines()]
    assert {"mse", "ce", "bleu", "semantic", "energy"} <= set(metrics[-1])


def test_cli_resume_keeps_the_latent_scale(tiny_vqvae, tmp_path):
    """A run resumed over a bf16 export of its autoencoder (whose latents scale a hair differently) goes on
    at the scale it was trained at instead of refusing the run as another model's."""
    run, bf16 = tmp_path / "run", tmp_path / "vqvae-bf16"
    assert run_cli("export", "--checkpoint", tiny_vqvae, "--out", bf16, "--dtype", "bf16").returncode == 0
    first = run_cli("train", "dd2", "--vqvae", tiny_vqvae, "--corpus", "kjv2web", "--out", run, "--max-steps", "2",
                    *TINY_TRAIN)
    assert first.returncode == 0, first.stderr
    scale = load_checkpoint(run)[0].config.latent_scale
    again = run_cli("train", "dd2", "--vqvae", bf16, "--corpus", "kjv2web", "--out", run, "--max-steps", "3",
                    *TINY_TRAIN)
    assert again.returncode == 0, again.stderr
    resumed, _, meta = load_checkpoint(run)
    assert meta["step"] == 3 and resumed.config.latent_scale == scale


@pytest.mark.parametrize("flags, label", [((), "dd2 1-step ddim"), (("--steps", "3", "--guidance", "2"), "3-step"),
                                          (("--preset", "speed"), "guidance 1.5, tau 0.677"),
                                          (("--adaptive-steps",), "-step"),
                                          (("--steps", "2", "--sampler", "ddpm", "--tau", "0.5"), "2-step ddpm"),
                                          (("--steps", "2", "--tau", "0.5"), "tau 0.25 |"),  # tau(t) of the last step
                                          (("--dtype", "bf16"), "batch 1 | bf16")])
def test_cli_generate(tiny_dd2, flags, label):
    proc = run_cli("generate", "--checkpoint", tiny_dd2 / "x0", "--prompt", "In the beginning", *flags)
    assert proc.returncode == 0, proc.stderr
    assert label in proc.stderr and "tokens/s" in proc.stderr and "forward passes" in proc.stderr


def test_cli_hybrid_and_bench(tiny_dd2, tiny_run, tmp_path):
    proc = run_cli("generate", "--checkpoint", tiny_dd2 / "x0", "--hybrid", tiny_run, "--prompt", "In the beginning")
    assert proc.returncode == 0 and "[dd2-hybrid, 1-step prefix]" in proc.stderr, proc.stderr
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "dd2", "--checkpoint", tiny_dd2 / "x0", "--ar", tiny_run, "--prompts", "4",
                   "--batch-sizes", "1", "2", "--methods", "ar", "dd2-1", "dd2-3", "dd2-hybrid", "--split", "valid",
                   "--out", out)
    assert proc.returncode == 0, proc.stderr
    records = json.loads(out.read_text())
    assert {(r["method"], r["batch_size"]) for r in records} == {
        (m, b) for m in ("ar", "dd2-1", "dd2-3", "dd2-hybrid") for b in (1, 2)}
    for r in records:
        assert {"bleu4", "chrf", "rougeL", "steps"} <= set(r["extra"]) and r["tokens_per_s"] > 0
        assert r["extra"]["split"] == "valid"
    assert {r["extra"]["steps"] for r in records if r["method"] == "dd2-3"} == {3}
    proc = run_cli("bench", "dd2", "--checkpoint", tiny_dd2 / "x0", "--ar", tiny_run, "--prompts", "2",
                   "--batch-sizes", "2", "--methods", "dd2-2x3", "dd2-1x2-self", "--split", "valid", "--dtype", "bf16",
                   "--out", out)
    assert proc.returncode == 0, proc.stderr
    judged, own = json.loads(out.read_text())
    assert judged["extra"]["steps"] == 2 and judged["extra"]["best_of"] == 3 and judged["forward_passes"] == 3
    assert judged["extra"]["judge"] == "ar" and judged["dtype"] == "bf16"
    assert own["extra"]["best_of"] == 2 and own["extra"]["judge"] == "decoder" and own["forward_passes"] == 1
    proc = run_cli("generate", "--checkpoint", tiny_dd2 / "x0", "--best-of", "3", "--judge", tiny_run, "--prompt",
                   "In the beginning", "--dtype", "bf16")
    assert proc.returncode == 0 and "[dd2 1-step ddim, best of 3 by the AR judge]" in proc.stderr, proc.stderr
    proc = run_cli("generate", "--checkpoint", tiny_dd2 / "x0", "--best-of", "3", "--prompt", "In the beginning")
    assert proc.returncode == 0 and "best of 3 by the decoder] " in proc.stderr and "1 forward passes" in proc.stderr


def test_cli_bad_input(tiny_dd2, tiny_vqvae, tiny_run, tokenizer_path, tmp_path):
    args = ("generate", "--checkpoint", tiny_dd2 / "x0", "--prompt", "x")
    assert_clean_error(run_cli(*args, "--steps", "0"), "steps must be positive")
    assert_clean_error(run_cli(*args, "--guidance", "-1"), "guidance scale must be >= 0")
    assert_clean_error(run_cli(*args, "--preset", "fast"), "invalid choice")
    assert_clean_error(run_cli(*args, "--temperature", "0.5"), "--tau")
    assert_clean_error(run_cli(*args, "--tau", "0.5"), "--tau needs more --steps")
    assert_clean_error(run_cli(*args, "--judge", tiny_run), "pass --best-of N")
    assert_clean_error(run_cli(*args, "--best-of", "1", "--judge", tiny_run), "pass --best-of N")
    assert_clean_error(run_cli(*args, "--best-of", "4", "--judge", tiny_run, "--hybrid", tiny_run), "do not combine")
    assert_clean_error(run_cli(*args, "--best-of", "0", "--judge", tiny_run), "positive")
    assert_clean_error(run_cli("bench", "dd2", "--checkpoint", tiny_dd2 / "x0", "--ar", tiny_run, "--methods",
                               "dd2-1x0", "--out", tmp_path / "b.json"), "unknown method")
    assert_clean_error(run_cli("generate", "--checkpoint", tiny_run, "--prompt", "x", "--steps", "2",
                               "--method", "dd2"), "needs a DD2 checkpoint")
    assert_clean_error(run_cli("generate", "--checkpoint", tiny_vqvae, "--prompt", "x"), "does not generate")
    # a diffusion checkpoint and an autoencoder it was not trained in
    other = tmp_path / "other-vqvae"
    proc = run_cli("train", "vqvae", "--corpus", "kjv2web", "--tokenizer", tokenizer_path, "--out", other,
                   "--max-steps", "2", "--seed", "7", *TINY_TRAIN)
    assert proc.returncode == 0, proc.stderr
    assert_clean_error(run_cli("train", "dd2", "--vqvae", other, "--init", tiny_dd2 / "eps", "--corpus", "kjv2web",
                               "--out", tmp_path / "x", "--max-steps", "1", *TINY_TRAIN), "do not belong together")
    assert_clean_error(run_cli("train", "dd2", "--corpus", "kjv2web", "--out", tmp_path / "y", *TINY_TRAIN),
                       "pass --vqvae")
    assert_clean_error(run_cli("distill", "dd2", "--teacher", tiny_dd2 / "x0", "--init", tiny_dd2 / "eps",
                               "--corpus", "kjv2web", "--out", tmp_path / "z", *TINY_TRAIN),
                       "; it must be an AR or ReFusion one")
    # an --init model keeps its schedule, its prediction and its task
    assert_clean_error(run_cli("train", "dd2", "--init", tiny_dd2 / "eps", "--schedule", "linear", "--corpus",
                               "kjv2web", "--out", tmp_path / "s", *TINY_TRAIN), "--schedule cannot change it")
    assert_clean_error(run_cli("train", "dd2", "--init", tiny_dd2 / "x0", "--corpus", "kjv2web", "--out",
                               tmp_path / "p", *TINY_TRAIN), "continue it with diffar distill dd2")
    assert_clean_error(run_cli("train", "dd2", "--init", tiny_dd2 / "eps", "--corpus", "shakespeare", "--out",
                               tmp_path / "t", *TINY_TRAIN), "trained on seq2seq data")
    assert_clean_error(run_cli("distill", "dd2", "--teacher", tiny_run, "--vqvae", tiny_vqvae, "--corpus",
                               "shakespeare", "--out", tmp_path / "u", *TINY_TRAIN), "is a seq2seq model")
    assert_clean_error(run_cli("bench", "dd2", "--checkpoint", tiny_run, "--out", tmp_path / "b.json"),
                       "bench dd2 needs a DD2 one")
    assert_clean_error(run_cli("bench", "dd2", "--checkpoint", tiny_dd2 / "x0", "--ar", tiny_run, "--methods", "dd2-0",
                               "--out", tmp_path / "b.json"), "unknown method 'dd2-0'")


def test_cli_canvas_len(tiny_vqvae, tiny_shakespeare_run, tmp_path):
    """--canvas-len sets a continuation model's canvas (on the same autoencoder): the teacher writes that many
    tokens per example, and longer outputs come canvas after canvas. On a seq2seq corpus it is an error."""
    args = ("distill", "dd2", "--teacher", tiny_shakespeare_run, "--vqvae", tiny_vqvae, "--canvas-len", "16",
            "--teacher-examples", "8", "--max-steps", "2", *TINY_TRAIN)
    proc = run_cli(*args, "--corpus", "shakespeare", "--out", tmp_path / "c16")
    assert proc.returncode == 0, proc.stderr
    model, _, _ = load_checkpoint(tmp_path / "c16")
    assert (model.config.vqvae.target_len, model.config.eos_id) == (16, None)
    teacher = [json.loads(line)["out"] for line in (tmp_path / "c16" / "teacher.jsonl").read_text().splitlines()]
    assert len(teacher) == 8 and all(len(out) == 16 for out in teacher)
    gen = run_cli("generate", "--checkpoint", tmp_path / "c16", "--prompt", "To be, or not to be",
                  "--max-new-tokens", "40")
    printed = gen.stdout + gen.stderr
    assert gen.returncode == 0 and "40 tokens in" in printed and "3 forward passes" in printed  # 16 + 16 + 8
    assert_clean_error(run_cli(*args, "--corpus", "kjv2web", "--out", tmp_path / "k"), "applies to continuation")


def test_cli_source_encoder(tiny_vqvae, tiny_run, tiny_shakespeare_run, tiny_dd2, tmp_path):
    """--source-encoder puts a frozen copy of an AR model in the DD2 checkpoint to read the source; a run
    continued from it keeps it, an --init model without one gains it (starting out unchanged), and
    checkpoints that are not AR models, or another encoder than an --init model's own, are clear errors.
    Its continuation is benched against a continuation AR model; a seq2seq one is a clear error."""
    args = ("distill", "dd2", "--teacher", tiny_shakespeare_run, "--corpus", "shakespeare", "--teacher-examples", "8",
            "--max-steps", "2", *TINY_TRAIN)
    proc = run_cli(*args, "--vqvae", tiny_vqvae, "--source-encoder", tiny_run, "--canvas-len", "16",
                   "--out", tmp_path / "enc")
    assert proc.returncode == 0, proc.stderr
    model, _, _ = load_checkpoint(tmp_path / "enc")
    teacher, _, _ = load_checkpoint(tiny_run)
    assert model.config.source_encoder.to_dict() == teacher.config.to_dict()
    assert same_weights(model.source_encoder, teacher)
    gen = run_cli("generate", "--checkpoint", tmp_path / "enc", "--prompt", "To be, or not to be",
                  "--max-new-tokens", "20")
    assert gen.returncode == 0 and "20 tokens in" in gen.stdout + gen.stderr, gen.stderr
    bench_args = ("bench", "dd2", "--checkpoint", tmp_path / "enc", "--prompts", "2", "--new-tokens", "20",
                  "--batch-sizes", "1", "--methods", "ar", "dd2-1", "--split", "valid",
                  "--out", tmp_path / "bench.json")
    assert_clean_error(run_cli(*bench_args, "--ar", tiny_run), "is a seq2seq model; the model it works with is a "
                                                              "continuation one")
    assert_clean_error(run_cli("generate", "--checkpoint", tmp_path / "enc", "--hybrid", tiny_run, "--prompt", "To"),
                       "is a seq2seq model")
    bench = run_cli(*bench_args, "--ar", tiny_shakespeare_run)
    assert bench.returncode == 0, bench.stderr
    for r in json.loads((tmp_path / "bench.json").read_text()):  # continuation: 20 tokens each, scored by AR
        assert r["new_tokens"] == 20 and r["extra"]["ar_perplexity"] > 1 and 0 <= r["extra"]["seq_rep4"] <= 100
    more = run_cli(*args, "--init", tmp_path / "enc", "--source-encoder", tiny_run, "--out", tmp_path / "more")
    assert more.returncode == 0, more.stderr
    assert same_weights(load_checkpoint(tmp_path / "more")[0].source_encoder, teacher)
    assert_clean_error(run_cli(*args, "--vqvae", tiny_vqvae, "--source-encoder", tiny_vqvae, "--out", tmp_path / "a"),
                       "; it must be an AR or ReFusion one")
    other, tokenizer, meta = load_checkpoint(tiny_run)  # the teacher with other weights
    with torch.no_grad():
        other.lm_head.weight.add_(1.0)
    write_checkpoint(tmp_path / "other", other, meta, tokenizer)
    assert_clean_error(run_cli(*args, "--init", tmp_path / "enc", "--source-encoder", tmp_path / "other",
                               "--out", tmp_path / "b"), "an --init model keeps its own")
    # an --init model without an encoder gains one through a zero map: its predictions start out unchanged
    plain = load_checkpoint(tiny_dd2 / "x0")[0].eval()
    gained = _dd2_start(build_parser().parse_args(
        ["distill", "dd2", "--teacher", str(tiny_run), "--init", str(tiny_dd2 / "x0"), "--corpus", "kjv2web",
         "--source-encoder", str(tiny_run), "--out", str(tmp_path / "c")]), "x0")[0].eval()
    assert same_weights(gained.source_encoder, teacher)
    source = torch.randint(5, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    z = torch.randn(2, 12, plain.config.vqvae.d_latent, generator=torch.Generator().manual_seed(1))
    mask, t = torch.ones_like(source, dtype=torch.bool), torch.ones(2)
    assert gained.encode_source(source).abs().sum() > 0
    torch.testing.assert_close(gained.predict(z, t, source, mask), plain.predict(z, t, source, mask))


def test_serve_dd2(tiny_dd2, tiny_vqvae, tiny_run):
    """A DD2 checkpoint is served as method dd2: a seeded request gives exactly what dd2_generate gives for
    that seed, a stream carries the same text, and what DD2 cannot do is a 400."""
    model, tokenizer, _ = load_checkpoint(tiny_dd2 / "x0")
    prompt = "In the beginning God created the heaven and the earth."
    proc, url = start_server(tiny_dd2 / "x0")
    try:
        assert httpx.get(url + "/v1/models").json()["data"][0]["methods"] == ["dd2"]
        body = {"prompt": prompt, "max_tokens": 12, "seed": 5}
        out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        expected = dd2_generate(model, [tokenizer.encode(prompt)], 12, eos_id=tokenizer.eos_id,
                                generator=torch.Generator().manual_seed(5))
        assert out["diffar"]["method"] == "dd2" and out["diffar"]["token_ids"] == expected.tokens[0]
        assert out["choices"][0]["text"] == tokenizer.decode(expected.tokens[0])
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == out["choices"][0]["text"]
        guided = httpx.post(url + "/v1/completions", json={**body, "steps": 3, "guidance_scale": 2}, timeout=60)
        assert guided.status_code == 200 and guided.json()["diffar"]["method"] == "dd2"
        assert guided.json()["diffar"]["passes"] == {"steps": 3, "denoiser_passes": 3, "decoder_passes": 1,
                                                     "batch_size": 1}
        # a multi-step stream shows the whole text after each step (empty deltas), then the final text
        quality = {**body, "preset": "quality", "steps": 4}
        final = httpx.post(url + "/v1/completions", json=quality, timeout=60).json()["choices"][0]["text"]
        with httpx.stream("POST", url + "/v1/completions", json={**quality, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        snapshots = [c["diffar"]["snapshot"] for c in chunks if "snapshot" in c.get("diffar", {})]
        assert [s["step"] for s in snapshots] == [1, 2, 3, 4] and snapshots[-1]["text"] == final
        assert all(c["choices"][0]["text"] == "" for c in chunks if "snapshot" in c.get("diffar", {}))
        assert "".join(c["choices"][0]["text"] for c in chunks) == final
        pinned = httpx.post(url + "/v1/completions", json={**body, "fixed_tokens": {"1": 5, "3": 6}}, timeout=60)
        expected = dd2_generate(model, [tokenizer.encode(prompt)], 12, eos_id=tokenizer.eos_id,
                                generator=torch.Generator().manual_seed(5), fixed=[{1: 5, 3: 6}])
        assert pinned.json()["diffar"]["token_ids"] == expected.tokens[0]
        assert expected.tokens[0][1] == 5 and expected.tokens[0][3] == 6
        picked = httpx.post(url + "/v1/completions", json={**body, "best_of": 3}, timeout=60).json()
        expected = best_of_generate(model, None, [tokenizer.encode(prompt)], None, 12, sampling=DD2Sampling(best_of=3),
                                    eos_id=tokenizer.eos_id, generator=torch.Generator().manual_seed(5))
        assert picked["diffar"]["token_ids"] == expected.tokens[0]  # no judge: the decoder's own pick
        assert picked["diffar"]["passes"]["denoiser_passes"] == 1 and "judge_passes" not in picked["diffar"]["passes"]
        sampled = httpx.post(url + "/v1/completions", json={**body, "tau_min": 1.5}, timeout=60).json()
        expected = dd2_generate(model, [tokenizer.encode(prompt)], 12, sampling=DD2Sampling(tau_min=1.5),
                                eos_id=tokenizer.eos_id, generator=torch.Generator().manual_seed(5))
        assert sampled["diffar"]["token_ids"] == expected.tokens[0] != out["diffar"]["token_ids"]
        for bad, param in [({"method": "ar"}, "method"), ({"prompt": "word " * 200}, "prompt"),
                           ({"max_tokens": 500}, "max_tokens"), ({"best_of": 2, "stream": True}, "best_of"),
                           ({"tau": 0.5}, "tau")]:
            r = httpx.post(url + "/v1/completions", json={**body, **bad}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert_clean_error(run_cli("serve", "--checkpoint", tiny_vqvae), "does not generate text")
    assert_clean_error(run_cli("serve", "--checkpoint", tiny_run, "--method", "dd2"),
                       "cannot serve this ar checkpoint")


def test_serve_dd2_best_of(tiny_dd2, tiny_run):
    """With --judge, a request's best_of samples are drawn and the judge keeps one: a seeded request gives
    exactly what best_of_generate gives for that seed; best_of cannot be streamed."""
    model, tokenizer, _ = load_checkpoint(tiny_dd2 / "x0")
    judge, _, _ = load_checkpoint(tiny_run)
    prompt = "In the beginning God created the heaven and the earth."
    proc, url = start_server(tiny_dd2 / "x0", "--judge", tiny_run)
    try:
        body = {"prompt": prompt, "max_tokens": 12, "seed": 5, "best_of": 3}
        out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        source = tokenizer.encode(prompt)
        expected = best_of_generate(model, judge, [source], [source + [tokenizer.sep_id]], 12,
                                    sampling=DD2Sampling(best_of=3), eos_id=tokenizer.eos_id,
                                    generator=torch.Generator().manual_seed(5))
        assert out["diffar"]["token_ids"] == expected.tokens[0]
        assert out["diffar"]["passes"] == {"steps": 1, "denoiser_passes": 1, "decoder_passes": 1, "judge_passes": 1,
                                           "batch_size": 1}
        r = httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert_clean_error(run_cli("serve", "--checkpoint", tiny_run, "--judge", tiny_run), "DD2 checkpoint only")
