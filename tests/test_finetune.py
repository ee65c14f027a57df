"""`diffar train ar --init`: fine-tuning starts from the given checkpoint's weights, architecture and tokenizer
(a diffar-trained model, or a Llama imported from Hugging Face), and its checkpoint says where it came from."""

from __future__ import annotations

import json

import torch
from test_llama_import import hf_llama

from conftest import assert_clean_error, run_cli
from diffar.checkpoint import load_checkpoint, read_meta, resolve
from diffar.data.batching import build_dataset
from diffar.data.corpora import load_corpus
from diffar.evaluation.metrics import mean_nll
from diffar.importing import import_model

FINETUNE = ("--batch-size", "4", "--eval-examples", "8", "--warmup-steps", "1", "--threads", "1")


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_finetuning_starts_from_the_checkpoint(tiny_run, tmp_path):
    """At a negligible learning rate, the validation loss after one step is the starting model's own."""
    model, tokenizer, meta = load_checkpoint(tiny_run)
    out = tmp_path / "ft"
    proc = run_cli("train", "ar", "--init", tiny_run, "--corpus", "kjv2web", "--out", out, "--max-steps", "1",
                   "--eval-every", "1", "--lr", "1e-12", "--block-size", meta["block_size"], *FINETUNE)
    assert proc.returncode == 0, proc.stderr
    valid = build_dataset(load_corpus("kjv2web", "valid"), tokenizer, meta["block_size"])
    with torch.no_grad():
        expected = mean_nll(model, valid, 4, 8)
    assert abs(metrics(out)[-1]["val_loss"] - expected) < 1e-4
    _, _, ft_meta = load_checkpoint(out)
    assert ft_meta["init"] == str(tiny_run) and ft_meta["model"] == meta["model"]


def test_finetune_an_imported_llama_on_pairs(tokenizer, tmp_path):
    """An imported model has no separator token: seq2seq fine-tuning uses its end-of-sequence token, and the
    checkpoint records it, so generation reads the pairs as training wrote them."""
    hf_llama(tokenizer, tmp_path / "hf", num_attention_heads=4, num_key_value_heads=2)
    import_model(tmp_path / "hf", tmp_path / "imported", dtype="bf16")
    imported, imported_tokenizer, _ = load_checkpoint(tmp_path / "imported")
    assert imported_tokenizer.sep_id is None
    out = tmp_path / "ft"
    proc = run_cli("train", "ar", "--init", tmp_path / "imported", "--corpus", "kjv2web", "--out", out,
                   "--max-steps", "2", "--eval-every", "2", *FINETUNE)
    assert proc.returncode == 0, proc.stderr
    model, ft_tokenizer, meta = load_checkpoint(out)
    assert (meta["task"], ft_tokenizer.sep_id) == ("seq2seq", ft_tokenizer.eos_id)
    assert model.config == imported.config
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), imported.state_dict().values()))
    gen = run_cli("generate", "--checkpoint", out, "--prompt", "In the beginning", "--max-new-tokens", "4")
    assert gen.returncode == 0, gen.stderr


def test_lora_trains_adapters_only_and_resumes_exactly(tiny_run, tmp_path):
    """With --lora-rank the model stays frozen: once merged, embeddings and norms are the starting model's, the
    block projections moved; a run stopped and resumed ends where an uninterrupted one does (at a constant
    learning rate, which does not depend on --max-steps)."""
    lora = ("--init", tiny_run, "--corpus", "kjv2web", "--lora-rank", "4", "--lr", "1e-2", "--min-lr-ratio", "1",
            "--eval-every", "3", "--save-every", "2", *FINETUNE)
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert run_cli("train", "ar", *lora, "--out", whole, "--max-steps", "3").returncode == 0
    assert run_cli("train", "ar", *lora, "--out", split, "--max-steps", "2").returncode == 0
    resumed = run_cli("train", "ar", *lora, "--out", split, "--max-steps", "3")
    assert resumed.returncode == 0 and "resuming at step 2" in resumed.stdout, resumed.stderr
    assert read_meta(resolve(whole))["lora"] == {"rank": 4, "alpha": 16.0}
    start, _, _ = load_checkpoint(tiny_run)
    tuned, _, meta = load_checkpoint(whole)
    again, _, _ = load_checkpoint(split)
    assert "lora" not in meta and list(tuned.state_dict()) == list(start.state_dict())
    for name, weight in tuned.state_dict().items():
        assert torch.equal(weight, again.state_dict()[name]), name
        adapted = name.endswith(("qkv.weight", "proj.weight", "gate_up.weight", "down.weight"))
        assert torch.equal(weight, start.state_dict()[name]) != adapted, name


def test_finetune_bad_input(tiny_run, tiny_dd2, tmp_path):
    args = ("train", "ar", "--corpus", "kjv2web", "--out", tmp_path / "x", "--max-steps", "1")
    assert_clean_error(run_cli(*args, "--init", tiny_run, "--preset", "tiny"), "drop --preset and --tokenizer")
    assert_clean_error(run_cli(*args, "--init", tiny_dd2 / "x0"), "not an AR one")
    assert_clean_error(run_cli(*args, "--init", tmp_path / "missing"), "no checkpoint")
    assert_clean_error(run_cli(*args, "--lora-rank", "4"), "pass --init")
