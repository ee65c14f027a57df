"""The KV cache is an optimisation only: every cached logit must equal the uncached one."""

import torch

from diffar.decoding.ar import Batch, decode_one_token, prefill


def full_logits(model, batch: Batch) -> torch.Tensor:
    T = batch.tokens.shape[1]
    logits, _ = model(batch.tokens, positions=batch.positions(0, T), attn_mask=batch.attn_mask(0, T))
    return logits


def test_cached_decode_equals_full_forward(tiny_model):
    torch.manual_seed(1)
    prompts = [torch.randint(5, 512, (n,)).tolist() for n in (7, 3, 11)]
    batch = Batch.from_prompts(prompts, pad_id=0)
    continuation = torch.randint(5, 512, (3, 6))
    tiny_model.setup_cache(3, 32)
    cached = [prefill(tiny_model, batch)]
    width = batch.tokens.shape[1]
    for i in range(continuation.shape[1]):
        cached.append(decode_one_token(tiny_model, batch, continuation[:, i], width + i))
    full = full_logits(tiny_model, Batch(torch.cat([batch.tokens, continuation], 1), batch.pad))
    for i, logits in enumerate(cached):
        torch.testing.assert_close(logits, full[:, width - 1 + i], rtol=1e-4, atol=1e-5)


def test_padding_does_not_change_a_row(tiny_model):
    prompt = [11, 12, 13, 14]
    alone = full_logits(tiny_model, Batch.from_prompts([prompt], 0))[0, -1]
    padded = full_logits(tiny_model, Batch.from_prompts([prompt, list(range(20, 30))], 0))[0, -1]
    torch.testing.assert_close(alone, padded, rtol=1e-4, atol=1e-5)


def test_rewriting_slots_rolls_back(tiny_model):
    """Overwriting cache slots from `start` equals a cache that never saw the discarded tokens."""
    batch = Batch.from_prompts([[5, 6, 7, 8]], 0)
    tiny_model.setup_cache(1, 16)
    prefill(tiny_model, batch)
    decode_one_token(tiny_model, batch, torch.tensor([99]), 4)
    after_rollback = decode_one_token(tiny_model, batch, torch.tensor([42]), 4)
    tiny_model.setup_cache(1, 16)
    prefill(tiny_model, batch)
    fresh = decode_one_token(tiny_model, batch, torch.tensor([42]), 4)
    torch.testing.assert_close(after_rollback, fresh)
