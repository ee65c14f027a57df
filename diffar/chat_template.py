"""A chat model's conversation -> the text it reads, rendered by the model's own Jinja chat template the way
Hugging Face transformers renders it (`apply_chat_template`): a sandboxed environment with `trim_blocks` and
`lstrip_blocks`, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, and the template
variables `messages`, `add_generation_prompt` and the special tokens (`bos_token`, `eos_token`, ...).

Templates come with downloaded models, so they are untrusted code: the sandbox is immutable (no attribute or
item writes, no dunder access). The template decides where BOS goes; nothing else adds one (transformers
encodes the rendered text with `add_special_tokens=False` too), so a template that writes `{{ bos_token }}`
gets exactly one.

A special token typed inside a message is text, not a control token (transformers'
`sanitize_control_tokens=True`): `mark_literal` brackets it before rendering, and `split_specials` then
tells the template's own special tokens from the marked ones.
"""

from __future__ import annotations

import json
import re
from datetime import datetime

from diffar.errors import DiffarError

ROLES = ("system", "user", "assistant")
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use code points: brackets around a special token typed as text


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """Jinja's own `tojson` escapes HTML characters; chat templates expect plain JSON."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template; `tokens` maps template variable names (`bos_token`...) to token text."""

    def __init__(self, source: str, tokens: dict[str, str]):
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise DiffarError(f"the model's chat template does not compile: {e}") from None
        self.tokens = dict(tokens)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as the model reads it; with `add_generation_prompt`, up to where its answer begins."""
        from jinja2 import TemplateError

        if not messages:
            raise DiffarError("a conversation needs at least one message")
        for m in messages:
            if m.get("role") not in ROLES:
                raise DiffarError(f"unknown role {m.get('role')!r}; a message's role is one of {', '.join(ROLES)}")
        try:
            return self.template.render(messages=[dict(m) for m in messages],
                                        add_generation_prompt=add_generation_prompt, **self.tokens)
        except TemplateError as e:  # the template's own raise_exception ("roles must alternate"...) included
            raise DiffarError(f"the model's chat template refuses this conversation: {e}") from None


def mark_literal(text: str, specials: dict[str, int]) -> str:
    """`text` with every special token in it bracketed, so `split_specials` reads it as text."""
    if not specials:
        return text
    return _pattern(specials).sub(lambda m: _OPEN + m.group(0) + _CLOSE, text)


def split_specials(text: str, specials: dict[str, int]) -> list[str | int]:
    """Rendered text as pieces to encode one by one: plain text (str) and the ids of the special tokens the
    template wrote (int). A bracketed special token (from `mark_literal`) is a text piece of its own, without
    its brackets (as transformers' `sanitize_control_tokens` encodes it)."""
    if not specials:
        return [text]
    tokens = _pattern(specials).pattern
    pattern = re.compile(f"{re.escape(_OPEN)}({tokens}){re.escape(_CLOSE)}|({tokens})")
    pieces: list[str | int] = []
    at = 0
    for m in pattern.finditer(text):
        pieces += [text[at:m.start()]] if m.start() > at else []
        pieces.append(m.group(1) if m.group(1) is not None else specials[m.group(2)])
        at = m.end()
    return pieces + ([text[at:]] if at < len(text) else [])


def _pattern(specials: dict[str, int]) -> re.Pattern:
    # longest first, so a token that begins another (<|im_start|> vs <|im_start|>x) is matched whole
    return re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
