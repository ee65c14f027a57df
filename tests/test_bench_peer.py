"""`diffar bench ar --peer transformers`: transformers' generate on the same weights gives the same greedy
text, and every record carries the memory-bandwidth ceiling."""

from __future__ import annotations

import sys

import pytest
import torch

from diffar.checkpoint import load_checkpoint
from diffar.decoding.ar import generate
from diffar.errors import DiffarError
from diffar.evaluation.bench import bench_ar
from diffar.evaluation.hardware import memory_bandwidth, weight_bytes_per_step
from diffar.evaluation.peers import transformers_generate, transformers_llama, transformers_version
from diffar.importing import import_model
from tests.conftest import random_model
from tests.test_llama_import import hf_llama


@pytest.fixture(scope="module")
def imported(tokenizer, tmp_path_factory):
    """A tiny random Llama (grouped-query attention, untied output layer) imported into diffar, fp32."""
    root = tmp_path_factory.mktemp("peer")
    hf_llama(tokenizer, root / "hf", num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0)
    import_model(root / "hf", root / "diffar", dtype="fp32")
    return root / "diffar"


def test_bench_peer_records_transformers_with_identical_text(imported):
    records = bench_ar(str(imported), "kjv2web", [1, 3], 12, 1, "fp32", ("ar",), "transformers")
    assert [(r.method, r.batch_size) for r in records] == [("ar", 1), ("transformers", 1), ("ar", 3),
                                                           ("transformers", 3)]
    for r in records:
        assert r.new_tokens == 12 and r.tokens_per_s > 0
        assert r.extra["ceiling_tokens_per_s"] > 0 and r.extra["bandwidth_gb_s"] > 0
    peers = [r for r in records if r.method == "transformers"]
    assert all(r.extra["identical_rows"] == 1.0 for r in peers), [r.extra for r in peers]


def test_the_weights_map_back_exactly(imported, tokenizer):
    model, tok, _ = load_checkpoint(imported)
    peer = transformers_llama(model, tok.pad_id)
    ids = torch.randint(10, 500, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(peer(ids).logits, model(ids)[0], rtol=0, atol=1e-4)
    prompts = [tok.encode("And God said"), tok.encode("To be, or not to be, that is")]  # left-padded together
    assert transformers_generate(peer, prompts, 10, tok.pad_id).tokens == \
        generate(model, prompts, 10, pad_id=tok.pad_id, eos_id=None).tokens


def test_a_missing_transformers_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(DiffarError, match="pip install transformers"):
        transformers_version()


def test_bandwidth_probe_and_bytes_per_step():
    assert memory_bandwidth(mib=32, repeats=2) > 0
    tied = random_model(0)
    assert weight_bytes_per_step(tied) == 4 * sum(p.numel() for p in tied.parameters())  # the shared matrix once
    untied = random_model(0, tie_embeddings=False)
    embedding = untied.tok_emb.weight.numel()
    assert weight_bytes_per_step(untied) == 4 * (sum(p.numel() for p in untied.parameters()) - embedding)
