"""ReFusion: the model's parts, its training loss, and lossless parallel decoding."""

import json

import httpx
import pytest
import torch

from diffar.checkpoint import load_checkpoint
from diffar.data.batching import prompt_ids
from diffar.decoding.ar import Batch, generate, prefill
from diffar.decoding.refusion import DiffusionDrafter, DraftSchedule, plan_slots, refusion_generate
from diffar.decoding.sampling import SamplingConfig
from diffar.decoding.speculative import DecodeState, speculative_generate
from diffar.errors import DiffarError
from diffar.models.refusion import RefusionConfig, RefusionModel
from tests.conftest import TINY_TRAIN, assert_clean_error, run_cli, serving

VOCAB = 16  # random drafts are then right now and then, wrong mostly: both paths of verification run
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11], [12, 13, 14, 15, 1, 2, 3, 4, 5], [4, 14, 4, 14, 4], [7] * 15,
           [9, 3, 2, 1]]


def random_refusion(seed=0, vocab=VOCAB, **overrides) -> RefusionModel:
    """A `tiny` ReFusion model with large random weights (see conftest.random_model), gates open."""
    torch.manual_seed(seed)
    model = RefusionModel(RefusionConfig.from_preset("tiny", vocab, **overrides)).eval()
    torch.manual_seed(seed)  # the same AR stream whatever else the config adds
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "tok_emb" not in name:
                p.normal_(0, 0.3)
            if name.endswith("gate"):
                p.fill_(1.0)
    return model


@pytest.fixture(scope="module")
def model():
    return random_refusion(0)


def plain_ar(model, prompts, n, eos_id=None):
    return [generate(model.ar, [p], n, pad_id=0, eos_id=eos_id).tokens[0] for p in prompts]


# ---- lossless decoding --------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [1, 3, 6])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_equals_plain_ar(model, batch_size, k):
    plain = plain_ar(model, PROMPTS, 40)
    accepted = drafted = 0
    for i in range(0, len(PROMPTS), batch_size):
        result = refusion_generate(model, PROMPTS[i:i + batch_size], 40, k=k, eos_id=None)
        assert result.tokens == plain[i:i + batch_size]
        accepted, drafted = accepted + result.extra["accepted"], drafted + result.extra["drafted"]
    assert 0 < accepted < drafted  # drafts were kept and rejected: the comparison is not vacuous


def test_eos_inside_a_block_ends_each_row(model):
    plain = plain_ar(model, PROMPTS, 40)
    eos = plain[0][7]
    expected = plain_ar(model, PROMPTS, 40, eos_id=eos)
    assert expected[0] == plain[0][:plain[0].index(eos)]
    assert refusion_generate(model, PROMPTS, 40, eos_id=eos).tokens == expected


def test_dynamic_schedule_is_lossless_and_skips_short_prompts(model):
    plain = plain_ar(model, PROMPTS[:3], 30)
    dynamic = DraftSchedule(dynamic=True)
    result = refusion_generate(model, PROMPTS[:3], 30, eos_id=None, schedule=dynamic, prompt_words=[20, 20, 20])
    assert result.tokens == plain and result.extra["drafted"] > 0
    short = refusion_generate(model, PROMPTS[:3], 30, eos_id=None, schedule=dynamic, prompt_words=[3, 3, 3])
    assert short.tokens == plain and short.extra["drafted"] == 0 and short.passes["draft"] == 0
    lossless = refusion_generate(model, PROMPTS[:3], 30, eos_id=None, prompt_words=[3, 3, 3])
    assert lossless.tokens == plain and lossless.extra["drafted"] > 0  # the word rule is the dynamic schedule's


def test_draft_trees_are_lossless(model):
    """Trees of the diffusion stream's likeliest drafts, and its drafts with prompt lookup's copies grafted on:
    the AR text, with eos inside and rows of a batch."""
    plain = plain_ar(model, PROMPTS, 40)
    eos = plain[0][7]
    expected = plain_ar(model, PROMPTS, 40, eos_id=eos)
    for schedule in (DraftSchedule(tree=1), DraftSchedule(tree=8), DraftSchedule(tree=24), DraftSchedule(lookup=True),
                     DraftSchedule(tree=8, lookup=True)):
        tree = refusion_generate(model, PROMPTS, 40, eos_id=eos, schedule=schedule)
        assert tree.tokens == expected and tree.extra["drafted"] > 0
    for schedule in (dict(tree=8), dict(lookup=True)):
        with pytest.raises(DiffarError, match="cannot join a tree or prompt lookup"):
            DraftSchedule(plan_threshold=0.5, **schedule)


class Recording(DiffusionDrafter):
    def propose(self, *args):
        out = super().propose(*args)
        self.log.append([d.tokens for d in out])
        return out


class Recomputing(Recording):
    def _update_kv(self, state):
        self.kv_upto = 0  # forget every cached slot
        super()._update_kv(state)


def test_cached_fusion_keys_equal_recomputed_ones(model):
    """The drafter computes the fusion keys/values of each slot once; drafting from scratch each time gives
    the same drafts (through rejections, finished rows and compactions)."""
    eos = plain_ar(model, PROMPTS[:1], 9)[0][-1]
    logs = []
    for drafter in (Recording(model), Recomputing(model)):
        drafter.log = []
        speculative_generate(model.ar, drafter, PROMPTS, 70, k=4, eos_id=eos)
        logs.append(drafter.log)
    assert logs[0] == logs[1] and len(logs[0]) > 5


def test_plan_and_infill(model):
    """Nothing confident enough: plain verification. Everything planned: whole blocks kept unverified."""
    plain = plain_ar(model, PROMPTS, 30)
    never = refusion_generate(model, PROMPTS, 30, k=4, eos_id=None, schedule=DraftSchedule(plan_threshold=1.0))
    assert never.tokens == plain
    always = refusion_generate(model, PROMPTS, 30, k=4, eos_id=None, schedule=DraftSchedule(plan_threshold=1e-9),
                               adaptive=False)
    assert always.extra["accepted"] == always.extra["drafted"] and always.passes["target"] == 1 + -(-29 // 5)
    assert always.tokens != plain and all(len(t) == 30 for t in always.tokens)
    slots = refusion_generate(model, PROMPTS, 30, k=4, eos_id=None, adaptive=False,
                              schedule=DraftSchedule(plan_threshold=1e-9, plan_slot=3))
    assert slots.tokens == always.tokens  # every slot planned, whatever its size
    with pytest.raises(DiffarError, match="plan-and-infill threshold"):
        DraftSchedule(plan_threshold=0.0)
    with pytest.raises(DiffarError, match="plan-and-infill slot"):
        DraftSchedule(plan_threshold=0.5, plan_slot=0)


def test_plan_slots():
    """A slot is kept whole only when every token in it is confident; the last slot may be shorter."""
    confidence = torch.tensor([0.95, 0.99, 0.5, 0.97, 0.91, 0.92, 0.93])
    assert plan_slots(confidence, 0.9, 1) == [True, True, False, True, True, True, True]
    assert plan_slots(confidence, 0.9, 2) == [True, True, False, False, True, True, True]
    assert plan_slots(confidence, 0.9, 3) == [False, False, False, True, True, True, True]
    assert plan_slots(confidence, 0.9, 4) == [False] * 4 + [True] * 3
    assert plan_slots(confidence, 0.96, 8) == [False] * 7


def test_schedule_phases():
    s = DraftSchedule(dynamic=True, full_steps=5, mid_steps=3)
    assert s.steps_for(0.1, 0.9) == 5
    assert s.steps_for(0.5, 1.0) == 1 and s.steps_for(0.5, 0.0) == 3
    assert s.steps_for(0.8, 0.0) == 0
    assert DraftSchedule(steps=2).steps_for(0.9, 0.0) == 2


def test_rolled_back_cache_equals_a_fresh_prefill(model, monkeypatch):
    """After a batched run with rejected drafts, each row's valid slots hold exactly what a fresh prefill of
    its text computes (compaction is covered in test_speculative.py)."""
    states = []
    feed = DecodeState.feed
    monkeypatch.setattr(DecodeState, "feed", lambda self, *a: (states.append(self), feed(self, *a))[1])
    result = refusion_generate(model, PROMPTS[:4], 60, eos_id=None)
    assert 0 < result.extra["accepted"] < result.extra["drafted"]
    state = states[-1]
    rows = []
    for row, seq in enumerate(state.seqs):
        slots = state.valid[row].nonzero().squeeze(1)
        assert len(slots) == len(seq) - 1  # everything but the last token, which is never fed
        rows.append([(b.attn.kv_cache.k[row, :, slots].clone(), b.attn.kv_cache.v[row, :, slots].clone())
                     for b in model.ar.blocks])
    for seq, cached in zip(state.seqs, rows):
        model.ar.setup_cache(1, len(seq) - 1)
        with torch.inference_mode():
            prefill(model.ar, Batch.from_prompts([seq[:-1]], 0))
        n = len(seq) - 1  # the slots the prefill wrote (a cache kept from an earlier call may hold more)
        for (k, v), block in zip(cached, model.ar.blocks):
            torch.testing.assert_close(k, block.attn.kv_cache.k[0, :, :n], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, block.attn.kv_cache.v[0, :, :n], rtol=1e-4, atol=1e-4)


def test_sampling_follows_the_ar_distribution():
    """End to end on a 6-token vocabulary: the first two sampled tokens follow the AR stream's joint law,
    whatever the (random) diffusion stream drafts."""
    model = random_refusion(3, vocab=6)
    prompt, cfg = [1, 2, 3], SamplingConfig(temperature=1.0)
    with torch.inference_mode():
        p1 = torch.softmax(model.ar(torch.tensor([prompt]))[0][0, -1], -1)
        joint = torch.stack([p1[a] * torch.softmax(model.ar(torch.tensor([prompt + [a]]))[0][0, -1], -1)
                             for a in range(6)])
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(6, 6)
    n, accepted = 2000, 0
    for _ in range(n):
        # the first token comes from the prefill; the second is a draft kept or the residual's draw
        result = refusion_generate(model, [prompt], 3, k=2, eos_id=None, sampling=cfg, generator=g)
        a, b = result.tokens[0][:2]
        counts[a, b] += 1
        accepted += result.extra["accepted"]
    assert accepted > 0
    assert (counts / n - joint).abs().sum() / 2 < 0.07  # 36 cells, 2000 draws: TV noise ~0.04


# ---- the model ----------------------------------------------------------------------------------------
def test_ar_side_fusion_changes_the_ar_stream_only_when_enabled():
    plain, fused = random_refusion(0), random_refusion(0, ar_fusion_layers=(1,))
    tokens = torch.tensor([PROMPTS[2]])
    states = torch.randn(1, 5, 64)
    mask = torch.ones(1, 1, tokens.shape[1], 5, dtype=torch.bool)
    with torch.no_grad():
        reference = plain.ar.hidden_states(tokens)
        torch.testing.assert_close(plain.ar_hidden(tokens, states, mask), reference)  # no AR-side layers
        torch.testing.assert_close(fused.ar_hidden(tokens), reference)  # nothing to read
        assert not torch.allclose(fused.ar_hidden(tokens, states, mask), reference)
        fused.ar_fusion["1"].gate.zero_()
        torch.testing.assert_close(fused.ar_hidden(tokens, states, mask), reference)  # a closed gate: identity


def test_diffusion_side_fusion_reads_the_ar_stream_only_when_enabled():
    def draft(model, context):
        z, t = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0)), torch.ones(2, 5)
        tokens = torch.randint(0, VOCAB, (2, 7, 2), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            return model.diffuser(z, t, context, torch.ones(2, 7, dtype=torch.bool), tokens)

    a, b = torch.randn(2, 7, 64), torch.randn(2, 7, 64)
    fused, unfused = random_refusion(0), random_refusion(0, diffusion_fusion_layers=())
    assert not torch.allclose(draft(fused, a), draft(fused, b))
    unfused.diffuser.warm.weight.data.zero_()  # the warm start reads the AR stream too
    torch.testing.assert_close(draft(unfused, a), draft(unfused, b))


def test_lossless_decoding_refuses_ar_side_fusion():
    with pytest.raises(DiffarError, match="ar_fusion_layers"):
        DiffusionDrafter(random_refusion(0, ar_fusion_layers=(0,)))


@pytest.mark.parametrize("stage", ["joint", "diffusion"])
def test_loss_weights_are_applied_as_configured(stage):
    weights = dict(ar_weight=0.7, mse_weight=1.3, kl_weight=0.25)
    model = random_refusion(0, stage=stage, freeze_ar=False, **weights).train()
    tokens = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(0))
    targets = torch.cat([torch.full((3, 6), -100), tokens[:, 7:], torch.full((3, 1), -100)], dim=1)
    torch.manual_seed(0)
    _, loss = model(tokens, targets)
    parts = model.loss_parts
    expected = weights["mse_weight"] * parts["mse"] + weights["kl_weight"] * parts["kl"]
    if stage == "joint":
        expected += weights["ar_weight"] * parts["ce_ar"]
    else:
        assert "ce_ar" not in parts  # stage 1: the diffusion stream alone
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert model.diffuser.out.weight.grad is not None
    assert (model.ar.blocks[0].attn.qkv.weight.grad is None) == (stage == "diffusion")


def test_frozen_ar_stream_gets_no_gradient():
    model = random_refusion(0).train()
    tokens = torch.randint(0, VOCAB, (2, 12))
    _, loss = model(tokens, tokens)
    loss.backward()
    assert all(p.grad is None for p in model.ar.parameters())
    assert model.diffuser.fusion["0"].q.weight.grad is not None


@pytest.mark.parametrize("bad, message", [
    (dict(block=0), "block size must be positive"),
    (dict(schedule="square"), "unknown noise schedule"),
    (dict(stage="both"), "unknown stage"),
    (dict(ar_fusion_layers=(9,)), "AR fusion layers"),
    (dict(kl_weight=-1.0), "kl_weight must be a number >= 0"),
])
def test_bad_config(bad, message):
    with pytest.raises(DiffarError, match=message):
        RefusionConfig.from_preset("tiny", VOCAB, **bad)


# ---- the command line ---------------------------------------------------------------------------------
def test_cli_generate_and_bench(tiny_refusion, tmp_path):
    prompt = ("--prompt", "And God said, Let there be light: and there was light.", "--max-new-tokens", "16")
    ar = run_cli("generate", "--checkpoint", tiny_refusion, "--method", "ar", *prompt)
    refusion = run_cli("generate", "--checkpoint", tiny_refusion, *prompt)
    dynamic = run_cli("generate", "--checkpoint", tiny_refusion, "--dynamic", "--steps", "2", *prompt)
    infill = run_cli("generate", "--checkpoint", tiny_refusion, "--plan-infill", "0.5", "--plan-slot", "2", *prompt)
    for proc in (ar, refusion, dynamic):
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == ar.stdout  # lossless
    assert infill.returncode == 0 and "[refusion-infill]" in infill.stderr
    assert_clean_error(run_cli("generate", "--checkpoint", tiny_refusion, "--plan-slot", "2", *prompt),
                       "pass --plan-infill THRESHOLD too")
    assert "[refusion]" in refusion.stderr and "diffusion passes" in refusion.stderr
    assert "0/0 drafts accepted" not in refusion.stderr  # an 11-word prompt is still drafted for
    assert "tokens/AR pass" in refusion.stderr and "drafts accepted" in refusion.stderr
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "refusion", "--checkpoint", tiny_refusion, "--draft", tiny_refusion, "--prompts", "4",
                   "--batch-sizes", "1", "2", "--methods", "ar", "ar+prompt-lookup", "refusion", "refusion-dynamic",
                   "refusion-infill", "--plan-slot", "2", "--split", "valid", "--out", out)
    assert proc.returncode == 0, proc.stderr
    import json

    records = json.loads(out.read_text())
    lossless = ("ar", "ar+prompt-lookup", "refusion", "refusion-dynamic")
    assert {(r["method"], r["batch_size"]) for r in records} == {
        (m, b) for m in lossless + ("refusion-infill",) for b in (1, 2)}
    for r in records:
        assert r["extra"]["tokens_per_ar_pass"] > 0 and {"bleu4", "rougeL"} <= set(r["extra"])
        assert r["extra"]["split"] == "valid"
        assert r["extra"]["exact_match_vs_ar"] == 1.0 or r["method"] not in lossless
        assert r["extra"]["plan_slot"] == (2 if r["method"] == "refusion-infill" else None)


def test_serve_refusion(tiny_refusion, tiny_run):
    """A ReFusion checkpoint is served as method refusion: greedy text is its AR stream's (with pins too), a
    seeded sampled request equals `refusion_generate` with that seed, and a stream carries the same text."""
    model, tokenizer, meta = load_checkpoint(tiny_refusion)
    prompt = "And God said, Let there be light: and there was light."
    ids = prompt_ids(tokenizer, meta["task"], prompt)
    with serving(tiny_refusion) as url:
        assert httpx.get(url + "/v1/models").json()["data"][0]["methods"] == ["refusion"]
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
        out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        plain = generate(model.ar, [ids], 16, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id).tokens[0]
        assert out["diffar"]["method"] == "refusion" and out["diffar"]["token_ids"] == plain
        passes = out["diffar"]["passes"]
        assert passes["target"] > 0 and passes["draft"] > 0 and passes["batch_size"] == 1
        pinned = httpx.post(url + "/v1/completions", json={**body, "fixed_tokens": {"2": 7, "3": 8}}, timeout=60)
        expected = generate(model.ar, [ids], 16, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                            fixed=[{2: 7, 3: 8}]).tokens[0]
        assert pinned.json()["diffar"]["token_ids"] == expected != plain
        sampled = {"prompt": prompt, "max_tokens": 16, "temperature": 1.0, "top_k": 20, "seed": 3}
        seeded = httpx.post(url + "/v1/completions", json=sampled, timeout=60).json()
        with torch.inference_mode():
            again = refusion_generate(model, [ids], 16, eos_id=tokenizer.eos_id, sampling=SamplingConfig(1.0, 20),
                                      generator=torch.Generator().manual_seed(3))
        assert seeded["diffar"]["token_ids"] == again.tokens[0]
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == out["choices"][0]["text"]
        r = httpx.post(url + "/v1/completions", json={**body, "method": "dd2"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "method"
    assert_clean_error(run_cli("serve", "--checkpoint", tiny_refusion, "--method", "dd2"),
                       "a refusion checkpoint")
    assert_clean_error(run_cli("serve", "--checkpoint", tiny_run, "--method", "refusion"),
                       "cannot decode")


def test_cli_two_stages(tiny_run, tokenizer_path, tmp_path):
    """Stage 1 trains the diffusion stream alone; stage 2 starts from it with the AR stream and fusion."""
    common = ("--corpus", "kjv2web", "--max-steps", "4", "--block-size", "128", *TINY_TRAIN)
    stage1 = run_cli("train", "refusion", "--stage", "diffusion", "--tokenizer", tokenizer_path, *common,
                     "--out", tmp_path / "s1")
    assert stage1.returncode == 0, stage1.stderr
    stage2 = run_cli("train", "refusion", "--ar", tiny_run, "--init", tmp_path / "s1", *common,
                     "--out", tmp_path / "s2")
    assert stage2.returncode == 0, stage2.stderr
    longer = [a if a != "4" else "6" for a in common]  # resuming: its config (fusion layers) holds tuples
    resumed = run_cli("train", "refusion", "--ar", tiny_run, "--init", tmp_path / "s1", *longer,
                      "--out", tmp_path / "s2")
    assert resumed.returncode == 0 and "resuming at step 4" in resumed.stdout, resumed.stderr
    first, _, meta1 = load_checkpoint(tmp_path / "s1")
    second, _, meta2 = load_checkpoint(tmp_path / "s2")
    assert (meta1["model"]["stage"], meta2["model"]["stage"]) == ("diffusion", "joint")
    ar, _, _ = load_checkpoint(tiny_run)
    for a, b in zip(second.ar.parameters(), ar.parameters()):
        assert torch.equal(a, b)  # the AR stream is the given one, frozen


def test_cli_bad_input(tiny_refusion, tiny_run, tmp_path):
    args = ("generate", "--checkpoint", tiny_refusion, "--prompt", "x")
    assert_clean_error(run_cli(*args, "--k", "0"), "--k: must be in 1..64")
    assert_clean_error(run_cli(*args, "--k", "60"), "exceeds the")
    assert_clean_error(run_cli(*args, "--steps", "0"), "--steps: must be in 1..1000")
    assert_clean_error(run_cli("generate", "--checkpoint", tiny_run, "--prompt", "x", "--method", "refusion"),
                       "cannot decode")
    # an AR stream and a diffusion stream that do not belong together: another tokenizer
    assert_clean_error(run_cli("train", "refusion", "--corpus", "kjv2web", "--ar", "checkpoints/ar-kjv2web",
                               "--init", tiny_refusion, "--preset", "tiny", "--out", tmp_path / "x"),
                       "do not belong together")
    assert_clean_error(run_cli("train", "refusion", "--corpus", "kjv2web", "--preset", "tiny", "--out",
                               tmp_path / "y"), "pass --ar")
