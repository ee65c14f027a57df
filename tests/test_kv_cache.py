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
