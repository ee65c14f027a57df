"""The teacher-output cache of sequence-level distillation (training/distill.py)."""

import json

import pytest

from conftest import random_model
from diffar.errors import DiffarError
from diffar.training.distill import teacher_outputs

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
BUDGETS = [4, 3, 5, 2]


def outputs(cache, prompts=PROMPTS, budgets=BUDGETS):
    return teacher_outputs(random_model(0), prompts, budgets, cache, pad_id=0, eos_id=None, batch_size=2)


def test_an_interrupted_cache_resumes_to_the_same_outputs(tmp_path):
    fresh = outputs(tmp_path / "fresh.jsonl")
    assert [len(o) for o in fresh] == BUDGETS
    cache = tmp_path / "cut.jsonl"
    lines = (tmp_path / "fresh.jsonl").read_text().splitlines()
    cache.write_text(lines[0] + "\n" + lines[1][:7])  # the second line cut short by an interruption
    assert outputs(cache) == fresh
    records = [json.loads(line) for line in cache.read_text().splitlines()[2:]]  # after the cut line
    assert sorted(r["i"] for r in records) == [i for i in range(4) if i != json.loads(lines[0])["i"]]


def test_a_cache_made_for_other_prompts_is_refused(tmp_path):
    cache = tmp_path / "teacher.jsonl"
    outputs(cache)
    with pytest.raises(DiffarError, match="other data"):
        outputs(cache, prompts=[[5, 6, 7], [8, 9], [10, 11, 12, 99], [14]])  # same count, one prompt changed
    with pytest.raises(DiffarError, match="other data"):
        outputs(cache, budgets=[4, 3, 6, 2])
    with pytest.raises(DiffarError, match="other data"):
        outputs(cache, prompts=PROMPTS[:2], budgets=BUDGETS[:2])


def test_a_cache_written_before_the_keys_is_still_read(tmp_path):
    cache = tmp_path / "teacher.jsonl"
    fresh = outputs(cache)
    records = [json.loads(line) for line in cache.read_text().splitlines()]
    cache.write_text("".join(json.dumps({"i": r["i"], "out": [1] * len(r["out"])}) + "\n" for r in records))
    assert outputs(cache) == [[1] * len(o) for o in fresh]  # read, not made again
