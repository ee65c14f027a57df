"""Sequence-level knowledge distillation data (Kim & Rush 2016, arXiv 1606.07947): the AR teacher's greedy
outputs for the training sources replace the references, so a one-step student learns one consistent
output per source instead of the spread of human references (the standard recipe of non-autoregressive
translation, and of DD1/DD2's one-step generators). A coupled distillation (DD1, arXiv 2412.17153) asks
for the teacher's *sample* instead, the one a given noise per output position determines (`sample_coupled`).

Outputs are appended to a JSONL cache in the run folder as they are made, so an interrupted run resumes
where it stopped and a finished one is reused. Each line carries a key of the prompt and budget it was made
for (and of a sample's sampling settings and noise), so a cache made for other data (another corpus, subset
or canvas layout, sampling or seed) is refused, not reused."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from diffar.decoding.ar import generate
from diffar.decoding.sampling import SamplingConfig
from diffar.errors import DiffarError
from diffar.models.transformer import Transformer


def teacher_outputs(teacher: Transformer, prompts: list[list[int]], budgets: list[int], cache: Path, *,
                    pad_id: int, eos_id: int | None, batch_size: int = 32, sampling: SamplingConfig = SamplingConfig(),
                    noise: list[torch.Tensor] | None = None) -> list[list[int]]:
    """The teacher's greedy continuation of every prompt (at most budgets[i] tokens, ending at eos_id), cached;
    with `noise` (per prompt, (budgets[i],) standard normal), the sample under `sampling` that noise determines."""
    keys = [_key(p, b, None if noise is None else (sampling, noise[i]))
            for i, (p, b) in enumerate(zip(prompts, budgets))]
    done: dict[int, list[int]] = {}
    text = cache.read_text() if cache.exists() else ""
    for line in text.splitlines():
        try:
            record = json.loads(line)
            i, out = int(record["i"]), [int(x) for x in record["out"]]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by an interruption: made again below
        if i >= len(prompts) or record.get("key", keys[i]) != keys[i]:  # caches made before the keys pass
            raise DiffarError(f"{cache} holds teacher outputs for other data; remove it or write elsewhere")
        done[i] = out
    todo = sorted((i for i in range(len(prompts)) if i not in done), key=lambda i: len(prompts[i]))
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache, "a") as f, tqdm(total=len(prompts), initial=len(done), desc="teacher", dynamic_ncols=True) as bar:
        if text and not text.endswith("\n"):
            f.write("\n")  # end a line cut short by an interruption, so the next record starts a line of its own
        for start in range(0, len(todo), batch_size):
            rows = todo[start:start + batch_size]
            budget = max(budgets[i] for i in rows)
            coupled = {} if noise is None else dict(  # a shorter row's noise is padded: its tokens there are cut
                sampling=sampling, noise=torch.stack([F.pad(noise[i], (0, budget - budgets[i])) for i in rows]))
            result = generate(teacher, [prompts[i] for i in rows], budget, pad_id=pad_id, eos_id=eos_id, **coupled)
            for i, out in zip(rows, result.tokens):
                done[i] = out[:budgets[i]]
                f.write(json.dumps({"i": i, "key": keys[i], "out": done[i]}) + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(rows))
    return [done[i] for i in range(len(prompts))]


def _key(prompt: list[int], budget: int, coupled: tuple[SamplingConfig, torch.Tensor] | None = None) -> str:
    """A short fingerprint of one teacher request (a coupled one's: with the sampling settings and noise)."""
    request = [prompt, budget]
    if coupled is not None:
        sampling, noise = coupled
        request += [sampling.temperature, sampling.top_k, sampling.top_p, noise.tolist()]
    return hashlib.sha1(json.dumps(request).encode()).hexdigest()[:16]
