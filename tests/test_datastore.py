"""Prompt lookup's datastore (decoding/datastore.py): copies from other text where the row's own has none, the
output still the target's own; built from a corpus's train split only."""

import gzip
import json

import pytest

from diffar.decoding.ar import generate
from diffar.decoding.datastore import Datastore, load_datastore
from diffar.decoding.speculative import PromptLookup, speculative_generate
from diffar.errors import DiffarError
from diffar.tokenizer import Tokenizer
from tests.conftest import assert_clean_error, random_model, run_cli
from tests.test_speculative import PROMPTS, assert_follows_the_ar_law


def test_copy_takes_the_longest_latest_match_and_stops_where_its_text_ends():
    store = Datastore([[1, 2, 3, 4, 5], [9, 2, 3, 7], [8, 1, 2, 6, 6, 6]])
    assert store.copy([0, 9, 2, 3], 4) == (3, [7])  # not past the end of its text
    assert store.copy([0, 5, 2, 3], 4) == (2, [7])  # the latest (2, 3)
    assert store.copy([0, 0, 1, 2], 2) == (2, [6, 6])  # (1, 2) last occurs in the third text
    assert store.copy([4], 3) == (1, [5])
    assert store.copy([42], 3) == (0, [])
    assert store.copy([7], 3) == (0, [])  # a text's last token has nothing after it
    with pytest.raises(DiffarError, match="no n-gram"):
        Datastore([[1]])


def test_own_text_first_then_the_datastore():
    lookup = PromptLookup(datastore=Datastore([[4, 5, 6, 7]]))
    assert lookup.lookup([4, 9, 4], 3) == (1, [9, 4])  # the row's own copy
    assert lookup.lookup([1, 2, 5], 3) == (1, [6, 7])  # none there: the datastore's
    assert PromptLookup().lookup([1, 2, 5], 3) == (0, [])


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
    assert store.copy([100 + 3], 2) == (1, [203, 303])
    assert store.copy([100 + 19], 2) == (0, []) and store.copy([100 + 39], 2) == (0, [])
    _records(tmp_path / "other.jsonl.gz", rows, "0" * 16)
    with pytest.raises(DiffarError, match="another tokenizer"):
        load_datastore(str(tmp_path / "other.jsonl.gz"), tokenizer)
    text = load_datastore("shakespeare", tokenizer)  # a text corpus: its train documents, tokenized
    assert len(text.ends) > 1000


def test_cli_datastore_errors(tmp_path):
    ckpt = "checkpoints/ar-shakespeare"
    assert_clean_error(run_cli("generate", "--checkpoint", ckpt, "--prompt", "ROMEO:", "--datastore", "shakespeare"),
                       "a datastore serves prompt lookup")
    assert_clean_error(run_cli("bench", "speculative", "--checkpoint", ckpt, "--methods", "ar",
                               "--datastore", "shakespeare", "--out", tmp_path / "a.json"),
                       "--datastore serves the +datastore methods")
    assert_clean_error(run_cli("bench", "speculative", "--checkpoint", ckpt, "--methods", "ar+prompt-lookup+datastore",
                               "--prompts", "1", "--out", tmp_path / "b.json"), "pass --datastore")
