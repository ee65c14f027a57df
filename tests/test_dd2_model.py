"""DD2 networks and losses: guidance, the source encoder, the distillation loss, configs, checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import random_model
from dd2_helpers import EOS, VOCAB, inputs, random_dd2, sources
from diffar.checkpoint import load_checkpoint, write_checkpoint
from diffar.data.batching import pad_right
from diffar.decoding.ar import log_likelihoods
from diffar.decoding.dd2 import dd2_generate
from diffar.errors import DiffarError
from diffar.models.dd2 import DD2Config, expected_bleu_risk, same_weights, semantic_distance, teacher_energy
from diffar.models.transformer import TransformerConfig
from diffar.models.vqvae import TextVQVAE, VQVAEConfig


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
    (dict(ce_weight=-1.0), "ce_weight must be a number >= 0"), (dict(schedule="sqrt"), "unknown noise schedule"),
    (dict(bleu_samples=1), "bleu_samples"), (dict(refine_prob=1.5), "refine_prob"),
    (dict(energy_weight=float("nan")), "energy_weight must be a number >= 0"),
    (dict(source_encoder=TransformerConfig.from_preset("tiny", vocab_size=100)), "source_encoder's vocabulary"),
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
