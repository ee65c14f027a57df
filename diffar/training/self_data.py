"""A drafter's training data from its target's own outputs: the target answers prompts (greedy), so the drafter
learns to predict exactly what verification will accept (DFlash and EAGLE train on responses their target
regenerated). Prompts come from `data/prompts.py`: instructions the model writes itself (Magpie), standard
library functions to complete, Shakespeare windows, or the model's own training corpus (a seq2seq model's
sources, a continuation model's windows).

Two sources are text recorded as it is, not answered (`TEXT_SOURCES`): Python's standard library (`stdlib`, its
modules' source) and any continuation corpus's train split (`text`), in windows of `max_new_tokens` + 1 tokens.
The drafter learns from such text only where it agrees with the target's greedy chain (models/drafter.on_chain),
which makes any text a drafter's training data at the cost of one target pass, where a response costs a whole
generation.

Records are appended to a JSONL file as they are made (fsynced per batch), so an interrupted run resumes where it
stopped, and one file may gather several sources (record i of each); each holds the exact token ids, which
`load_corpus` reads back as a token corpus for training, and the settings it was made with, which a resumed run
must repeat (record i made under other settings would be another record):
    {"i": 0, "source": "chat", "prompt_ids": [...], "response_ids": [...], "ended": true, "eos_id": 2,
     "tokenizer": "<sha256 of the tokenizer, first 16 digits>", "made_with": {"max_new_tokens": 256, "seed": 0}}
"""

from __future__ import annotations

import json
import os
import random
import sysconfig
from pathlib import Path

import torch
from tqdm import tqdm

from diffar.data.corpora import load_corpus
from diffar.data.prompts import (chat_prefix, chat_prompt, code_prompt, corpus_prompts, source_text,
                                 stdlib_functions, windows)
from diffar.decoding.ar import generate
from diffar.decoding.sampling import SamplingConfig
from diffar.errors import DiffarError
from diffar.models.transformer import Transformer
from diffar.tokenizer import Tokenizer

INSTRUCTION_TOKENS = 96  # the longest self-written instruction
INSTRUCTION_SAMPLING = SamplingConfig(temperature=1.0, top_p=0.95)  # varied, as Magpie samples its queries
TEXT_SOURCES = ("stdlib", "text")  # recorded as they are
SHORTEST_WINDOW = 128  # a document's last window, if shorter (and shorter than a whole one), is left out
PACKAGES = {"site-packages", "dist-packages"}  # under the standard library's folder, but installed, not standard


def _settings(source: str, max_new_tokens: int, seed: int, corpus: str | None) -> dict:
    """What a record of `source` depends on besides its index (the model aside, which its tokenizer tag checks)."""
    made_with: dict = {"max_new_tokens": max_new_tokens}
    if source in ("chat", "stdlib"):
        made_with["seed"] = seed  # the self-written instructions; the order of the modules
    if source == "stdlib":
        made_with["python"] = sysconfig.get_python_version()  # whose standard library
    if source in ("corpus", "text"):
        made_with["corpus"] = corpus
    return made_with


def _read(text: str, out: Path, source: str, tag: str, made_with: dict) -> dict[int, dict]:
    """The records of `source` already in `out` (its `text`), by index. Records of files written before the
    settings were recorded (no "made_with") are taken as they are."""
    done: dict[int, dict] = {}
    for line in text.splitlines():
        try:
            record = json.loads(line)
            i = int(record["i"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by an interruption: made again
        if record.get("tokenizer") != tag:
            raise DiffarError(f"{out} holds another model's data; remove it or write elsewhere")
        if record.get("source") != source:
            continue
        theirs = record.get("made_with", made_with)
        if theirs != made_with:
            differ = ", ".join(f"{k} {theirs.get(k)} (now {v})" for k, v in made_with.items() if theirs.get(k) != v)
            raise DiffarError(f"{out} holds {source} records made with {differ}; repeat those settings to finish "
                              f"them, or write elsewhere")
        done[i] = record
    return done


def _fixed_prompts(source: str, tokenizer: Tokenizer, examples: int, corpus: str | None) -> list[list[int]]:
    if source == "corpus":
        if not corpus:
            raise DiffarError("--source corpus needs a corpus: this model was imported, name one with --corpus")
        prompts, where = corpus_prompts(tokenizer, corpus, examples), f"the train split of {corpus}"
    elif source == "code":
        prompts = [code_prompt(tokenizer, f) for f in stdlib_functions(examples)]
        where = "the standard library's documented functions"
    else:
        prompts = windows(tokenizer, load_corpus("shakespeare", "train").documents, examples)
        where = "the Shakespeare train split's windows"
    if len(prompts) < examples:
        raise DiffarError(f"{where} give {len(prompts)} prompts, fewer than --examples {examples}")
    return prompts


def _text_windows(source: str, tokenizer: Tokenizer, examples: int, length: int, seed: int,
                  corpus: str | None) -> list[list[int]]:
    """The first `examples` windows of `length` tokens of the source's documents (the standard library's modules
    in an order shuffled by `seed`, or a continuation corpus's train split), each document cut from its start."""
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [f for f in sorted(root.rglob("*.py")) if not PACKAGES & set(f.relative_to(root).parts)]
        random.Random(seed).shuffle(files)
        documents = (source_text(f) for f in files)
        where = "Python's standard library"
    else:
        if not corpus:
            raise DiffarError("--source text needs a corpus: this model was imported, name one with --corpus")
        data = load_corpus(corpus, "train")
        if data.documents is None:
            held = "token ids" if data.sequences is not None else "source/target pairs"
            raise DiffarError(f"--source text reads a continuation corpus's text; {corpus} holds {held}")
        documents, where = iter(data.documents), f"the train split of {corpus}"
    out: list[list[int]] = []
    for doc in documents:
        ids = tokenizer.encode(doc)
        out += [ids[a:a + length] for a in range(0, len(ids) - min(length, SHORTEST_WINDOW) + 1, length)]
        if len(out) >= examples:
            return out[:examples]
    raise DiffarError(f"{where} gives {len(out)} windows of {length} tokens, fewer than --examples {examples}")


def self_data(model: Transformer, tokenizer: Tokenizer, source: str, examples: int, out: Path, *,
              max_new_tokens: int = 256, batch_size: int = 8, seed: int = 0, corpus: str | None = None) -> int:
    """Make (or finish making) `examples` records of `source` in `out`; returns how many were made now.
    `corpus`: the corpus of source "corpus" or "text". A text source's records are its windows of
    `max_new_tokens` + 1 tokens (the first one the prompt), made without the model."""
    tag = tokenizer.sha256[:16]  # what `build_dataset` checks the ids against
    text = out.read_text(encoding="utf-8") if out.exists() else ""
    made_with = _settings(source, max_new_tokens, seed, corpus)
    done = _read(text, out, source, tag, made_with)
    todo = [i for i in range(examples) if i not in done]
    texts = _text_windows(source, tokenizer, examples, max_new_tokens + 1, seed, corpus) \
        if source in TEXT_SOURCES and todo else None
    fixed = None if source == "chat" or texts is not None else _fixed_prompts(source, tokenizer, examples, corpus)
    prefix = chat_prefix(tokenizer) if source == "chat" else None
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a", encoding="utf-8") as f, tqdm(total=examples, initial=examples - len(todo), desc=source,
                                                     dynamic_ncols=True) as bar:
        if text and not text.endswith("\n"):
            f.write("\n")  # end a line cut short by an interruption
        for start in range(0, len(todo), batch_size):
            rows = todo[start:start + batch_size]
            if texts is not None:
                made = [(texts[i][:1], texts[i][1:], False) for i in rows]
            else:
                if fixed is None:  # Magpie: the model writes the user's message, seeded by the batch's first record
                    g = torch.Generator().manual_seed(seed * 1_000_003 + rows[0])
                    asked = generate(model, [prefix] * len(rows), INSTRUCTION_TOKENS, pad_id=tokenizer.pad_id,
                                     eos_id=tokenizer.eos_id, sampling=INSTRUCTION_SAMPLING, generator=g)
                    prompts = [chat_prompt(tokenizer, tokenizer.decode(ids).strip()) for ids in asked.tokens]
                else:
                    prompts = [fixed[i] for i in rows]
                answers = generate(model, prompts, max_new_tokens, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id)
                made = list(zip(prompts, answers.tokens, answers.ended))
            for i, (prompt, response, ended) in zip(rows, made):
                f.write(json.dumps({"i": i, "source": source, "prompt_ids": prompt, "response_ids": response,
                                    "ended": ended, "eos_id": tokenizer.eos_id, "tokenizer": tag,
                                    "made_with": made_with}) + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(rows))
    return len(todo)
