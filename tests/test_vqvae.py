"""DD2 stage 1: the text autoencoder and its bottlenecks."""

import pytest
import torch

from diffar.checkpoint import load_checkpoint, write_checkpoint
from diffar.data.batching import CanvasDataset, canvas_examples
from diffar.data.corpora import load_corpus
from diffar.errors import DiffarError
from diffar.models.quantizer import GaussianBottleneck, VectorQuantizer
from diffar.models.vqvae import TextVQVAE, VQVAEConfig


def _quantizer(**overrides) -> VectorQuantizer:
    settings = dict(decay=0.5, commitment=0.25, dead_threshold=0.05) | overrides
    return VectorQuantizer(8, 6, 2, **settings).train()


def test_codes_follow_the_mean_of_their_vectors():
    """EMA updates pull each used code to the (unit-RMS) mean direction of the vectors assigned to it."""
    torch.manual_seed(0)
    vq = _quantizer(decay=0.1, dead_threshold=0.0)
    centres = vq.normalize(torch.randn(2, 8))  # two data clusters (in both groups)
    for _ in range(30):
        z = centres.repeat(50, 1) + 0.01 * torch.randn(100, 8)
        vq(z.unsqueeze(0))
    codes = vq.nearest(vq.normalize(centres))
    torch.testing.assert_close(vq.lookup(codes), vq.normalize(centres), atol=0.02, rtol=0)


def test_dead_codes_restart_on_data():
    """Codes no vector picks decay below the threshold and are moved onto encoder outputs of the batch."""
    torch.manual_seed(0)
    vq = _quantizer()
    vq(torch.randn(1, 16, 8))  # the codes start on these vectors...
    point = torch.randn(1, 1, 8)  # ...then the data moves elsewhere: one code per group follows, the rest die
    for _ in range(8):
        vq(point.expand(1, 16, 8) + 0.001 * torch.randn(1, 16, 8))
    assert int(vq.restarts) > 0
    target = vq.normalize(point).view(2, 4)
    for g in range(2):  # every code of each group now sits on (a jittered copy of) the only data point
        torch.testing.assert_close(vq.codebook[g], target[g].expand(6, 4), atol=0.01, rtol=0)


def test_usage_counts_distinct_codes():
    vq = _quantizer()
    codes = torch.tensor([[[0, 1], [0, 2], [3, 2]]])  # group 0 uses {0, 3}, group 1 uses {1, 2}
    assert vq.usage(codes) == 4 / 12


def test_straight_through_gradient_reaches_the_encoder():
    vq = _quantizer()
    z = torch.randn(1, 5, 8, requires_grad=True)
    zq, codes, loss = vq(z)
    assert codes.shape == (1, 5, 2)
    (zq.sum() + loss).backward()
    assert z.grad is not None and bool(z.grad.abs().sum() > 0)


def test_gaussian_bottleneck_uses_the_mean_at_inference():
    torch.manual_seed(0)
    kl = GaussianBottleneck(8, kl_weight=1.0)
    z = torch.randn(2, 3, 8)
    kl.eval()
    a, codes, loss = kl(z)
    b, _, _ = kl(z)
    assert codes is None and torch.equal(a, b) and float(loss.detach()) > 0
    kl.train()
    assert not torch.equal(kl(z)[0], a)  # training samples


@pytest.fixture(scope="module")
def canvases(tokenizer):
    cfg = VQVAEConfig.from_preset("tiny", tokenizer.vocab_size)
    pairs = canvas_examples(load_corpus("kjv2web", "valid"), tokenizer, cfg.prompt_len, cfg.target_len, 1)[:24]
    return CanvasDataset(pairs, tokenizer, cfg.width, cfg.max_len, with_source=False)


def test_canvas_layout(canvases, tokenizer):
    batch = canvases.batch([0, 1, 2])["targets"]
    for row, i in zip(batch.tolist(), [0, 1, 2]):
        n = row.index(tokenizer.eos_id)
        assert row[n + 1:] == [tokenizer.pad_id] * (len(row) - n - 1)  # text, <eos>, then pads only
        assert len(canvases.canvases[i]) >= n + 1


@pytest.mark.parametrize("bottleneck", ["vq", "kl"])
def test_autoencoder_learns_to_reconstruct(canvases, tokenizer, bottleneck):
    """A tiny autoencoder overfits 24 canvases: it can carry the tokens through its bottleneck."""
    torch.manual_seed(0)
    model = TextVQVAE(VQVAEConfig.from_preset("tiny", tokenizer.vocab_size, bottleneck=bottleneck)).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    batch = canvases.batch(list(range(len(canvases))))
    for _ in range(150):
        _, loss = model(**batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model.decode(model.encode(batch["targets"])).argmax(-1) == batch["targets"]).float().mean()
    assert float(acc) > 0.9, float(acc)


def test_save_and_load_keeps_codebooks(tmp_path, tokenizer, canvases):
    torch.manual_seed(0)
    model = TextVQVAE(VQVAEConfig.from_preset("tiny", tokenizer.vocab_size)).train()
    targets = canvases.batch([0, 1])["targets"]
    model(targets)  # the first batch seeds the codebooks
    model.eval()
    meta = {"kind": "vqvae", "model": model.config.to_dict(), "task": "seq2seq", "corpus": "kjv2web"}
    write_checkpoint(tmp_path / "vq", model, meta, tokenizer)
    loaded, _, _ = load_checkpoint(tmp_path / "vq")
    assert torch.equal(loaded.bottleneck.codebook, model.bottleneck.codebook)
    torch.testing.assert_close(loaded.decode(loaded.encode(targets)), model.decode(model.encode(targets)))


def test_bad_config():
    with pytest.raises(DiffarError, match="unknown bottleneck"):
        VQVAEConfig(bottleneck="fsq")
    with pytest.raises(DiffarError, match="groups"):
        VQVAEConfig(d_latent=30, groups=4)
