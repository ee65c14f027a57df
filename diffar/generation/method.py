"""The one interface every generation method answers, whatever decodes underneath (plain AR, draft-and-verify,
ReFusion, DD2). `diffar generate`, `eval`, every `bench`, `serve` and `loadtest` go through it, so none of
them re-derives what a checkpoint can do, how it reads a prompt or how options become sampling settings.

A method is built from a loaded checkpoint (plus what it works with: a drafter, a judge...), then:
- `prompt(text)` -> the token ids it reads; `room(ids, settings)` -> the most new tokens they leave room for;
- `settings(options)` -> its own sampling settings from `Options`, filled from CLI flags, an HTTP body or a
  bench method name alike (the one place that policy lives);
- `generate(prompts, budgets, settings, ...)` -> a `GenerationResult` for a batch with per-row budgets; every
  new token goes to `on_token(row, token, origin)` (returning False ends that row), DD2's after its last step;
  `origin` says who wrote it (decoding/result.py), as the result's `origins` do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

import torch

from diffar.decoding.ar import TokenCallback
from diffar.decoding.result import GenerationResult
from diffar.errors import DiffarError
from diffar.tokenizer import Tokenizer

# (denoising step i, every row's tokens after it): a multi-step DD2 sample forming; other methods never call it
StepCallback = Callable[[int, list[list[int]]], None]


class OptionError(DiffarError):
    """An option a method cannot honour; `option` names it (the server's error `param`)."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class Options:
    """Every sampling option any method reads; None (or the default) leaves it to the method."""

    temperature: float | None = None  # AR methods: 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    steps: int | None = None  # DD2: denoising steps
    guidance_scale: float | None = None
    preset: str | None = None  # DD2: speed | quality
    tau: float | None = None  # DD2: read-out temperature tau_max
    tau_min: float | None = None
    sampler: str | None = None  # DD2: ddim | ddpm
    adaptive: bool = False  # DD2: steps by canvas length
    best_of: int = 1  # DD2: samples per source, one kept
    domain: str | None = None  # ReFusion: the domain its diffusion stream drafts for (one with a domain adapter)

    def given(self) -> set[str]:
        """The options set to something other than their default."""
        return {f.name for f in fields(self) if getattr(self, f.name) != f.default}


@runtime_checkable
class GenerationMethod(Protocol):
    name: str  # as registered (`diffar.generation.METHODS`)
    label: str  # what it is, with its drafter or schedule (speed lines, bench records)
    tokenizer: Tokenizer
    task: str  # seq2seq | continuation
    options: frozenset[str]  # the `Options` fields its `settings` reads; it ignores the rest
    domains: tuple[str, ...]  # the domains its drafter's domain adapter serves (`Options.domain`); () none

    def prompt(self, text: str) -> list[int]: ...

    def room(self, ids: list[int], settings) -> int: ...

    def fits(self, longest_prompt: int, budget: int) -> bool:
        """Whether rows with this longest prompt and largest budget can share one batch."""

    def settings(self, options: Options): ...

    def generate(self, prompts: list[list[int]], budgets: int | list[int], settings, *,
                 on_token: TokenCallback | None = None, on_step: StepCallback | None = None,
                 generator: torch.Generator | None = None, fixed: list[dict[int, int]] | None = None,
                 ignore_eos: bool = False) -> GenerationResult: ...

    def describe(self, result: GenerationResult, settings) -> tuple[str, str]:
        """(label, account of the passes) of a one-row result, for the speed line."""


def per_row(budgets: int | list[int], rows: int) -> list[int]:
    budgets = [budgets] * rows if isinstance(budgets, int) else list(budgets)
    if len(budgets) != rows or min(budgets) <= 0:
        raise DiffarError(f"give one positive token budget per prompt ({rows}), got {budgets}")
    return budgets


def within_budgets(budgets: list[int], on_token: TokenCallback | None) -> TokenCallback:
    """`on_token` that also ends each row at its own budget."""
    counts = [0] * len(budgets)

    def callback(row: int, token: int, origin: str) -> bool:
        counts[row] += 1
        wanted = on_token is None or on_token(row, token, origin) is not False
        return wanted and counts[row] < budgets[row]

    return callback
