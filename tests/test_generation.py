import pytest
import torch

from conftest import random_model
from diffar.decoding.ar import generate, log_likelihoods
from diffar.decoding.sampling import SamplingConfig, probabilities
from diffar.errors import DiffarError

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [40]]


def test_batched_with_padding_equals_one_by_one(tiny_model):
    batched = generate(tiny_model, PROMPTS, 24, pad_id=0, eos_id=None)
    for row, prompt in enumerate(PROMPTS):
        alone = generate(tiny_model, [prompt], 24, pad_id=0, eos_id=None)
        assert batched.tokens[row] == alone.tokens[0]


def test_cached_equals_uncached_generation(tiny_model):
    cached = generate(tiny_model, PROMPTS, 16, pad_id=0, eos_id=None)
    uncached = generate(tiny_model, PROMPTS, 16, pad_id=0, eos_id=None, use_cache=False)
    assert cached.tokens == uncached.tokens
    assert cached.forward_passes == uncached.forward_passes == 16


def test_rows_stop_independently_at_eos(tiny_model):
    free = generate(tiny_model, PROMPTS, 12, pad_id=0, eos_id=None)
    eos = free.tokens[1][-1]  # pretend row 1's last token is eos
    stopped = generate(tiny_model, PROMPTS, 12, pad_id=0, eos_id=eos)
    for row, expected in enumerate(free.tokens):
        cut = expected.index(eos) if eos in expected else len(expected)
        assert stopped.tokens[row] == expected[:cut]
    assert len(stopped.tokens[1]) < 12


def test_streaming_callback_sees_every_token_in_order(tiny_model):
    seen = {0: [], 1: []}
    result = generate(tiny_model, PROMPTS[:2], 10, pad_id=0, eos_id=None, on_token=lambda r, t, _: seen[r].append(t))
    assert [seen[0], seen[1]] == result.tokens


def test_callback_can_stop_one_row(tiny_model):
    free = generate(tiny_model, PROMPTS, 10, pad_id=0, eos_id=None)
    stopped = generate(tiny_model, PROMPTS, 10, pad_id=0, eos_id=None, on_token=lambda r, t, _: r != 2)
    assert stopped.tokens[2] == free.tokens[2][:1]
    assert [t for r, t in enumerate(stopped.tokens) if r != 2] == [t for r, t in enumerate(free.tokens) if r != 2]


def test_fixed_tokens_are_kept_and_decoding_follows_them(tiny_model):
    free = generate(tiny_model, PROMPTS[:2], 10, pad_id=0, eos_id=None)
    pinned = generate(tiny_model, PROMPTS[:2], 10, pad_id=0, eos_id=None, fixed=[{3: 77, 4: 78}, {}])
    assert pinned.tokens[0][:3] == free.tokens[0][:3] and pinned.tokens[0][3:5] == [77, 78]
    assert pinned.tokens[1] == free.tokens[1]
    # what follows the pins is what the model says after them
    continued = generate(tiny_model, [PROMPTS[0] + pinned.tokens[0][:5]], 5, pad_id=0, eos_id=None)
    assert pinned.tokens[0][5:] == continued.tokens[0]


def test_plain_ar_writes_every_token_but_the_pins(tiny_model):
    streamed = [[], []]
    result = generate(tiny_model, PROMPTS[:2], 10, pad_id=0, eos_id=None, fixed=[{3: 77, 4: 78}, {}],
                      on_token=lambda r, t, origin: streamed[r].append(origin))
    assert result.origins == streamed == [["ar"] * 3 + ["pinned"] * 2 + ["ar"] * 5, ["ar"] * 10]


def test_sampling_is_seeded(tiny_model):
    cfg = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9)
    def run(seed):
        return generate(tiny_model, PROMPTS, 10, pad_id=0, eos_id=None, sampling=cfg,
                        generator=torch.Generator().manual_seed(seed))

    a, b, c = run(3), run(3), run(4)
    assert a.tokens == b.tokens != c.tokens


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at the standard normal quantile z (3.09: p = 0.999), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_noise_determines_the_sample_and_follows_the_ar_law():
    """Coupled sampling (DD1's noise -> text map): the first two tokens that standard-normal noise determines
    follow the AR model's joint law at temperature 0.7 with top-p 0.95 (chi-square over the 36 pairs of a
    6-token vocabulary, 6,000 rows in one batch); the same noise gives the same text, other noise other text."""
    model, prompt, cfg = random_model(0, vocab=6), [1, 2, 3], SamplingConfig(temperature=0.7, top_p=0.95)
    with torch.inference_mode():
        p1 = probabilities(model(torch.tensor([prompt]))[0][:, -1], cfg)[0]
        joint = torch.stack([p1[a] * probabilities(model(torch.tensor([prompt + [a]]))[0][:, -1], cfg)[0]
                             for a in range(6)]).flatten().double()
    n = 6000
    noise = torch.randn(n, 2, generator=torch.Generator().manual_seed(0))
    out = generate(model, [prompt] * n, 2, pad_id=0, eos_id=None, sampling=cfg, noise=noise).tokens
    counts = torch.bincount(torch.tensor([6 * a + b for a, b in out]), minlength=36).double()
    kept = joint > 0  # top-p may rule pairs out: the coupling must never pick them
    assert counts[~kept].sum() == 0
    expected = joint[kept] * n
    statistic = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert statistic < chi_square_critical(int(kept.sum()) - 1), statistic
    again = generate(model, [prompt] * 50, 2, pad_id=0, eos_id=None, sampling=cfg, noise=noise[:50]).tokens
    assert again == out[:50]
    other = generate(model, [prompt] * 50, 2, pad_id=0, eos_id=None, sampling=cfg, noise=noise[50:100]).tokens
    assert other == out[50:100] and other != again
    with pytest.raises(DiffarError, match="noise must be"):
        generate(model, [prompt], 3, pad_id=0, eos_id=None, sampling=cfg, noise=noise[:1])


def test_top_k_and_top_p_filter_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    assert (probabilities(logits, SamplingConfig(1.0, top_k=2)) > 0).sum() == 2
    p = probabilities(logits, SamplingConfig(1.0, top_p=0.7))  # 0.5 + 0.25 covers 0.7
    torch.testing.assert_close(p, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    p = probabilities(logits, SamplingConfig(1.0, top_p=0.01))  # the top token always survives
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("temperature, top_p", [(1e-300, 1.0), (5e-324, 1.0), (1.0, 1e-300), (9.4e-288, 5e-324),
                                                 (1e300, 1.0)])
def test_sampling_is_safe_at_the_extremes(tiny_model, temperature, top_p):
    """Every value SamplingConfig admits gives a distribution: a vanishing temperature or top-p samples the
    argmax (what greedy picks), a huge temperature the uniform law; no nan, inf or crash."""
    logits = torch.tensor([[3.0, 1.0, -2.0, 0.5], [0.0, 0.0, 0.0, 80.0]])
    p = probabilities(logits, SamplingConfig(temperature, top_p=top_p))
    assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(2))
    if temperature < 1e-6 or top_p < 1e-6:
        assert p.argmax(-1).tolist() == [0, 3] and (p.max(-1).values == 1).all()
    cfg = SamplingConfig(temperature, top_p=top_p)
    out = generate(tiny_model, PROMPTS, 6, pad_id=0, eos_id=None, sampling=cfg, generator=torch.Generator().manual_seed(0))
    if temperature < 1e-6 or top_p < 1e-6:
        assert out.tokens == generate(tiny_model, PROMPTS, 6, pad_id=0, eos_id=None).tokens


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"),
])
def test_bad_sampling_settings(kwargs, message):
    with pytest.raises(DiffarError, match=message):
        SamplingConfig(**kwargs)


def test_bad_lengths(tiny_model):
    with pytest.raises(DiffarError, match="empty prompt"):
        generate(tiny_model, [[]], 4, pad_id=0, eos_id=None)
    with pytest.raises(DiffarError, match="max_new_tokens"):
        generate(tiny_model, [[5]], 0, pad_id=0, eos_id=None)
    with pytest.raises(DiffarError, match="context"):
        generate(tiny_model, [[5] * 300], 100, pad_id=0, eos_id=None)


def test_log_likelihoods_batched_equal_one_row_forward(tiny_model):
    """Scoring rows of different lengths together (right padding) gives each row's own sum of
    log p(output token | everything before it)."""
    outputs = [[21, 22, 23], [24], [25, 26, 27, 28, 29, 30], [31, 32]]
    batched = log_likelihoods(tiny_model, PROMPTS, outputs)
    for row, (prompt, out) in enumerate(zip(PROMPTS, outputs)):
        seq = torch.tensor([prompt + out])
        with torch.no_grad():
            logp = torch.log_softmax(tiny_model(seq)[0][0].float(), -1)
        expected = sum(float(logp[len(prompt) + j - 1, tok]) for j, tok in enumerate(out))
        assert batched[row].item() == pytest.approx(expected, abs=1e-4)
    context = tiny_model.config.max_seq_len  # the last token is scored, never read: context + 1 tokens fit
    assert log_likelihoods(tiny_model, [[5] * context], [[6]]).shape == (1,)
    with pytest.raises(DiffarError, match="context"):
        log_likelihoods(tiny_model, [[5] * context], [[6, 7]])
    with pytest.raises(DiffarError, match="2 prompts but 1 outputs"):
        log_likelihoods(tiny_model, [[5], [6]], [[7]])
