"""Shared fixtures: a small tokenizer and `tiny` models trained on slices of the embedded corpora."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from diffar.data.corpora import load_corpus
from diffar.models.transformer import Transformer, TransformerConfig
from diffar.tokenizer import train_tokenizer

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tokenizer():
    texts = load_corpus("kjv2web", "valid").texts() + [d[:20000] for d in load_corpus("shakespeare", "valid").documents]
    return train_tokenizer(texts, vocab_size=512)


@pytest.fixture(scope="session")
def tokenizer_path(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tok.json"
    tokenizer.save(path)
    return path


def random_model(seed: int, vocab: int = 512, **overrides) -> Transformer:
    """A `tiny` model with large random weights. (At the usual small init, tied embeddings make an
    untrained model repeat its last token forever, which would let decoding tests pass trivially.)"""
    torch.manual_seed(seed)
    model = Transformer(TransformerConfig.from_preset("tiny", vocab_size=vocab, **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


@pytest.fixture
def tiny_model():
    return random_model(0)


def run_cli(*args: str, input: str | None = None, timeout: int = 300, env: dict | None = None):
    """Run `python -m diffar.cli ARGS`; returns the CompletedProcess (text mode)."""
    return subprocess.run(
        [sys.executable, "-m", "diffar.cli", *map(str, args)], input=input, capture_output=True, text=True,
        timeout=timeout, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def assert_clean_error(proc, message: str):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert message in lines[0], lines[0]


TINY_TRAIN = ("--preset", "tiny", "--batch-size", "8", "--eval-every", "5", "--eval-examples", "16",
              "--save-every", "5", "--warmup-steps", "2", "--threads", "1")


@pytest.fixture(scope="session")
def tiny_refusion(tiny_run, tmp_path_factory):
    """A `tiny` ReFusion model whose AR stream is `tiny_run`, trained for 30 steps through the CLI."""
    out = tmp_path_factory.mktemp("runs") / "tiny-refusion"
    proc = run_cli("train", "refusion", "--corpus", "kjv2web", "--ar", tiny_run, "--out", out, "--max-steps", "30",
                   "--block-size", "128", "--lr", "3e-3", *TINY_TRAIN)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="session")
def domain_refusion(tiny_run, tmp_path_factory):
    """A `tiny` ReFusion model with a domain adapter over the kjv2web,web2rv mixture, on `tiny_run`'s AR stream."""
    out = tmp_path_factory.mktemp("runs") / "tiny-domains"
    proc = run_cli("train", "refusion", "--corpus", "kjv2web,web2rv", "--domain-adapter", "--ar", tiny_run,
                   "--out", out, "--max-steps", "3", "--block-size", "128", *TINY_TRAIN)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="session")
def tiny_run(tokenizer_path, tmp_path_factory):
    """A `tiny` seq2seq model trained for 10 steps through the CLI (a run folder)."""
    return train_tiny_ar("kjv2web", 10, tokenizer_path, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_shakespeare_run(tokenizer_path, tmp_path_factory):
    """A `tiny` continuation model trained for 2 steps through the CLI (a run folder)."""
    return train_tiny_ar("shakespeare", 2, tokenizer_path, tmp_path_factory)


def train_tiny_ar(corpus: str, steps: int, tokenizer_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / f"tiny-{corpus}"
    proc = run_cli("train", "ar", "--corpus", corpus, "--tokenizer", tokenizer_path, "--out", out,
                   "--max-steps", str(steps), "--block-size", "128", *TINY_TRAIN)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="session")
def tiny_vqvae(tokenizer_path, tmp_path_factory):
    """A `tiny` text autoencoder trained for 6 steps through the CLI (a run folder)."""
    out = tmp_path_factory.mktemp("runs") / "tiny-vqvae"
    proc = run_cli("train", "vqvae", "--corpus", "kjv2web", "--tokenizer", tokenizer_path, "--out", out,
                   "--max-steps", "6", *TINY_TRAIN)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="session")
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


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory):
    """SmolLM2-135M-Instruct imported (fp32) from the GGUF file pip delivers (`make test` installs it): a chat
    model with a chat template."""
    from diffar.importing import import_model
    from diffar.importing.embedded import smollm2_gguf

    out = tmp_path_factory.mktemp("smollm2") / "ckpt"
    import_model(smollm2_gguf(), out, dtype="fp32")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers_health(url: str, proc: subprocess.Popen, seconds: float = 60) -> bool:
    """Wait until the server at `url` (run by `proc`) answers /health; False if it died or took too long."""
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return True
        except httpx.TransportError:
            time.sleep(0.1)
    return False


@contextlib.contextmanager
def serving(checkpoint, *flags) -> Iterator[str]:
    """`diffar serve` on a free loopback port: yields its base URL once /health answers, stops it after."""
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")  # not a pipe: nobody reads it while the tests run
    proc = subprocess.Popen([sys.executable, "-m", "diffar.cli", "serve", "--checkpoint", str(checkpoint),
                             "--port", str(port), "--model-id", "tiny", *flags],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    if not answers_health(url, proc):
        proc.kill()
        log.seek(0)
        raise RuntimeError(f"server did not start: {log.read()}")
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
