"""Prompt lookup's datastore (decoding/datastore.py): copies from other text where the row's own has none, the
output still the target's own; built from a corpus's train split only."""

import gzip
import json
import math

import pytest
import torch

from diffar.decoding.ar import generate
from diffar.decoding.datastore import Datastore, load_datastore
from diffar.decoding.sampling import SamplingConfig
from diffar.decoding.speculative import DecodeState, Draft, PromptLookup, WithPromptLookup, speculative_generate
from diffar.errors import DiffarError
from diffar.tokenizer import Tokenizer
from tests.conftest import assert_clean_error, random_model, run_cli
from tests.test_speculative import PROMPTS, assert_follows_the_ar_law
from tests.test_tree import Asked, TreeDrafter, noisy_copy, paths


def test_children_follow_the_longest_stored_ngram_by_frequency():
    store = Datastore([[1, 2, 3, 4, 5], [9, 2, 3, 7], [8, 1, 2, 6, 6, 6], [0, 2, 3, 7]], top=2)
    assert tokens(store.children([0, 9, 2, 3])) == [7]  # the 3-gram (9, 2, 3)
    assert tokens(store.children([0, 5, 2, 3])) == [7, 4]  # (2, 3): 7 twice, 4 once
    assert tokens(store.children([4, 1, 2])) == [3, 6]  # (1, 2): a tie, in the order first seen
    assert tokens(store.children([6])) == [6]  # (6,) is followed by 6, twice; top keeps 2 at most
    assert [math.exp(lp) for _, lp in store.children([5, 2, 3])] == pytest.approx([2 / 3, 1 / 3])
    assert store.children([42]) == [] and store.children([5]) == []  # a text's last token has nothing after it
    with pytest.raises(DiffarError, match="no n-gram"):
        Datastore([[1]])


def tokens(children):
    return [t for t, _ in children]


def test_the_tree_holds_the_likeliest_continuations():
    """Continuations scored by the product of their n-gram frequencies, up to `depth` tokens, `nodes` in all."""
    store = Datastore([[1, 2, 3]] * 3 + [[1, 2, 4]] * 2 + [[1, 5]])
    assert store.tree([0, 1], 3, 8) == ([2, 3, 4], [0, 1, 1])  # 1-2 (5/6), 1-2-3 (1/2), 1-2-4 (1/3)
    assert store.tree([0, 1], 4, 8) == ([2, 3, 4, 5], [0, 1, 1, 0])  # then 1-5 (1/6)
    assert store.tree([0, 1], 4, 1) == ([2, 5], [0, 0])  # one token deep
    assert store.tree([7], 4, 8) == ([], [])


def test_own_text_copy_on_the_datastores_tree():
    lookup = PromptLookup(datastore=Datastore([[4, 5, 6, 7]]), nodes=4)
    assert lookup.lookup([4, 9, 4], 3) == (1, [9, 4])  # the row's own copy
    assert lookup.lookup([1, 2, 5], 3) == (0, [])  # the datastore is not its text
    draft = lookup.draft([4, 9, 4], [9, 4], 3)  # the datastore's 5-6 (2 nodes, room left by the copy), then the copy
    assert (draft.tokens, draft.parents) == ([5, 6, 9, 4], [0, 1, 0, 3])
    draft = lookup.draft([1, 2, 5], [], 3)
    assert (draft.tokens, draft.parents) == ([6, 7], [0, 1])
    assert PromptLookup().draft([1, 2, 5], [], 3).tokens == []


def test_greedy_with_a_datastore_equals_plain_ar():
    """Copies from a store of the target's own outputs are mostly right, from one of other text mostly wrong;
    either way the output is greedy AR's, and right copies save passes."""
    target = random_model(0)
    plain = generate(target, PROMPTS, 30, pad_id=0, eos_id=None).tokens
    alone = speculative_generate(target, PromptLookup(), PROMPTS, 30, k=6, eos_id=None)
    for texts in ([p + t for p, t in zip(PROMPTS, plain)], [[(7 * i + 3) % 97 for i in range(200)]]):
        out = speculative_generate(target, PromptLookup(datastore=Datastore(texts)), PROMPTS, 30, k=6, eos_id=None)
        assert out.tokens == plain and out.extra["drafted"] > alone.extra["drafted"]
    own = speculative_generate(target, PromptLookup(datastore=Datastore([p + t for p, t in zip(PROMPTS, plain)])),
                               PROMPTS, 30, k=6, eos_id=None)
    assert own.passes["target"] < alone.passes["target"]


def test_sampled_with_a_datastore_follows_the_ar_law():
    store = Datastore([[3, 4, 5, 0], [3, 1, 1, 2], [2, 3, 4]])
    assert_follows_the_ar_law(lambda drafter: PromptLookup(datastore=store))


def test_the_datastores_tree_joins_a_drafters_drafts():
    """Copies first: where the row's text holds a copy, prompt lookup's draft (the copy on the datastore's tree)
    goes alone, and where it holds none, the datastore's tree alone; with every copy grafted (`trusted` None), the
    datastore's tree joins the drafter's draft. Greedy: AR's output; sampled: its law."""
    store = Datastore([[1, 2, 4, 5], [7, 3, 6]])
    state = DecodeState(seqs=[[7, 3, 7], [8, 1, 2], [9]], prompt_lengths=[0, 0, 0], max_new_tokens=8,
                        valid=torch.zeros(3, 1, dtype=torch.bool), hidden=None, write=0, done=[False] * 3)
    lookup = PromptLookup(datastore=store, nodes=4)
    inner = Asked(Draft([4, 9]))
    first = WithPromptLookup(inner, k=3, lookup=lookup)
    assert first.name == "fixed+prompt-lookup+datastore" and first.tree == 3 + 4
    a, b, c = first.propose(state, 2, SamplingConfig(), None)
    assert paths(a.tokens, a.parents) == {(), (3,), (3, 6), (3, 7)}  # the copy 3 7 on the store's 3 6
    assert paths(b.tokens, b.parents) == {(), (4,), (4, 5)} and inner.asked == [2]  # the store's 4 5 (1 2 -> 4)
    assert c.tokens == [4, 9]  # neither has anything after 9: the drafter's
    _, b, _ = WithPromptLookup(inner, k=3, lookup=lookup, trusted=None).propose(state, 2, SamplingConfig(), None)
    assert paths(b.tokens, b.parents) == {(), (4,), (4, 9), (4, 5)}  # grafted: 4 5 shares the drafter's 4
    target = random_model(0)
    plain = generate(target, PROMPTS, 30, pad_id=0, eos_id=None).tokens
    texts = [p + t for p, t in zip(PROMPTS, plain)]
    for trusted in (1, None):
        out = speculative_generate(target, WithPromptLookup(TreeDrafter(noisy_copy(target, 0.3), 4), k=6,
                                                            lookup=PromptLookup(datastore=Datastore(texts)),
                                                            trusted=trusted), PROMPTS, 30, k=6, eos_id=None)
        assert out.tokens == plain and out.extra["drafted"] > 0
    assert_follows_the_ar_law(lambda drafter: WithPromptLookup(TreeDrafter(drafter, 3), k=2, trusted=None,
                                                               lookup=PromptLookup(datastore=Datastore(
                                                                   [[3, 4, 5, 0], [3, 1, 1, 2], [2, 3, 4]]))))


def _records(path, rows, tag):
    with gzip.open(path, "wt") as f:
        for i, response in enumerate(rows):
            f.write(json.dumps({"i": i, "source": "chat", "prompt_ids": [1], "response_ids": response,
                                "ended": False, "eos_id": 2, "tokenizer": tag}) + "\n")


def test_load_keeps_the_valid_split_out(tokenizer_path, tmp_path):
    """Token records: the train split's responses only (record 19 of each 20 is valid, where chat prompts for
    benchmarks come from); records of another tokenizer are refused."""
    tokenizer = Tokenizer.load(tokenizer_path)
    rows = [[100 + i, 200 + i, 300 + i] for i in range(40)]
    _records(tmp_path / "self.jsonl.gz", rows, tokenizer.sha256[:16])
    store = load_datastore(str(tmp_path / "self.jsonl.gz"), tokenizer)
    assert store.tree([100 + 3], 4, 8) == ([203, 303], [0, 1])
    assert store.children([100 + 19]) == [] and store.children([100 + 39]) == []
    _records(tmp_path / "other.jsonl.gz", rows, "0" * 16)
    with pytest.raises(DiffarError, match="another tokenizer"):
        load_datastore(str(tmp_path / "other.jsonl.gz"), tokenizer)
    text = load_datastore("shakespeare", tokenizer)  # a text corpus: its train documents, tokenized
    assert len(text.next) > 1000


def test_cli_datastore_errors(tmp_path):
    ckpt = "checkpoints/ar-shakespeare"
    assert_clean_error(run_cli("generate", "--checkpoint", ckpt, "--prompt", "ROMEO:", "--datastore", "shakespeare"),
                       "a datastore serves prompt lookup")
    assert_clean_error(run_cli("bench", "speculative", "--checkpoint", ckpt, "--methods", "ar",
                               "--datastore", "shakespeare", "--out", tmp_path / "a.json"),
                       "--datastore serves the +datastore methods")
    assert_clean_error(run_cli("bench", "speculative", "--checkpoint", ckpt, "--methods", "ar+prompt-lookup+datastore",
                               "--prompts", "1", "--out", tmp_path / "b.json"), "pass --datastore")
