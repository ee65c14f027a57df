"""The block drafter (models/drafter.py, decoding/drafter.py): lossless whatever it drafts (greedy equals AR, chain
or tree, batched; sampled output follows the AR law), its decoding path computes what its training path computes,
it learns, and the CLI trains, saves (without its target's weights) and decodes with it."""

import json

import pytest
import torch

from diffar.checkpoint import load_checkpoint, resolve
from diffar.data.batching import IGNORE_INDEX
from diffar.data.corpora import load_corpus
from diffar.decoding.ar import generate
from diffar.decoding.drafter import BlockProposer
from diffar.decoding.refusion import DraftSchedule
from diffar.decoding.speculative import speculative_generate
from diffar.errors import DiffarError
from diffar.generation import Options, load_method
from diffar.models.drafter import BlockDrafter, DrafterConfig, on_chain, spread_layers
from diffar.models.precision import DTYPES, draft_dtype
from tests.conftest import TINY_TRAIN, assert_clean_error, random_model, run_cli
from tests.test_speculative import assert_follows_the_ar_law

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [40, 41, 40, 41, 40]]


def drafter_for(target, seed: int = 1, **overrides) -> BlockDrafter:
    torch.manual_seed(seed)
    drafter = BlockDrafter(DrafterConfig.from_preset("tiny", target=target.config, **overrides))
    drafter.attach(target)
    drafter.init_from_target()
    return drafter.eval()


@pytest.mark.parametrize("tree", [0, 6])
@pytest.mark.parametrize("draft_vocab", [0, 64])
def test_greedy_equals_ar(tree, draft_vocab):
    target = random_model(0)
    drafter = drafter_for(target, draft_vocab=draft_vocab, block=5)
    if draft_vocab:
        drafter.set_vocab(torch.rand(target.config.vocab_size))
    reference = generate(target, PROMPTS, 24, eos_id=None, pad_id=0).tokens
    out = speculative_generate(target, BlockProposer(drafter, tree), PROMPTS, 24, k=4, eos_id=None)
    assert out.tokens == reference
    assert out.passes["draft"] > 0 and out.extra["drafted"] > 0


@pytest.mark.parametrize("tree", [0, 6])
def test_a_placed_drafter_drafts_at_its_own_precision(tree):
    """Placed for inference beside an fp32 target, the drafter's own layers and its draft head run at
    `draft_dtype` (bf16 where that is fast), the target stays fp32, and the text is still the target's."""
    drafter = drafter_for(random_model(0), draft_vocab=64, block=5)
    drafter.set_vocab(torch.rand(512))
    drafter = drafter.placed("fp32")
    target, dtype = drafter.target, DTYPES[draft_dtype("fp32")]
    assert target.lm_head.weight.dtype == torch.float32
    assert drafter.norm.weight.dtype == drafter._draft_head().weight.dtype == dtype
    reference = generate(target, PROMPTS, 24, eos_id=None, pad_id=0).tokens
    out = speculative_generate(target, BlockProposer(drafter, tree), PROMPTS, 24, k=4, eos_id=None)
    assert out.tokens == reference and out.extra["drafted"] > 0


def test_a_drafter_that_knows_the_answer_is_accepted():
    """Drafts that match the target are kept: with the drafter's output layer rigged to the target's own next
    tokens, every draft of a chain is accepted, so passes fall to about budget / block."""
    target = random_model(0)
    reference = generate(target, [PROMPTS[0]], 24, eos_id=None, pad_id=0).tokens[0]
    drafter = drafter_for(target, block=5)
    text = PROMPTS[0] + reference

    def oracle(h):  # slot j of the block after position p holds text[p + j + 1]
        p = len(state_len) - 1
        logits = torch.full((*h.shape[:-1], target.config.vocab_size), -1e4)
        for j in range(h.shape[1]):
            if p + j + 1 < len(text):
                logits[:, j, text[p + j + 1]] = 0.0
        return logits
    proposer = BlockProposer(drafter)
    state_len: list = []
    original = proposer.propose

    def propose(state, k, sampling, generator):
        state_len[:] = state.seqs[0]
        return original(state, k, sampling, generator)
    proposer.propose, drafter.logits = propose, oracle
    out = speculative_generate(target, proposer, [PROMPTS[0]], 24, k=4, eos_id=None)
    assert out.tokens[0] == reference
    assert out.extra["accepted"] == out.extra["drafted"]
    assert out.passes["target"] <= 1 + 24 // 5 + 1


def test_sampling_follows_the_ar_law():
    assert_follows_the_ar_law(lambda _: BlockProposer(drafter_for(random_model(0, vocab=6), block=3)))


def test_decoding_reads_what_training_reads():
    """The proposer's first block (prefill, then the anchor pinned) equals the training pass's block at the same
    anchor: same context positions, features, masks and RoPE positions."""
    target = random_model(0)
    drafter = drafter_for(target, block=5)
    text = torch.tensor([PROMPTS[2] + [30, 31, 32]])
    s = len(PROMPTS[2])  # the anchor: token s, context positions < s
    with torch.no_grad():
        _, features = target.hidden_states(text, taps=drafter.config.feature_layers)
        T = text.shape[1]
        kv = drafter.context_kv(drafter.context(features), torch.arange(T).unsqueeze(0))
        sees = (torch.arange(T) < s).view(1, 1, 1, T)
        trained = drafter.logits(drafter.draft_hidden(text[0, s:s + 1], torch.tensor([s]), kv, sees))[0, 1:]
    seen = []
    logits = drafter.logits
    drafter.logits = lambda h: seen.append(logits(h)) or seen[-1]
    speculative_generate(target, BlockProposer(drafter), [PROMPTS[2]], 3, k=4, eos_id=None,
                         fixed=[{0: int(text[0, s])}])
    torch.testing.assert_close(seen[0][0], trained, atol=1e-4, rtol=1e-4)


def test_labels_stop_where_the_text_leaves_the_target_chain():
    """A slot is labelled while the block's text so far is the target's greedy chain: on the target's own greedy
    text every slot inside the sequence, on a text that never takes the target's choice the first slot only."""
    assert on_chain(torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4]]), torch.tensor([[1, 2, 3, 0], [1, 2, 3, 4]])).tolist() \
        == [[True, True, True, True], [True, True, False, False]]
    target = random_model(0, vocab=64)
    own, off = [PROMPTS[2]], [list(PROMPTS[2])]
    own[0] = own[0] + generate(target, own, 12, eos_id=None, pad_id=0).tokens[0]
    for _ in range(12):  # each next token one past the target's choice
        off[0].append((generate(target, off, 1, eos_id=None, pad_id=0).tokens[0][0] + 1) % 64)
    drafter = drafter_for(target, block=4, anchors=6)
    for text, labelled in ((own, lambda s: sum(s + j < len(own[0]) - 1 for j in range(3))), (off, lambda s: 1)):
        seq = torch.tensor(text)
        tokens, targets = seq[:, :-1], seq[:, 1:].clone()
        targets[:, :len(PROMPTS[2]) - 1] = IGNORE_INDEX
        anchors = []
        multinomial = torch.multinomial
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "multinomial", lambda *a, **k: anchors.append(multinomial(*a, **k)) or anchors[-1])
            with torch.no_grad():
                logits, _ = drafter(tokens, targets)
        assert len(logits) == sum(labelled(s) for s in anchors[0].view(-1).tolist())


@pytest.mark.parametrize("kl_weight", [0.0, 1.0])
def test_training_lowers_the_loss(kl_weight):
    target = random_model(0, vocab=64)
    prompts = torch.randint(64, (32, 4), generator=torch.Generator().manual_seed(0)).tolist()
    outputs = generate(target, prompts, 20, eos_id=None, pad_id=0).tokens
    seqs = torch.tensor([p + o for p, o in zip(prompts, outputs)])
    tokens, targets = seqs[:, :-1], seqs[:, 1:].clone()
    targets[:, :3] = IGNORE_INDEX  # the prompt
    drafter = drafter_for(target, block=4, kl_weight=kl_weight).train()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    torch.manual_seed(0)
    losses, kls = [], []
    for _ in range(40):
        _, loss = drafter(tokens, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        kls.append(drafter.loss_parts.get("kl"))
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    if kl_weight:
        assert sum(kls[-5:]) < 0.8 * sum(kls[:5])
    else:
        assert kls == [None] * 40
    assert drafter.target.tok_emb.weight.grad is None  # the target stays frozen


def test_training_through_a_packed_bf16_target():
    """Training in bf16 on the CPU runs the frozen target with oneDNN-packed linears, its output layer included;
    the drafter's gradient must still flow through that output layer (the whole vocabulary or a draft one)."""
    from diffar.models.precision import place

    for draft_vocab in (0, 64):
        target = place(random_model(0), "bf16")
        drafter = drafter_for(target, block=4, draft_vocab=draft_vocab).train()
        tokens = torch.tensor([PROMPTS[2] * 2])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = drafter(tokens, tokens.roll(-1, 1))
        loss.backward()
        assert drafter.mask_emb.grad is not None and drafter.mask_emb.grad.abs().sum() > 0


def test_kl_term_is_the_distance_to_the_target_top():
    """KL from the target's top tokens (renormalised over the draftable ones) to the drafter: 0 for the target's own
    distribution over the whole vocabulary; for its top K, -log of their mass (p~ = p / Z, q = p)."""
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    logp = torch.log_softmax(logits, -1)
    top = logp.topk(32, -1)
    torch.testing.assert_close(BlockDrafter._kl(logits, top.values, top.indices), torch.zeros(5), atol=1e-5, rtol=0)
    top = logp.topk(4, -1)
    kl = BlockDrafter._kl(logits, top.values, top.indices)
    torch.testing.assert_close(kl, -top.values.exp().sum(-1).log())
    undraftable = top.indices.clone()
    undraftable[:, 0] = IGNORE_INDEX  # the likeliest token is outside the draft vocabulary: the other 3 renormalised
    kl = BlockDrafter._kl(logits, top.values, undraftable)
    torch.testing.assert_close(kl, -top.values[:, 1:].exp().sum(-1).log())
    assert (BlockDrafter._kl(torch.randn(5, 32), top.values, top.indices) > kl).all()


def test_feature_cache_trains_as_the_target_would(tmp_path, monkeypatch):
    """The cache holds what the target computes on the fly: a batch read from it gives the same loss under the
    same anchors; a build cut short makes only its missing shards; another target's cache is refused."""
    from types import SimpleNamespace

    from safetensors.torch import save_model

    from diffar.data.batching import PairDataset
    from diffar.training import feature_cache

    monkeypatch.setattr(feature_cache, "SHARD", 3)
    target = random_model(0, vocab=64)
    g = torch.Generator().manual_seed(0)
    records = [(torch.randint(64, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist(),
                torch.randint(64, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist())
               for _ in range(8)]
    data = PairDataset(records, SimpleNamespace(pad_id=0), 32, joined=True)
    drafter = drafter_for(target, block=4).train()

    def build(model=target):
        save_model(model, str(tmp_path / "target.safetensors"))
        return feature_cache.build_cache(data, drafter, tmp_path / "cache", target_weights=tmp_path /
                                         "target.safetensors", precision="fp32", batch_size=2)
    cache = build()
    shards = sorted((tmp_path / "cache").glob("shard-*.safetensors"))
    assert len(shards) == 3  # 8 sequences, 3 per shard
    with_kl = drafter_for(target, block=4, kl_weight=0.5).train()  # reads the target's top tokens too
    for model in (drafter, with_kl):
        for rows in ([0, 3, 5, 7], [1, 2, 6]):
            torch.manual_seed(0)
            _, on_the_fly = model(**data.batch(rows))
            torch.manual_seed(0)
            _, cached = model(**cache.batch(rows))
            torch.testing.assert_close(cached, on_the_fly, atol=1e-5, rtol=1e-5)
    assert with_kl.loss_parts["kl"] > 0
    kept = shards[0].stat().st_mtime_ns
    shards[1].unlink()
    build()
    assert shards[1].exists() and shards[0].stat().st_mtime_ns == kept
    with pytest.raises(DiffarError, match="another target"):
        build(random_model(1, vocab=64))


def test_config_checks():
    cfg = random_model(0).config
    assert spread_layers(30) == (1, 14, 26) and spread_layers(2) == (1,)
    with pytest.raises(DiffarError, match="feature_layers"):
        DrafterConfig(target=cfg, feature_layers=(0, cfg.n_layer))
    with pytest.raises(DiffarError, match="draft_vocab"):
        DrafterConfig(target=cfg, draft_vocab=cfg.vocab_size + 1)
    with pytest.raises(DiffarError, match="another AR model"):
        BlockDrafter(DrafterConfig(target=cfg)).attach(random_model(0, vocab=100))


@pytest.fixture(scope="session")
def tiny_drafter(tiny_shakespeare_run, tmp_path_factory):
    """The tiny Shakespeare model's own continuations (`distill data`), and a block drafter trained on them."""
    runs = tmp_path_factory.mktemp("runs")
    data = runs / "self.jsonl"
    made = run_cli("distill", "data", "--checkpoint", tiny_shakespeare_run, "--source", "shakespeare",
                   "--examples", "40", "--max-new-tokens", "24", "--batch-size", "20", "--dtype", "fp32",
                   "--out", data, "--threads", "1")
    assert made.returncode == 0, made.stderr
    out = runs / "drafter"
    train = run_cli("train", "refusion", "--drafter", "block", "--ar", tiny_shakespeare_run, "--corpus", data,
                    "--draft-vocab", "256", "--out", out, "--max-steps", "6", "--block-size", "128", *TINY_TRAIN)
    assert train.returncode == 0, train.stderr
    return data, out


def test_cli_data_resumes(tiny_drafter, tiny_shakespeare_run):
    data, _ = tiny_drafter
    records = [json.loads(line) for line in data.read_text().splitlines()]
    assert sorted(r["i"] for r in records) == list(range(40))
    assert all(r["response_ids"] for r in records)
    again = run_cli("distill", "data", "--checkpoint", tiny_shakespeare_run, "--source", "shakespeare",
                    "--examples", "40", "--max-new-tokens", "24", "--dtype", "fp32", "--out", data)
    assert again.returncode == 0 and "0 shakespeare records made" in again.stdout
    corpus = load_corpus(str(data), "train")
    assert len(corpus.sequences) == 38 and corpus.task == "continuation"  # 1 in 20 held out


def test_cli_data_records_text_as_it_is(tiny_shakespeare_run, tmp_path):
    """`--source text` and `stdlib`: windows of --max-new-tokens + 1 tokens recorded as they are (no model output),
    resumable like the answered sources; a seq2seq corpus or too few windows is a clean error."""
    data = tmp_path / "text.jsonl"
    args = ("distill", "data", "--checkpoint", tiny_shakespeare_run, "--max-new-tokens", "31")
    made = run_cli(*args, "--source", "text", "--corpus", "shakespeare", "--examples", "5", "--out", data)
    assert made.returncode == 0 and "5 text records made" in made.stdout, made.stderr
    _, tokenizer, _ = load_checkpoint(tiny_shakespeare_run)
    records = [json.loads(line) for line in data.read_text().splitlines()]
    ids = tokenizer.encode(load_corpus("shakespeare", "train").documents[0])
    assert [r["prompt_ids"] + r["response_ids"] for r in records] == [ids[i * 32:(i + 1) * 32] for i in range(5)]
    assert not any(r["ended"] for r in records)
    again = run_cli(*args, "--source", "text", "--corpus", "shakespeare", "--examples", "5", "--out", data)
    assert "0 text records made" in again.stdout
    before = data.read_bytes()  # records of other windows are not the ones asked for: refused, the file kept
    assert_clean_error(run_cli("distill", "data", "--checkpoint", tiny_shakespeare_run, "--max-new-tokens", "15",
                               "--source", "text", "--corpus", "shakespeare", "--examples", "8", "--out", data),
                       "made with max_new_tokens 31 (now 15)")
    assert data.read_bytes() == before
    for seed in ("0", "1"):
        assert run_cli(*args, "--source", "stdlib", "--examples", "3", "--seed", seed,
                       "--out", tmp_path / f"stdlib{seed}.jsonl").returncode == 0
    windows = [[tuple(json.loads(line)["response_ids"]) for line in (tmp_path / f"stdlib{seed}.jsonl").open()]
               for seed in ("0", "1")]
    assert all(len(w) == 31 for w in windows[0]) and len(set(windows[0])) == 3 and windows[0] != windows[1]
    assert_clean_error(run_cli(*args, "--source", "stdlib", "--examples", "4", "--seed", "1",
                               "--out", tmp_path / "stdlib0.jsonl"), "made with seed 0 (now 1)")
    assert_clean_error(run_cli(*args, "--source", "text", "--corpus", "kjv2web", "--examples", "2",
                               "--out", tmp_path / "pairs.jsonl"), "holds source/target pairs")
    assert_clean_error(run_cli(*args, "--source", "text", "--corpus", "shakespeare", "--examples", "1000000",
                               "--out", tmp_path / "many.jsonl"), "fewer than --examples 1000000")


def test_stdlib_windows_leave_installed_packages_out(tokenizer_path, tmp_path, monkeypatch):
    """`--source stdlib` reads the standard library's folder but not the packages installed inside it."""
    import sysconfig

    from diffar.tokenizer import Tokenizer
    from diffar.training.self_data import _text_windows

    (tmp_path / "site-packages").mkdir()
    (tmp_path / "mod.py").write_text("alpha = 1\n" * 200)
    (tmp_path / "site-packages" / "pkg.py").write_text("beta = 2\n" * 200)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    tokenizer = Tokenizer.load(tokenizer_path)
    n = len(tokenizer.encode((tmp_path / "mod.py").read_text())) // 64  # the module's whole windows
    windows = _text_windows("stdlib", tokenizer, n, 64, 0, None)
    assert n >= 3 and all("alpha" in tokenizer.decode(w) for w in windows)
    with pytest.raises(DiffarError, match=f"gives {n} windows of 64 tokens, fewer than --examples {n + 1}"):
        _text_windows("stdlib", tokenizer, n + 1, 64, 0, None)


def test_cli_checkpoint_holds_the_drafter_only(tiny_drafter, tiny_shakespeare_run):
    _, out = tiny_drafter
    folder = resolve(out)
    meta = json.loads((folder / "config.json").read_text())
    assert meta["kind"] == "drafter" and meta["target"] == str(tiny_shakespeare_run)
    target_bytes = (resolve(tiny_shakespeare_run) / "model.safetensors").stat().st_size
    assert (folder / "model.safetensors").stat().st_size < target_bytes
    drafter, _, _ = load_checkpoint(out)
    assert len(drafter.vocab) == 256 and drafter.target is not None


def test_cli_generate_equals_ar(tiny_drafter, tiny_shakespeare_run):
    data, out = tiny_drafter
    prompt = "ROMEO.\nBut soft, what light"
    plain = run_cli("generate", "--checkpoint", tiny_shakespeare_run, "--prompt", prompt, "--max-new-tokens", "40")
    for extra in ([], ["--tree", "8"], ["--tree", "8", "--prompt-lookup"], ["--prompt-lookup", "--datastore", data]):
        drafted = run_cli("generate", "--checkpoint", out, "--prompt", prompt, "--max-new-tokens", "40", *extra)
        assert drafted.returncode == 0, drafted.stderr
        assert drafted.stdout == plain.stdout
        assert "drafter passes" in drafted.stderr
    assert "[refusion+prompt-lookup+datastore]" in drafted.stderr


def test_compiled_drafting_is_greedy_ar(tiny_drafter, tiny_shakespeare_run):
    """--compile with a block drafter: the target's passes and the drafter's, compiled, write the eager greedy AR
    text, chain, tree and tree with prompt lookup's copies, batched (3 rows, padded to 4, the padding dropped)."""
    _, out = tiny_drafter
    eager = load_method(str(tiny_shakespeare_run))
    settings = eager.settings(Options())
    prompts = [eager.prompt(t) for t in ("ROMEO.\nBut soft, what light", "KING.\nNow is the", "To be, or not")]
    reference = eager.generate(prompts, 24, settings, ignore_eos=True).tokens
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for schedule in (DraftSchedule(), DraftSchedule(tree=8), DraftSchedule(tree=8, lookup=True)):
        method = load_method(str(out), compile=True, schedule=schedule)
        got = method.generate(prompts, 24, settings, ignore_eos=True)
        assert got.tokens == reference and (got.passes["draft"] > 0 or schedule.lookup)  # copies first: maybe none
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs


def test_cli_training_goes_on_from_a_drafter(tiny_drafter, tiny_shakespeare_run, tmp_path):
    """--init: a new run (more data, say) starts from a trained drafter's weights, not from the target's layers,
    with the same or another draft vocabulary."""
    data, out = tiny_drafter
    trained, _, _ = load_checkpoint(out)
    again = run_cli("train", "refusion", "--drafter", "block", "--ar", tiny_shakespeare_run, "--init", out,
                    "--corpus", data, "--draft-vocab", "256", "--out", tmp_path / "more", "--max-steps", "1",
                    "--block-size", "128", *TINY_TRAIN, "--lr", "1e-9")
    assert again.returncode == 0, again.stderr
    went_on, _, _ = load_checkpoint(tmp_path / "more")
    for name, weight in trained.state_dict().items():
        assert torch.allclose(weight.float(), went_on.state_dict()[name].float(), atol=1e-6), name
    # another draft vocabulary: the weights carry over, the vocabulary is chosen from the data again
    smaller = run_cli("train", "refusion", "--drafter", "block", "--ar", tiny_shakespeare_run, "--init", out,
                      "--corpus", data, "--draft-vocab", "128", "--out", tmp_path / "smaller", "--max-steps", "1",
                      "--block-size", "128", *TINY_TRAIN, "--lr", "1e-9")
    assert smaller.returncode == 0, smaller.stderr
    narrowed, _, _ = load_checkpoint(tmp_path / "smaller")
    assert len(narrowed.vocab) == 128 and set(narrowed.vocab.tolist()) < set(trained.vocab.tolist())
    assert torch.allclose(narrowed.fc.weight.float(), trained.fc.weight.float(), atol=1e-6)
    assert_clean_error(run_cli("train", "refusion", "--drafter", "block", "--ar", tiny_shakespeare_run, "--init", out,
                               "--corpus", data, "--draft-layers", "2", "--out", tmp_path / "other", *TINY_TRAIN),
                       "has another shape")


def test_cli_trains_from_a_feature_cache(tiny_drafter, tiny_shakespeare_run, tmp_path):
    data, _ = tiny_drafter
    args = ("train", "refusion", "--drafter", "block", "--ar", tiny_shakespeare_run, "--corpus", data,
            "--feature-cache", tmp_path / "cache", "--max-steps", "2", "--block-size", "128", *TINY_TRAIN)
    first = run_cli(*args, "--out", tmp_path / "a")
    assert first.returncode == 0, first.stderr
    assert json.loads((tmp_path / "cache" / "cache.json").read_text())["precision"] == "fp32"
    made = {path: path.stat().st_mtime_ns for path in (tmp_path / "cache").glob("shard-*.safetensors")}
    assert made
    again = run_cli(*args, "--out", tmp_path / "b")
    assert again.returncode == 0, again.stderr
    assert {path: path.stat().st_mtime_ns for path in made} == made  # reused, not made again
    assert "reused" in again.stdout


def test_cli_errors(tiny_shakespeare_run, tiny_run, tiny_drafter, tmp_path):
    data, _ = tiny_drafter
    assert_clean_error(run_cli("train", "refusion", "--drafter", "block", "--corpus", data, "--out", tmp_path / "a"),
                       "pass --ar CHECKPOINT")
    assert_clean_error(run_cli("train", "refusion", "--drafter", "block", "--ar", tiny_shakespeare_run, "--corpus",
                               data, "--feature-layers", "7", "--out", tmp_path / "b"), "feature_layers")
    assert_clean_error(run_cli("train", "refusion", "--ar", tiny_shakespeare_run, "--corpus", data,
                               "--draft-vocab", "5", "--out", tmp_path / "c"), "--drafter block only")
    assert_clean_error(run_cli("train", "refusion", "--drafter", "block", "--ar", tiny_shakespeare_run, "--corpus",
                               "shakespeare", "--feature-cache", tmp_path / "f", "--out", tmp_path / "e"),
                       "nothing to cache")
    assert_clean_error(run_cli("distill", "data", "--checkpoint", tiny_shakespeare_run, "--source", "chat",
                               "--examples", "2", "--out", tmp_path / "d.jsonl"), "no chat template")


def test_cli_bench_prompt_set(tiny_drafter, tokenizer_path, tmp_path):
    """The prompt-set bench: the drafter's methods are lossless (exact match with AR), the peers run on the same
    weights (transformers; a small AR draft model trained on the drafter's data, token ids as they are), and
    every record says what the drafter costs."""
    data, out = tiny_drafter
    draft = run_cli("train", "ar", "--corpus", data, "--tokenizer", tokenizer_path,
                    "--out", tmp_path / "draft", "--max-steps", "2", "--block-size", "128", *TINY_TRAIN)
    assert draft.returncode == 0, draft.stderr
    proc = run_cli("bench", "refusion", "--checkpoint", out, "--set", "shakespeare", "--prompts", "2",
                   "--new-tokens", "16", "--batch-sizes", "1", "2", "--methods", "ar", "refusion", "refusion-tree",
                   "refusion-tree+prompt-lookup", "ar+prompt-lookup", "ar+draft", "transformers",
                   "transformers+prompt-lookup", "ar+prompt-lookup+datastore", "refusion+prompt-lookup+datastore",
                   "--datastore", data, "--draft", tmp_path / "draft", "--out", tmp_path / "b.json")
    assert proc.returncode == 0, proc.stderr
    records = json.loads((tmp_path / "b.json").read_text())
    by = {(r["method"], r["batch_size"]): r for r in records}
    assert ("transformers+prompt-lookup", 2) not in by and ("transformers+prompt-lookup", 1) in by
    for (name, _), r in by.items():
        assert r["new_tokens"] == 16
        if name.startswith(("refusion", "ar")):
            assert r["extra"]["exact_match_vs_ar"] == 1.0
    assert by["refusion", 1]["extra"]["draft_cost_vs_ar_step"] > 0 and ("ar+draft", 2) in by
    assert by["refusion-tree", 2]["extra"]["tokens_per_ar_pass"] >= 1.0
    assert ("ar+prompt-lookup+datastore", 2) in by and ("refusion+prompt-lookup+datastore", 2) in by


def test_cli_drafter_for_a_seq2seq_model(tiny_run, tmp_path):
    """A 7M-style seq2seq target: `distill data --source corpus` answers its own training sources (prompted as it
    reads them), the drafter trained on them keeps the target's task, and the corpus bench (prompts from the
    target's corpus) and `generate` give the target's own text."""
    data = tmp_path / "self.jsonl"
    made = run_cli("distill", "data", "--checkpoint", tiny_run, "--source", "corpus", "--examples", "24",
                   "--max-new-tokens", "12", "--batch-size", "12", "--dtype", "fp32", "--out", data)
    assert made.returncode == 0, made.stderr
    _, tokenizer, _ = load_checkpoint(tiny_run)
    records = [json.loads(line) for line in data.read_text().splitlines()]
    train = load_corpus("kjv2web", "train").pairs
    assert len(records) == 24 and all(r["prompt_ids"][-1] == tokenizer.sep_id for r in records)
    assert tokenizer.decode(records[1]["prompt_ids"][:-1]) == train[len(train) // 24].source
    out = tmp_path / "drafter"
    trained = run_cli("train", "refusion", "--drafter", "block", "--ar", tiny_run, "--corpus", data,
                      "--out", out, "--max-steps", "2", "--block-size", "128", *TINY_TRAIN)
    assert trained.returncode == 0, trained.stderr
    assert json.loads((resolve(out) / "config.json").read_text())["task"] == "seq2seq"
    proc = run_cli("bench", "refusion", "--checkpoint", out, "--prompts", "3", "--new-tokens", "16", "--batch-sizes",
                   "1", "2", "--methods", "ar", "refusion", "refusion-tree+prompt-lookup", "--out", tmp_path / "b.json")
    assert proc.returncode == 0, proc.stderr
    records = json.loads((tmp_path / "b.json").read_text())
    assert {r["task"] for r in records} == {"kjv2web"} and len(records) == 6
    assert {r["extra"]["prompts"] for r in records} == {3}
    assert all(r["extra"]["exact_match_vs_ar"] == 1.0 for r in records)
    # (with copies first, the grafted method may find a copy at every step and never draft)
    assert all(r["extra"]["draft_cost_vs_ar_step"] > 0 for r in records if r["method"] == "refusion")
    source = "In the beginning God created the heaven and the earth."
    plain = run_cli("generate", "--checkpoint", tiny_run, "--prompt", source, "--max-new-tokens", "20")
    drafted = run_cli("generate", "--checkpoint", out, "--prompt", source, "--max-new-tokens", "20", "--tree", "8")
    assert drafted.returncode == 0 and drafted.stdout == plain.stdout, drafted.stderr
    assert_clean_error(run_cli("distill", "data", "--checkpoint", tiny_run, "--source", "chat", "--corpus", "kjv2web",
                               "--examples", "2", "--out", tmp_path / "d.jsonl"), "--source corpus")
