"""Corpora: the embedded ones under data/, and a user's own text or JSONL.

A corpus is either *continuation* (a list of documents) or *seq2seq* (a list of source/target pairs).
Embedded corpora are named (`shakespeare`, `kjv2web`, `rv1909` in Spanish, `web2rv` English -> Spanish) and have
fixed splits; anything else is a path, read by its content (gzipped or not, whatever its name):
  - JSON Lines of {"source", "target"} records                       -> seq2seq
  - JSON Lines of {"prompt_ids", "response_ids"} records (`diffar distill data`: a model's own responses, as
    token ids of its tokenizer)                                       -> continuation, the loss on the responses
  - any other text file, or a folder of `*.txt` files                 -> continuation (one document each)
A file is JSON Lines when its first line is a JSON object or its name ends in .jsonl/.json (then a parse error
is an error, not text). Splits of a user's file: see `_user_split`.

Several corpora of one task, comma-separated (`shakespeare,rv1909`), are one *mixture*: their records together,
each labelled with its corpus, its *domain* (what a diffusion stream's domain adapter is told: models/domain_adapter.py).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from diffar.errors import DiffarError

DATA_DIR = Path(__file__).resolve().parent.parent.parent / "data"
GZIP_MAGIC = b"\x1f\x8b"  # a gzipped file is recognised by its first bytes, not its name
JSON_NAMES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")  # read as JSON Lines whatever the first line holds
EMBEDDED = {"shakespeare": "continuation", "kjv2web": "seq2seq", "rv1909": "continuation", "web2rv": "seq2seq"}
SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class Pair:
    source: str
    target: str


@dataclass
class Corpus:
    name: str  # an embedded corpus's name, or the absolute path of a user's file or folder
    task: str  # "continuation" | "seq2seq"
    documents: list[str] | None = None
    pairs: list[Pair] | None = None
    sequences: list[tuple[list[int], list[int]]] | None = None  # token records: (prompt ids, response ids [+ eos])
    tokenizer: str | None = None  # token records: the tag of the tokenizer their ids belong to
    domains: list[str] | None = None  # a mixture's: each document's or pair's corpus (`domain_name`)

    def texts(self) -> list[str]:
        """Every string in the corpus (for tokenizer training)."""
        if self.sequences is not None:
            raise DiffarError(f"{self.name} holds token ids, not text")
        if self.task == "continuation":
            return list(self.documents)
        return [t for p in self.pairs for t in (p.source, p.target)]


def _read(path: Path) -> str:
    """A file's text, gunzipped when its first bytes say gzip (whatever its name)."""
    try:
        raw = path.read_bytes()
        return (gzip.decompress(raw) if raw[:2] == GZIP_MAGIC else raw).decode("utf-8")
    except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError) as e:
        raise DiffarError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from e


def _jsonl(text: str, path: Path) -> list[dict]:
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                if lineno == 1 and _is_json(text):
                    raise DiffarError(f"{path} is one JSON document; diffar reads JSON Lines (one object per line, "
                                      "e.g. {\"source\": ..., \"target\": ...}) or plain text") from None
                raise DiffarError(f"{path}:{lineno}: invalid JSON ({e.msg})") from e
    return records


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def _first_record(text: str) -> dict | None:
    """The first non-blank line as a JSON object, or None if it is not one (plain text)."""
    first = next((line for line in text.splitlines() if line.strip()), "")
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _pairs(records: list[dict], path: Path) -> list[Pair]:
    pairs = []
    for i, r in enumerate(records, 1):
        if not isinstance(r, dict) or not isinstance(r.get("source"), str) or not isinstance(r.get("target"), str):
            raise DiffarError(f"{path}: record {i} needs string fields \"source\" and \"target\"")
        pairs.append(Pair(r["source"], r["target"]))
    if not pairs:
        raise DiffarError(f"{path} holds no records")
    return pairs


def _sequences(records: list[dict], path: Path) -> Corpus:
    """Token records (`diffar distill data`) -> a continuation corpus of (prompt, response) id sequences; a
    response that ended gets its record's `eos_id` appended here, so `build_dataset` appends nothing. All
    records must carry one tokenizer tag, which `build_dataset` checks against the model's."""
    sequences, tags = [], set()
    for i, r in enumerate(records, 1):
        ids = [r.get("prompt_ids"), r.get("response_ids")] if isinstance(r, dict) else [None]
        if not all(isinstance(x, list) and all(isinstance(t, int) and t >= 0 for t in x) for x in ids) \
                or not ids[0] or not isinstance(r.get("eos_id"), int) or not isinstance(r.get("tokenizer"), str):
            raise DiffarError(f"{path}: record {i} needs token id lists \"prompt_ids\" and \"response_ids\", "
                              f"\"eos_id\" and \"tokenizer\"")
        sequences.append((ids[0], ids[1] + ([r["eos_id"]] if r.get("ended") else [])))
        tags.add(r["tokenizer"])
    if len(tags) != 1:
        raise DiffarError(f"{path} mixes token ids of {len(tags)} tokenizers")
    return Corpus(str(path), "continuation", sequences=sequences, tokenizer=tags.pop())


HOLDOUT_EVERY = 20  # a user's own data: 1 pair in 20, or the last 1/20 of each document, is the valid split


def _user_split(corpus: Corpus, split: str) -> Corpus:
    """train/valid of a user's file or folder; `test` is all of it (a separate file is the test set)."""
    if split == "test":
        return corpus
    keep = (lambda i: i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1) if split == "valid" else \
        (lambda i: i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1)
    if corpus.task == "seq2seq" or corpus.sequences is not None:
        records = [p for i, p in enumerate(corpus.pairs or corpus.sequences) if keep(i)]
        if not records:
            raise DiffarError(f"{corpus.name} has too few records to hold out a {split} split; give a separate "
                              "validation corpus")
        if corpus.sequences is not None:
            return Corpus(corpus.name, corpus.task, sequences=records, tokenizer=corpus.tokenizer)
        return Corpus(corpus.name, corpus.task, pairs=records)
    cuts = [len(d) - len(d) // HOLDOUT_EVERY for d in corpus.documents]
    docs = [d[c:] if split == "valid" else d[:c] for d, c in zip(corpus.documents, cuts)]
    return Corpus(corpus.name, corpus.task, documents=[d for d in docs if d])


def domain_name(name_or_path: str) -> str:
    """A mixture's label for one of its corpora: an embedded corpus's name, a file's or folder's name without
    its suffixes."""
    return name_or_path if name_or_path in EMBEDDED else Path(name_or_path).name.split(".")[0]


def mixture_parts(name_or_path: str) -> list[str]:
    """The corpora of a comma-separated mixture (one name: itself)."""
    return [part.strip() for part in name_or_path.split(",")] if "," in name_or_path else [name_or_path]


def is_embedded(name: str) -> bool:
    """Whether `name` is an embedded corpus or a mixture of them (fixed splits, none of it a user's file)."""
    return all(part in EMBEDDED for part in mixture_parts(name))


def _mixture(parts: list[str], split: str, whole: bool) -> Corpus:
    names = [domain_name(part) for part in parts]
    if len(set(names)) < len(names) or not all(parts):
        raise DiffarError(f"a mixture names each corpus once, got {','.join(parts)!r}")
    corpora = [load_corpus(part, split, whole=whole) for part in parts]
    if len({c.task for c in corpora}) > 1 or any(c.sequences is not None for c in corpora):
        raise DiffarError("a mixture's corpora must be of one task, all continuation text or all source/target "
                          f"pairs: {', '.join(f'{n} is {c.task}' for n, c in zip(names, corpora))}")
    field = "documents" if corpora[0].task == "continuation" else "pairs"
    records = [getattr(c, field) for c in corpora]
    return Corpus(",".join(parts), corpora[0].task, domains=[n for n, r in zip(names, records) for _ in r],
                  **{field: [x for r in records for x in r]})


def load_corpus(name_or_path: str, split: str = "train", *, whole: bool = False) -> Corpus:
    """Load a split of an embedded corpus by name, or of a user's file or folder (see `_user_split`;
    `whole=True` takes all of a user's file, e.g. one given as validation data), or of a mixture of them."""
    if split not in SPLITS:
        raise DiffarError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if "," in name_or_path:
        return _mixture(mixture_parts(name_or_path), split, whole)
    if name_or_path in EMBEDDED:
        path = DATA_DIR / name_or_path / f"{split}.jsonl.gz"
        records = _jsonl(_read(path), path)
        if EMBEDDED[name_or_path] == "seq2seq":
            return Corpus(name_or_path, "seq2seq", pairs=_pairs(records, path))
        return Corpus(name_or_path, "continuation", documents=[r["text"] for r in records])
    path = Path(name_or_path).resolve()
    if not path.exists():
        raise DiffarError(f"unknown corpus {name_or_path!r}: not one of {', '.join(EMBEDDED)} "
                          f"and no such file or folder")
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise DiffarError(f"folder {path} holds no *.txt files")
        corpus = Corpus(str(path), "continuation", documents=[_read(f) for f in files])
    else:
        corpus = _file_corpus(path)
    return corpus if whole else _user_split(corpus, split)


def _file_corpus(path: Path) -> Corpus:
    """A user's file, by its content: JSON Lines (its first line an object, or a .json/.jsonl name) of pairs or
    token records, else plain text."""
    text = _read(path)
    first = _first_record(text)
    if first is None and not path.name.endswith(JSON_NAMES):
        if not text.strip():
            raise DiffarError(f"{path} is empty")
        return Corpus(str(path), "continuation", documents=[text])
    records = _jsonl(text, path)
    if not records:
        raise DiffarError(f"{path} holds no records")
    if isinstance(records[0], dict) and "prompt_ids" in records[0]:
        return _sequences(records, path)
    if isinstance(records[0], dict) and {"source", "target"} & records[0].keys():
        return Corpus(str(path), "seq2seq", pairs=_pairs(records, path))
    raise DiffarError(f"{path} is JSON Lines whose records have neither \"source\"/\"target\" (pairs) nor "
                      f"\"prompt_ids\"/\"response_ids\" (token records)")


def checkpoint_corpus(meta: dict, name: str | None, split: str, prompts_only: bool = False) -> Corpus:
    """A split of corpus `name`, or else of the one the checkpoint (its `meta`) was trained on, for scoring it.
    Refused: a corpus of another task (seq2seq or continuation), unless only its texts are read as prompts
    (`prompts_only`) by an imported model, which was trained on no corpus of diffar's; and, unless
    `prompts_only`, a user's training file as test data, or a 1-in-20 'valid' slice of any other file."""
    if not (name or meta["corpus"]):
        raise DiffarError("this checkpoint was imported, not trained on a corpus: name one with --corpus")
    corpus = load_corpus(name or meta["corpus"], split)
    if corpus.task != meta["task"] and not (prompts_only and not meta["corpus"]):
        raise DiffarError(f"{corpus.name} is a {corpus.task} corpus but the checkpoint was trained for {meta['task']}")
    if not is_embedded(corpus.name) and not prompts_only:
        own = corpus.name == meta["corpus"]
        if split == "test" and own:
            raise DiffarError(f"{corpus.name} is the training data itself: score its held-out part with --split "
                              f"valid, or pass a separate test file with --corpus")
        if split == "valid" and not own:
            raise DiffarError(f"{corpus.name} is not the checkpoint's training data, so its 'valid' split would be "
                              f"1 record in {HOLDOUT_EVERY} of it: use --split test to score all of it")
    return corpus
