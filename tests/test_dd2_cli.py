"""The DD2 pipeline through the command line: train, distill, generate, bench, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_TRAIN, assert_clean_error, run_cli
from diffar.checkpoint import load_checkpoint, write_checkpoint
from diffar.models.dd2 import same_weights
from diffar.training.setup import dd2_model


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


def test_bench_scores_with_a_model_of_another_tokenizer(tiny_dd2, tiny_run, smollm2_checkpoint, tmp_path):
    """--scorer: SmolLM2 (its own tokenizer) scores greedy AR, sampled AR and one-step DD2 text alike; sampled
    AR differs from greedy AR; an unknown ar-t method is refused."""
    out = tmp_path / "scored.json"
    proc = run_cli("bench", "dd2", "--checkpoint", tiny_dd2 / "x0", "--ar", tiny_run, "--prompts", "3",
                   "--batch-sizes", "3", "--methods", "ar", "ar-t0.7", "dd2-1", "--split", "valid",
                   "--scorer", smollm2_checkpoint, "--out", out)
    assert proc.returncode == 0, proc.stderr
    records = {r["method"]: r for r in json.loads(out.read_text())}
    assert all(1 < r["extra"]["scorer_perplexity"] < 1e6 for r in records.values())
    assert (records["ar"]["extra"]["temperature"], records["ar-t0.7"]["extra"]["temperature"]) == (0.0, 0.7)
    assert records["ar"]["extra"]["scorer_perplexity"] != records["ar-t0.7"]["extra"]["scorer_perplexity"]
    assert_clean_error(run_cli("bench", "dd2", "--checkpoint", tiny_dd2 / "x0", "--ar", tiny_run, "--methods",
                               "ar-t0", "--out", tmp_path / "b.json"), "unknown method")
    assert_clean_error(run_cli("bench", "dd2", "--checkpoint", tiny_dd2 / "x0", "--ar", tiny_run, "--scorer",
                               tiny_dd2 / "x0", "--out", tmp_path / "b.json"), "must be an AR one")


def test_cli_bad_input(tiny_dd2, tiny_vqvae, tiny_run, tokenizer_path, tmp_path):
    args = ("generate", "--checkpoint", tiny_dd2 / "x0", "--prompt", "x")
    assert_clean_error(run_cli(*args, "--steps", "0"), "--steps: must be in 1..1000")
    assert_clean_error(run_cli(*args, "--guidance", "-1"), "--guidance: must be a number in [0, 100]")
    assert_clean_error(run_cli(*args, "--preset", "fast"), "invalid choice")
    assert_clean_error(run_cli(*args, "--temperature", "0.5"), "--tau")
    assert_clean_error(run_cli(*args, "--tau", "0.5"), "tau needs more steps")
    assert_clean_error(run_cli(*args, "--judge", tiny_run), "pass --best-of N")
    assert_clean_error(run_cli(*args, "--best-of", "1", "--judge", tiny_run), "pass --best-of N")
    assert_clean_error(run_cli(*args, "--best-of", "4", "--judge", tiny_run, "--hybrid", tiny_run), "do not combine")
    assert_clean_error(run_cli(*args, "--best-of", "0", "--judge", tiny_run), "positive")
    assert_clean_error(run_cli("bench", "dd2", "--checkpoint", tiny_dd2 / "x0", "--ar", tiny_run, "--methods",
                               "dd2-1x0", "--out", tmp_path / "b.json"), "unknown method")
    assert_clean_error(run_cli("generate", "--checkpoint", tiny_run, "--prompt", "x", "--steps", "2",
                               "--method", "dd2"), "cannot decode")
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
                       "; it must be an AR, ReFusion or drafter one")
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
                       "; it must be an AR, ReFusion or drafter one")
    other, tokenizer, meta = load_checkpoint(tiny_run)  # the teacher with other weights
    with torch.no_grad():
        other.lm_head.weight.add_(1.0)
    write_checkpoint(tmp_path / "other", other, meta, tokenizer)
    assert_clean_error(run_cli(*args, "--init", tmp_path / "enc", "--source-encoder", tmp_path / "other",
                               "--out", tmp_path / "b"), "an --init model keeps its own")
    # an --init model without an encoder gains one through a zero map: its predictions start out unchanged
    plain = load_checkpoint(tiny_dd2 / "x0")[0].eval()
    gained = dd2_model("kjv2web", str(tmp_path / "c"), prediction="x0", preset="small", init=str(tiny_dd2 / "x0"),
                       source_encoder=str(tiny_run)).model.eval()
    assert same_weights(gained.source_encoder, teacher)
    source = torch.randint(5, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    z = torch.randn(2, 12, plain.config.vqvae.d_latent, generator=torch.Generator().manual_seed(1))
    mask, t = torch.ones_like(source, dtype=torch.bool), torch.ones(2)
    assert gained.encode_source(source).abs().sum() > 0
    torch.testing.assert_close(gained.predict(z, t, source, mask), plain.predict(z, t, source, mask))
