"""Byte-level BPE tokenizer (HF `tokenizers`) with diffar's special tokens, or an imported model's own.

Byte-level pre-tokenisation without normalisation makes decode(encode(text)) == text for any string.
An imported model's tokenizer names its own special tokens and may carry a chat template; both live in
`<name>_config.json` next to `<name>.json` (for `tokenizer.json`, Hugging Face's `tokenizer_config.json`).
`encode_chat` renders a conversation through that template (diffar/chat_template.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from diffar.chat_template import ChatTemplate, mark_literal, split_specials
from diffar.errors import DiffarError

ROLES = ("pad", "bos", "eos", "sep", "mask")
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<sep>", "<mask>")  # diffar's own, one per role


class Tokenizer:
    """A thin wrapper that knows the special-token ids and a content hash checkpoints record.

    `specials` maps roles (pad, bos, eos, sep, mask) to the tokens that play them: diffar's own by default.
    An imported model names its own and may lack some roles (bos, sep, mask: their ids are then None);
    pad and eos every decoder needs. `chat_template` is the model's Jinja chat template, if it has one.
    """

    def __init__(self, hf: HFTokenizer, specials: dict[str, str | None] | None = None,
                 chat_template: str | None = None):
        own = specials is None
        self.specials = dict(zip(ROLES, SPECIAL_TOKENS)) if own else {r: specials[r] for r in ROLES if specials.get(r)}
        missing = [t for t in self.specials.values() if hf.token_to_id(t) is None]
        if missing:
            hint = "; train one with `diffar tokenizer train`" if own else ""
            raise DiffarError(f"tokenizer lacks special tokens {missing}{hint}")
        if "pad" not in self.specials or "eos" not in self.specials:
            raise DiffarError("tokenizer names no pad or no end-of-sequence token")
        self.hf, self.chat_template, self._chat = hf, chat_template, None
        self.hf.encode_special_tokens = True  # "<sep>" typed by a user is text, not the separator
        self.pad_id, self.bos_id, self.eos_id, self.sep_id, self.mask_id = (
            hf.token_to_id(self.specials[r]) if r in self.specials else None for r in ROLES)

    @property
    def own_specials(self) -> bool:
        """True for diffar's own special tokens (then no `_config.json` is written or needed)."""
        return self.specials == dict(zip(ROLES, SPECIAL_TOKENS)) and self.chat_template is None

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

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """A conversation ({"role", "content"} dicts) rendered by the model's chat template, as ids: the special
        tokens the template writes become their ids, those typed in a message stay text. With
        `add_generation_prompt` it ends where the assistant's answer begins."""
        if self.chat_template is None:
            raise DiffarError("this model has no chat template (only an imported chat model has one)")
        if self._chat is None:
            self._chat = ChatTemplate(self.chat_template, {f"{r}_token": t for r, t in self.specials.items()})
        specials = {t.content: i for i, t in self.hf.get_added_tokens_decoder().items() if t.special}
        marked = [{**m, "content": mark_literal(m["content"], specials)} for m in messages]
        pieces = split_specials(self._chat.render(marked, add_generation_prompt), specials)
        return [i for p in pieces for i in ([p] if isinstance(p, int) else self.encode(p))]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def decode_complete(self, ids: Iterable[int]) -> str | None:
        """The text of `ids` as it is safe to show while more tokens come: None while it ends in half of a
        multi-byte character (byte-level BPE splits characters across tokens)."""
        text = self.decode(ids)
        return None if text.endswith("\ufffd") else text

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.hf.save(str(path))
        if not self.own_specials:
            config = {f"{role}_token": token for role, token in self.specials.items()}
            config.update(chat_template=self.chat_template, tokenizer_class="PreTrainedTokenizerFast")
            config_path(path).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    @classmethod
    def from_str(cls, text: str, config: dict | None = None) -> Tokenizer:
        """A tokenizer from its JSON text and, for an imported model's, its `_config.json` contents."""
        specials = None if config is None else {r: config.get(f"{r}_token") for r in ROLES}
        return cls(HFTokenizer.from_str(text), specials, None if config is None else config.get("chat_template"))

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        try:
            config = config_path(path).read_text(encoding="utf-8") if config_path(path).is_file() else None
            return cls.from_str(Path(path).read_text(encoding="utf-8"), None if config is None else json.loads(config))
        except DiffarError:
            raise
        except (OSError, UnicodeDecodeError) as e:
            raise DiffarError(f"cannot read tokenizer {path}: {e.strerror if isinstance(e, OSError) else e}") from e
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise DiffarError(f"{path} is not a valid tokenizer file (or its {config_path(path).name})") from e


def config_path(path: str | Path) -> Path:
    """Where a tokenizer file's special tokens and chat template live: `tokenizer.json` -> `tokenizer_config.json`."""
    path = Path(path)
    return path.with_name(f"{path.stem}_config.json")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE on an iterator of strings."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise DiffarError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (256 bytes + specials)")
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
