"""Byte-level BPE tokenizer (HF `tokenizers`) with diffar's special tokens.

Byte-level pre-tokenisation without normalisation makes decode(encode(text)) == text for any string.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from diffar.errors import DiffarError

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<sep>", "<mask>")


class Tokenizer:
    """A thin wrapper that knows diffar's special-token ids and a content hash checkpoints record."""

    def __init__(self, hf: HFTokenizer):
        missing = [t for t in SPECIAL_TOKENS if hf.token_to_id(t) is None]
        if missing:
            raise DiffarError(f"tokenizer lacks special tokens {missing}; train one with `diffar tokenizer train`")
        self.hf = hf
        self.hf.encode_special_tokens = True  # "<sep>" typed by a user is text, not the separator
        self.pad_id, self.bos_id, self.eos_id, self.sep_id, self.mask_id = (hf.token_to_id(t) for t in SPECIAL_TOKENS)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.hf.to_str().encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.hf.save(str(path))

    @classmethod
    def from_str(cls, text: str) -> Tokenizer:
        return cls(HFTokenizer.from_str(text))

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        try:
            return cls.from_str(Path(path).read_text(encoding="utf-8"))
        except DiffarError:
            raise
        except (OSError, UnicodeDecodeError) as e:
            raise DiffarError(f"cannot read tokenizer {path}: {e.strerror if isinstance(e, OSError) else e}") from e
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise DiffarError(f"{path} is not a valid tokenizer file") from e


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE on an iterator of strings."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise DiffarError(f"--vocab-size must be at least {256 + len(SPECIAL_TOKENS)} (256 bytes + specials)")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf)
