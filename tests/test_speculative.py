"""Draft-and-verify decoding is lossless: greedy output equals plain AR greedy, sampled output follows the
target's distribution, and the rolled-back cache equals a fresh one."""

import copy

import pytest
import torch

from diffar.decoding.ar import Batch, generate, prefill
from diffar.decoding.sampling import SamplingConfig, probabilities
from diffar.decoding.speculative import DecodeState, Draft, DraftModel, PromptLookup, accept, speculative_generate
from diffar.errors import DiffarError
from tests.conftest import random_model

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [40, 41, 40, 41, 40]]


@pytest.fixture(scope="module")
def target():
    return random_model(0)


@pytest.fixture(scope="module")
def drafter(target):
    """The target with noise on its weights: right often, wrong often enough."""
    model = copy.deepcopy(target)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("proposer", ["draft", "lookup"])
def test_greedy_equals_plain_ar(target, drafter, k, proposer):
    for prompt in PROMPTS:
        plain = generate(target, [prompt], 24, pad_id=0, eos_id=None).tokens[0]
        source = DraftModel(drafter) if proposer == "draft" else PromptLookup()
        spec = speculative_generate(target, source, [prompt], 24, k=k, eos_id=None)
        assert spec.tokens[0] == plain
        assert spec.passes["target"] <= 24


class NoisyOracle:
    """Drafts each row's true greedy continuation with random tokens mixed in: rows accept different numbers
    of drafts, as with a real drafter."""

    needs_hidden, taps, tree, passes = False, (), 0, 0

    def __init__(self, prompts, references, error_rate=0.3):
        self.prompt_len, self.references = [len(p) for p in prompts], references
        self.error_rate, self.g = error_rate, torch.Generator().manual_seed(0)

    def start(self, batch_size, max_len):
        pass

    def propose(self, state, k, sampling, generator):
        out = []
        for row, seq in enumerate(state.seqs):
            done = len(seq) - self.prompt_len[row]
            drafts = list(self.references[row][done:done + k])
            for i in range(len(drafts)):
                if float(torch.rand((), generator=self.g)) < self.error_rate:
                    drafts[i] = int(torch.randint(512, (), generator=self.g))
            out.append(Draft(drafts))
        return out


@pytest.mark.parametrize("adaptive", [False, True])
def test_batched_verification_equals_plain_ar_row_by_row(target, adaptive, monkeypatch):
    """Rows accept different numbers of drafts; each still gets exactly its own greedy continuation,
    including across cache compactions (a long run in a cache with little room to spare)."""
    compactions = []
    compact = DecodeState.compact
    monkeypatch.setattr(DecodeState, "compact", lambda self, t: (compactions.append(1), compact(self, t)))
    prompts = PROMPTS + [PROMPTS[0][::-1], [3] * 12]
    plain = [generate(target, [p], 60, pad_id=0, eos_id=None).tokens[0] for p in prompts]
    for proposer in (NoisyOracle(prompts, plain), PromptLookup()):
        spec = speculative_generate(target, proposer, prompts, 60, k=5, eos_id=None, adaptive=adaptive)
        assert spec.tokens == plain
    assert compactions


def test_batched_draft_model(target, drafter, monkeypatch):
    """The draft model keeps a cache for every row: at batch 6 the output is each row's greedy AR text, even
    across rollbacks and compactions of the draft cache, and the target drafting for itself is always right
    (its cache holds exactly each row's text)."""
    compactions = []
    compact = DecodeState.compact
    monkeypatch.setattr(DecodeState, "compact", lambda self, t: (compactions.append(t), compact(self, t)))
    prompts = PROMPTS + [PROMPTS[0][::-1], [3] * 12]
    plain = [generate(target, [p], 60, pad_id=0, eos_id=None).tokens[0] for p in prompts]
    noisy = speculative_generate(target, DraftModel(drafter), prompts, 60, k=8, eos_id=None)
    assert noisy.tokens == plain and 0 < noisy.extra["accepted"] < noisy.extra["drafted"]
    assert drafter in compactions
    perfect = speculative_generate(target, DraftModel(copy.deepcopy(target)), prompts, 60, k=5, eos_id=None)
    assert perfect.tokens == plain and perfect.extra["accepted"] == perfect.extra["drafted"]


def test_a_perfect_drafter_needs_few_target_passes(target):
    spec = speculative_generate(target, DraftModel(copy.deepcopy(target)), [PROMPTS[0]], 24, k=8, eos_id=None)
    assert spec.extra["accepted"] == spec.extra["drafted"]  # the target drafting for itself is always right
    assert spec.passes["target"] <= 1 + -(-24 // 9)


def test_origins_say_which_tokens_were_drafts(target, drafter):
    """Every token is an accepted draft or the target's own (one per verification, the first token's prefill
    included), as the callback said while streaming; the drafts are exactly the accepted-draft count."""
    perfect = speculative_generate(target, DraftModel(copy.deepcopy(target)), [PROMPTS[0]], 24, k=8, eos_id=None)
    (origins,) = perfect.origins
    assert len(origins) == 24 and origins.count("ar") == perfect.passes["target"]
    assert origins.count("draft") == perfect.extra["accepted"] > 2 * origins.count("ar")  # mostly drafts
    streamed = [[] for _ in PROMPTS]
    noisy = speculative_generate(target, DraftModel(drafter), PROMPTS, 30, k=6, eos_id=None,
                                 on_token=lambda row, token, origin: streamed[row].append(origin))
    assert noisy.origins == streamed and list(map(len, noisy.origins)) == list(map(len, noisy.tokens))
    assert sum(o.count("draft") for o in noisy.origins) == noisy.extra["accepted"] > 0
    assert all(o[0] == "ar" and set(o) <= {"ar", "draft"} for o in noisy.origins)
    pins = [{0: 77}, {4: 78, 5: 79}, {}, {9: 80}]
    pinned = speculative_generate(target, DraftModel(drafter), PROMPTS, 30, k=6, eos_id=None, fixed=pins)
    assert [[i for i, o in enumerate(row) if o == "pinned"] for row in pinned.origins] == [sorted(p) for p in pins]


def test_eos_inside_a_block_ends_generation(target):
    plain = generate(target, [PROMPTS[2]], 24, pad_id=0, eos_id=None).tokens[0]
    eos = plain[5]
    expected = plain[: plain.index(eos)]
    spec = speculative_generate(target, DraftModel(copy.deepcopy(target)), [PROMPTS[2]], 24, k=8, eos_id=eos)
    assert spec.tokens[0] == expected == generate(target, [PROMPTS[2]], 24, pad_id=0, eos_id=eos).tokens[0]


def test_pinned_tokens_equal_plain_ar_with_the_same_pins(target):
    """Pins at the first position, inside a block (where drafts were accepted past them) and at a block's
    bonus token: each row's output is plain AR's with the same pins, and eos cannot end a row before its
    last pin."""
    prompts = PROMPTS + [[3] * 12]
    free = [generate(target, [p], 30, pad_id=0, eos_id=None).tokens[0] for p in prompts]
    pins = [{0: 77}, {4: 78, 5: 79, 17: 80}, {3: free[2][3]}, {9: free[3][9] + 1, 25: 81}, {2: 5, 28: 6}]
    eos = free[1][6]  # a token row 1 would say before its last pin
    for eos_id in (None, eos):
        plain = generate(target, prompts, 30, pad_id=0, eos_id=eos_id, fixed=pins).tokens
        assert plain[0][0] == 77 and plain[1][4:6] == [78, 79] and len(plain[1]) > 17
        oracle = NoisyOracle(prompts, plain, error_rate=0.1)  # drafts right through the pins
        assert speculative_generate(target, oracle, prompts, 30, k=6, eos_id=eos_id, fixed=pins).tokens == plain
        assert speculative_generate(target, PromptLookup(), prompts, 30, k=6, eos_id=eos_id, fixed=pins).tokens == plain


def test_callback_can_stop_one_row(target):
    free = speculative_generate(target, PromptLookup(), PROMPTS, 20, k=4, eos_id=None).tokens
    stopped = speculative_generate(target, PromptLookup(), PROMPTS, 20, k=4, eos_id=None,
                                   on_token=lambda row, token, _: row != 1).tokens
    assert stopped[1] == free[1][:1] and [t for r, t in enumerate(stopped) if r != 1] == free[:1] + free[2:]


def test_cache_after_rollbacks_equals_a_fresh_prefill(target, drafter):
    prompt = PROMPTS[0]
    spec = speculative_generate(target, DraftModel(drafter), [prompt], 20, k=4, eos_id=None)
    assert spec.extra["accepted"] < spec.extra["drafted"]  # some drafts were rejected and rolled back
    n = len(prompt) + len(spec.tokens[0]) - 1  # the last token is never fed
    cached = [(b.attn.kv_cache.k[:, :, :n].clone(), b.attn.kv_cache.v[:, :, :n].clone()) for b in target.blocks]
    full = prompt + spec.tokens[0][:-1]
    target.setup_cache(1, len(full))
    with torch.inference_mode():
        prefill(target, Batch.from_prompts([full], 0))
    for (k, v), block in zip(cached, target.blocks):
        torch.testing.assert_close(k, block.attn.kv_cache.k[:, :, :n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, block.attn.kv_cache.v[:, :, :n], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("one_hot", [False, True])
def test_acceptance_rule_preserves_the_target_distribution(one_hot):
    """The first token out of `accept` is distributed as p[0], whatever the drafts' q."""
    g = torch.Generator().manual_seed(0)
    vocab, k, n = 5, 2, 20000
    logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    q = [torch.softmax(torch.randn(vocab, generator=g), -1) for _ in range(k)]
    cfg = SamplingConfig(temperature=1.0)
    p0 = probabilities(logits, cfg)[0]
    counts = torch.zeros(vocab)
    for _ in range(n):
        if one_hot:
            drafts, dists = [int(torch.randint(vocab, (), generator=g)) for _ in range(k)], [None] * k
        else:
            drafts, dists = [int(torch.multinomial(qi, 1, generator=g)) for qi in q], q
        n_ok, own = accept(logits, drafts, dists, cfg, g)
        counts[drafts[0] if n_ok >= 1 else own] += 1
    freq = counts / n
    assert (freq - p0).abs().sum() / 2 < 0.02, (freq, p0)  # total variation; sd of the estimate ~0.004


def test_sampled_generation_matches_ar_distribution():
    assert_follows_the_ar_law(DraftModel)


def assert_follows_the_ar_law(proposer):
    """End to end on a 6-token vocabulary: the first two tokens sampled with `proposer(a 1-layer drafter)` follow
    the AR model's joint law."""
    target, drafter = random_model(0, vocab=6), random_model(2, vocab=6, n_layer=1)
    prompt, cfg = [1, 2, 3], SamplingConfig(temperature=1.0)
    with torch.inference_mode():
        p1 = torch.softmax(target(torch.tensor([prompt]))[0][0, -1], -1)
        joint = torch.stack([p1[a] * torch.softmax(target(torch.tensor([prompt + [a]]))[0][0, -1], -1)
                             for a in range(6)])
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(6, 6)
    n = 3000
    for _ in range(n):
        a, b = speculative_generate(target, proposer(drafter), [prompt], 2, k=2, eos_id=None, sampling=cfg,
                                    generator=g).tokens[0]
        counts[a, b] += 1
    assert (counts / n - joint).abs().sum() / 2 < 0.06  # 36 cells, 3000 draws: TV noise ~0.03


def test_bad_draft_length(target):
    with pytest.raises(DiffarError, match="k must be positive"):
        speculative_generate(target, PromptLookup(), [PROMPTS[0]], 4, k=0, eos_id=None)


def test_the_target_cannot_draft_for_itself_in_place(target):
    with pytest.raises(DiffarError, match="share one KV cache"):
        speculative_generate(target, DraftModel(target), [PROMPTS[0]], 4, k=2, eos_id=None)
