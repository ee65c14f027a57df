"""The KV cache is an optimisation only: every cached logit must equal the uncached one."""

import pytest
import torch

from diffar.decoding.ar import Batch, decode_one_token, prefill
from diffar.models.kv_cache import KVCache
from tests.conftest import random_model


def full_logits(model, batch: Batch) -> torch.Tensor:
    T = batch.tokens.shape[1]
    logits, _ = model(batch.tokens, positions=batch.positions(0, T), attn_mask=batch.attn_mask(0, T))
    return logits


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # multi-head, grouped-query, multi-query attention
def test_cached_decode_equals_full_forward(kv_heads):
    model = random_model(0, n_kv_head=kv_heads)
    torch.manual_seed(1)
    prompts = [torch.randint(5, 512, (n,)).tolist() for n in (7, 3, 11)]
    batch = Batch.from_prompts(prompts, pad_id=0)
    continuation = torch.randint(5, 512, (3, 6))
    model.setup_cache(3, 32)
    assert model.blocks[0].attn.kv_cache.k.shape == (3, kv_heads, 32, model.config.head_dim)
    cached = [prefill(model, batch)]
    width = batch.tokens.shape[1]
    for i in range(continuation.shape[1]):
        cached.append(decode_one_token(model, batch, continuation[:, i], width + i))
    full = full_logits(model, Batch(torch.cat([batch.tokens, continuation], 1), batch.pad))
    for i, logits in enumerate(cached):
        # logits of size ~10 from a T=1 and a T=n forward differ in float32 rounding (up to 2e-5 seen)
        torch.testing.assert_close(logits, full[:, width - 1 + i], rtol=1e-4, atol=5e-5)


def test_padding_does_not_change_a_row(tiny_model):
    prompt = [11, 12, 13, 14]
    alone = full_logits(tiny_model, Batch.from_prompts([prompt], 0))[0, -1]
    padded = full_logits(tiny_model, Batch.from_prompts([prompt, list(range(20, 30))], 0))[0, -1]
    torch.testing.assert_close(alone, padded, rtol=1e-4, atol=1e-5)


def test_rolling_back_several_slots_equals_a_fresh_cache(tiny_model):
    """Rewriting slots from `start` (a rejected draft) equals a cache that never saw those tokens."""
    batch = Batch.from_prompts([[5, 6, 7, 8, 9], [10, 11]], pad_id=0)
    keep, rejected, accepted = torch.tensor([[21], [22]]), torch.randint(5, 512, (2, 4)), torch.tensor([[42], [43]])

    def feed(tokens, start):
        return [decode_one_token(tiny_model, batch, tokens[:, i], start + i) for i in range(tokens.shape[1])][-1]

    tiny_model.setup_cache(2, 32)
    prefill(tiny_model, batch)
    feed(keep, 5)
    feed(rejected, 6)  # four drafted tokens, then rolled back to slot 6
    after_rollback = feed(accepted, 6)
    tiny_model.setup_cache(2, 32)
    prefill(tiny_model, batch)
    feed(keep, 5)
    fresh = feed(accepted, 6)
    torch.testing.assert_close(after_rollback, fresh)


def test_compact_gathers_the_kept_slots_to_the_front_row_by_row():
    cache = KVCache(2, 2, 6, 3, torch.float32)
    cache.update(0, torch.randn(2, 2, 6, 3), torch.randn(2, 2, 6, 3))
    before_k, before_v = cache.k.clone(), cache.v.clone()
    keep = torch.tensor([[1, 3, 4], [0, 2, 5]])
    cache.compact(keep)
    for row in range(2):
        torch.testing.assert_close(cache.k[row, :, :3], before_k[row][:, keep[row]], rtol=0, atol=0)
        torch.testing.assert_close(cache.v[row, :, :3], before_v[row][:, keep[row]], rtol=0, atol=0)
