"""One base for diffar's config dataclasses: presets by name, (de)serialisation, validation.

A config is saved inside every checkpoint (`to_dict`) and rebuilt from it (`from_dict`), so a checkpoint
written by an older diffar, with fields since removed, still loads; configs held by another config come
back as configs, not dicts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, fields
from typing import ClassVar

from diffar.errors import DiffarError


class Config:
    """Mixin for a `@dataclass`: `class XConfig(Config, presets=PRESETS, nested={"field": YConfig})`.

    Subclasses list their rules in `checks()`; `__post_init__` rebuilds nested configs, then raises the
    first failed rule's one-line message, which names the field."""

    presets: ClassVar[dict[str, dict]] = {}
    nested: ClassVar[dict[str, type[Config]]] = {}  # fields that hold a config (or None)

    def __init_subclass__(cls, presets: dict[str, dict] | None = None, nested: dict | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if presets is not None:
            cls.presets = presets
        if nested is not None:
            cls.nested = nested

    def __post_init__(self):
        for name, kind in self.nested.items():
            if isinstance(getattr(self, name), dict):
                setattr(self, name, kind.from_dict(getattr(self, name)))
        for ok, message in self.checks():
            if not ok:
                raise DiffarError(message)

    def checks(self) -> Iterable[tuple[bool, str]]:
        """(rule holds, message naming the field) pairs, in the order they are reported."""
        return ()

    def nonnegative(self, *names: str) -> list[tuple[bool, str]]:
        """Checks that each named field is a finite number >= 0."""
        return [(math.isfinite(getattr(self, n)) and getattr(self, n) >= 0,
                 f"{n} must be a number >= 0, got {getattr(self, n)}") for n in names]

    @classmethod
    def preset_settings(cls, name: str) -> dict:
        if name not in cls.presets:
            raise DiffarError(f"unknown preset {name!r}; choose one of {', '.join(cls.presets)}")
        return cls.presets[name]

    @classmethod
    def from_preset(cls, name: str, **overrides):
        return cls(**{**cls.preset_settings(name), **overrides, "preset": name})

    @classmethod
    def from_dict(cls, d: dict):
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)
