"""The CLI end to end on a `tiny` model, and every bad input giving one line and a non-zero exit."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY_TRAIN, assert_clean_error, run_cli


def test_help_everywhere():
    for args in ([], ["tokenizer", "train"], ["train", "ar"], ["export"], ["generate"], ["eval"], ["bench", "ar"]):
        proc = run_cli(*args, "--help")
        assert proc.returncode == 0 and "usage:" in proc.stdout


def test_tokenizer_train(tmp_path):
    proc = run_cli("tokenizer", "train", "--corpus", "kjv2web", "--vocab-size", "400", "--out", tmp_path / "t.json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "t.json").read_text())["model"]["type"] == "BPE"


def test_generate_streams_and_reports_speed(tiny_run):
    proc = run_cli("generate", "--checkpoint", tiny_run, "--prompt", "In the beginning", "--max-new-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stderr and "AR passes" in proc.stderr
    stdin = run_cli("generate", "--checkpoint", tiny_run, "--max-new-tokens", "12", input="In the beginning")
    assert stdin.stdout == proc.stdout  # greedy: same text from stdin
    nocache = run_cli("generate", "--checkpoint", tiny_run, "--prompt", "In the beginning", "--max-new-tokens", "12",
                      "--no-cache")
    assert nocache.stdout == proc.stdout
    bf16 = run_cli("generate", "--checkpoint", tiny_run, "--prompt", "In the beginning", "--max-new-tokens", "12",
                   "--dtype", "bf16")
    assert bf16.returncode == 0 and bf16.stderr.rstrip().endswith("| bf16") and proc.stderr.rstrip().endswith("| fp32"), bf16.stderr


def test_sampling_flags(tiny_run):
    args = ("generate", "--checkpoint", tiny_run, "--prompt", "And he said", "--max-new-tokens", "16",
            "--temperature", "1.0", "--top-k", "40", "--top-p", "0.9")
    a, b = run_cli(*args, "--seed", "1"), run_cli(*args, "--seed", "1")
    assert a.returncode == 0 and a.stdout == b.stdout


def test_eval_reports_metrics_and_baseline(tiny_run, tmp_path):
    proc = run_cli("eval", "--checkpoint", tiny_run, "--limit", "8", "--out", tmp_path / "r.json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["examples"] == 8 and report["perplexity"] > 1
    assert set(report["model"]) == {"bleu4", "chrf", "rougeL"}
    assert report["copy_source_baseline"]["bleu4"] > 20


def test_export_and_bench(tiny_run, tmp_path):
    proc = run_cli("export", "--checkpoint", tiny_run, "--out", tmp_path / "exp")
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "exp" / "train_state.pt").exists()
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "ar", "--checkpoint", tmp_path / "exp", "--batch-sizes", "1", "2", "--new-tokens", "16",
                   "--out", out)
    assert proc.returncode == 0, proc.stderr
    records = json.loads(out.read_text())
    assert {(r["method"], r["batch_size"]) for r in records} == {(m, b) for m in ("ar", "ar-nocache") for b in (1, 2)}
    keys = {"method", "task", "batch_size", "prompt_tokens", "new_tokens", "latency_ms", "tokens_per_s",
            "forward_passes", "device", "torch_threads", "dtype"}
    assert all(keys <= set(r) and r["new_tokens"] == 16 and r["forward_passes"] == 16 for r in records)


# ---- bad input ------------------------------------------------------------------------------------
def test_missing_checkpoint():
    assert_clean_error(run_cli("generate", "--checkpoint", "/no/such/dir", "--prompt", "x"), "no checkpoint")


def test_corrupt_checkpoint(tiny_run, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_run, broken)
    ckpt = broken / (broken / "latest").read_text().strip()
    (ckpt / "model.safetensors").write_bytes(b"garbage")
    assert_clean_error(run_cli("generate", "--checkpoint", broken, "--prompt", "x"), "corrupt checkpoint")


def test_tokenizer_mismatch(tiny_run):
    proc = run_cli("generate", "--checkpoint", tiny_run, "--tokenizer", "tokenizer/diffar-8k.json", "--prompt", "x")
    assert_clean_error(proc, "does not match")


def test_empty_prompt(tiny_run):
    assert_clean_error(run_cli("generate", "--checkpoint", tiny_run, "--prompt", "   "), "empty prompt")
    assert_clean_error(run_cli("generate", "--checkpoint", tiny_run, input=""), "empty prompt")


def test_prompt_longer_than_context(tiny_run):
    proc = run_cli("generate", "--checkpoint", tiny_run, "--prompt", "word " * 400)
    assert_clean_error(proc, "leaves this model no room to write")


def test_stdin_that_is_not_utf8(tiny_run):
    proc = subprocess.run([sys.executable, "-m", "diffar.cli", "generate", "--checkpoint", str(tiny_run)],
                          input=b"And God said \xff\xfe", capture_output=True, cwd=ROOT)
    assert_clean_error(subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(),
                                                   proc.stderr.decode()), "not UTF-8")


@pytest.mark.parametrize("args, message", [
    (("serve", "--port", "-1"), "--port: must be in 1..65535"),
    (("serve", "--port", "99999"), "--port: must be in 1..65535"),
    (("serve", "--batch-window-ms", "1e12"), "--batch-window-ms: must be a number in [0, 10000]"),
    (("serve", "--batch-window-ms", "nan"), "--batch-window-ms"),
    (("serve", "--batch-window-ms", "-5"), "--batch-window-ms"),
    (("serve", "--log-level", "bogus"), "--log-level"),
    (("generate", "--seed", str(2 ** 70)), "--seed: must be in 0.."),
    (("serve", "--model-id", ""), "--model-id: must not be empty"),
    (("serve", "--max-wait-s", "0"), "--max-wait-s: must be a number in [0.1, 3600]"),
    (("generate", "--prompt-lookup", "--k", "100000"), "--k: must be in 1..64"),
    (("generate", "--steps", "1000000"), "--steps: must be in 1..1000"),
    (("generate", "--tree", "0"), "--tree: must be in 1..1024"),
    (("generate", "--top-p", "1.5"), "--top-p: must be a number in [0, 1]"),
    (("bench", "ar", "--batch-sizes", "1000000"), "--batch-sizes: must be in 1..1024"),
])
def test_bad_flag_values(tiny_run, args, message):
    assert_clean_error(run_cli(*args, "--checkpoint", tiny_run), message)


def test_training_seed_out_of_range(tmp_path):
    proc = run_cli("train", "ar", "--corpus", "kjv2web", *TINY_TRAIN, "--seed", str(2 ** 70), "--out", tmp_path)
    assert_clean_error(proc, "--seed: must be in 0..")


def test_resume_from_a_corrupt_train_state(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    ckpt = run / (run / "latest").read_text().strip()
    (ckpt / "train_state.pt").write_bytes(b"\x80\x04garbage")
    meta = json.loads((ckpt / "config.json").read_text())
    proc = run_cli("train", "ar", "--corpus", "kjv2web", *TINY_TRAIN, "--tokenizer", ckpt / "tokenizer.json",
                   "--max-steps", "20", "--block-size", str(meta["block_size"]), "--out", run)
    assert_clean_error(proc, "train_state.pt are unreadable")


@pytest.mark.parametrize("n", ["0", "-5"])
def test_non_positive_max_new_tokens(tiny_run, n):
    assert_clean_error(run_cli("generate", "--checkpoint", tiny_run, "--prompt", "x", "--max-new-tokens", n),
                       "--max-new-tokens: must be positive")


def test_unknown_preset_and_corpus(tmp_path):
    assert_clean_error(run_cli("train", "ar", "--corpus", "kjv2web", "--preset", "huge", "--out", tmp_path),
                       "invalid choice: 'huge'")
    assert_clean_error(run_cli("train", "ar", "--corpus", "klingon", "--preset", "tiny", "--out", tmp_path),
                       "unknown corpus 'klingon'")


def test_unreadable_data_file(tmp_path):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text("{broken\n")
    assert_clean_error(run_cli("train", "ar", "--corpus", bad, "--preset", "tiny", "--out", tmp_path / "r"),
                       "invalid JSON")
    assert_clean_error(run_cli("tokenizer", "train", "--corpus", tmp_path / "nope.txt", "--out", tmp_path / "t"),
                       "unknown corpus")


@pytest.mark.parametrize("flag, value, message", [
    ("--max-steps", "0", "max_steps must be positive"),
    ("--beta2", "1.5", "beta2 must be in [0, 1)"),
    ("--lr", "nan", "lr must be a positive number, got nan"),
    ("--grad-clip", "0", "grad_clip must be positive"),
    ("--precision", "fp8", "precision must be fp32 or bf16"),
])
def test_bad_training_flags(tmp_path, flag, value, message):
    proc = run_cli("train", "ar", "--corpus", "kjv2web", *TINY_TRAIN, flag, value, "--out", tmp_path)
    assert_clean_error(proc, message)


def test_bad_sampling_flags(tiny_run):
    proc = run_cli("generate", "--checkpoint", tiny_run, "--prompt", "x", "--temperature", "nan")
    assert_clean_error(proc, "--temperature: must be a number in [0, 100], got nan")


def test_unwritable_output(tiny_run, tmp_path):
    (tmp_path / "file").write_text("")
    proc = run_cli("eval", "--checkpoint", tiny_run, "--limit", "2", "--out", tmp_path / "file" / "r.json")
    assert_clean_error(proc, "file")


def test_eval_refuses_to_test_on_training_data(tokenizer_path, tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(f'{{"source": "s {i}", "target": "t {i}"}}\n' for i in range(60)))
    proc = run_cli("train", "ar", "--corpus", data, "--tokenizer", tokenizer_path, *TINY_TRAIN, "--max-steps", "2",
                   "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert_clean_error(run_cli("eval", "--checkpoint", tmp_path / "run"), "is the training data itself")
    bench = ("bench", "speculative", "--checkpoint", tmp_path / "run", "--methods", "ar", "--prompts", "2",
             "--out", tmp_path / "b.json")
    assert_clean_error(run_cli(*bench), "is the training data itself")  # a bench scores its text too
    ok = run_cli("eval", "--checkpoint", tmp_path / "run", "--split", "valid")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["examples"] == 3  # 1 in 20 held out
    other = tmp_path / "test.jsonl"
    other.write_text("".join(f'{{"source": "u {i}", "target": "v {i}"}}\n' for i in range(40)))
    assert_clean_error(run_cli("eval", "--checkpoint", tmp_path / "run", "--corpus", other, "--split", "valid"),
                       "its 'valid' split would be 1 record in 20 of it")
    whole = run_cli("eval", "--checkpoint", tmp_path / "run", "--corpus", other)
    assert whole.returncode == 0 and json.loads(whole.stdout)["examples"] == 40, whole.stderr


def test_a_valid_corpus_leaves_the_whole_training_file_to_train_on(tokenizer_path, tmp_path):
    data, valid = tmp_path / "mine.jsonl", tmp_path / "valid.jsonl"
    data.write_text("".join(f'{{"source": "s {i}", "target": "t {i}"}}\n' for i in range(40)))
    valid.write_text("".join(f'{{"source": "v {i}", "target": "w {i}"}}\n' for i in range(5)))
    proc = run_cli("train", "ar", "--corpus", data, "--valid-corpus", valid, "--tokenizer", tokenizer_path,
                   *TINY_TRAIN, "--max-steps", "1", "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert "40 train examples" in proc.stdout


def test_resume_refuses_a_different_model(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    ckpt = run / (run / "latest").read_text().strip()
    proc = run_cli("train", "ar", "--corpus", "kjv2web", "--preset", "small", "--out", run, "--max-steps", "20",
                   "--tokenizer", ckpt / "tokenizer.json")
    assert_clean_error(proc, "different model")


def test_speculative_generation_matches_plain_greedy(tiny_run):
    args = ("generate", "--checkpoint", tiny_run, "--prompt", "And the LORD said", "--max-new-tokens", "16")
    plain = run_cli(*args)
    for extra in (("--prompt-lookup",), ("--draft", str(tiny_run), "--k", "4")):
        spec = run_cli(*args, *extra)
        assert spec.returncode == 0, spec.stderr
        assert spec.stdout == plain.stdout and "drafts accepted" in spec.stderr


def test_bench_speculative(tiny_run, tmp_path):
    out = tmp_path / "spec.json"
    proc = run_cli("bench", "speculative", "--checkpoint", tiny_run, "--draft", tiny_run, "--prompts", "3",
                   "--new-tokens", "12", "--k", "4", "--out", out)
    assert proc.returncode == 0, proc.stderr
    records = {r["method"]: r for r in json.loads(out.read_text())}
    assert set(records) == {"ar", "ar+prompt-lookup", "ar+draft"}
    assert all(r["extra"]["exact_match_vs_ar"] == 1.0 for r in records.values())  # lossless
    assert records["ar+draft"]["extra"]["draft_acceptance"] == 1.0  # the model drafting for itself


def test_bad_speculative_flags(tiny_run, tokenizer_path):
    args = ("generate", "--checkpoint", tiny_run, "--prompt", "x")
    assert_clean_error(run_cli(*args, "--prompt-lookup", "--k", "0"), "--k: must be in 1..64")
    assert_clean_error(run_cli(*args, "--prompt-lookup", "--draft", tiny_run), "choose one drafter")
    assert_clean_error(run_cli(*args, "--draft", "checkpoints/ar-shakespeare"), "uses another tokenizer")


def test_bench_refuses_a_corpus_of_another_task(tiny_run, tmp_path):
    proc = run_cli("bench", "ar", "--checkpoint", tiny_run, "--corpus", "shakespeare", "--out", tmp_path / "b.json")
    assert_clean_error(proc, "shakespeare is a continuation corpus but the checkpoint was trained for seq2seq")


def test_plain_ar_makes_one_token_a_pass_end_token_included(tiny_run):
    proc = run_cli("generate", "--checkpoint", tiny_run, "--prompt", "And God said", "--max-new-tokens", "60")
    assert proc.returncode == 0 and "(1.00 tokens/AR pass)" in proc.stderr, proc.stderr


def test_bench_skips_a_draft_peer_that_cannot_fit(tiny_shakespeare_run, tmp_path):
    """The shipped drafter uses diffar-8k, the test models a 512-token tokenizer: bench runs without ar+draft
    and says why (it used to fail on a flag the user never passed)."""
    proc = run_cli("bench", "speculative", "--checkpoint", tiny_shakespeare_run, "--prompts", "1", "--new-tokens", "4",
                   "--out", tmp_path / "b.json")
    assert proc.returncode == 0, proc.stderr
    assert "skipping ar+draft: checkpoints/draft-kjv2web uses another tokenizer" in proc.stderr
    assert [r["method"] for r in json.loads((tmp_path / "b.json").read_text())] == ["ar", "ar+prompt-lookup"]


def test_shipped_checkpoints_are_found_from_any_folder(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "diffar.cli", "generate", "--checkpoint", "checkpoints/ar-kjv2web",
                           "--prompt", "And God said", "--max-new-tokens", "3"], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr


def test_training_from_scratch_on_little_data_gets_advice(tokenizer_path, tmp_path):
    data = tmp_path / "es.jsonl"
    data.write_text("".join(f'{{"source": "number {i}", "target": "muchísimas gracias por el número {i}"}}\n'
                            for i in range(60)))
    proc = run_cli("train", "ar", "--corpus", data, "--tokenizer", tokenizer_path, *TINY_TRAIN, "--max-steps", "1",
                   "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert "tokens per word of this corpus under this tokenizer" in proc.stdout
    assert "is very little data" in proc.stdout and "--init" in proc.stdout
