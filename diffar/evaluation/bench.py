"""Speed benchmarks. Each record is one (method, task, batch size) measurement in a shared schema that
later methods (DD2, ReFusion) extend; `diffar bench ...` prints a table and writes the records as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from diffar.checkpoint import load_checkpoint, load_draft
from diffar.data.batching import prompt_ids
from diffar.data.corpora import load_corpus
from diffar.decoding.ar import generate
from diffar.decoding.speculative import DraftModel, PromptLookup, speculative_generate
from diffar.evaluation.hardware import cpu_name


@dataclass
class BenchRecord:
    method: str
    task: str
    batch_size: int
    prompt_tokens: int  # per row (mean)
    new_tokens: int  # per row
    latency_ms: float  # whole batch, prompt in to last token out
    tokens_per_s: float  # all rows' new tokens / latency
    forward_passes: int
    device: str = field(default_factory=cpu_name)
    torch_threads: int = field(default_factory=torch.get_num_threads)
    extra: dict = field(default_factory=dict)


def bench_ar(checkpoint: str, corpus_name: str | None, batch_sizes: list[int], new_tokens: int,
             repeats: int) -> list[BenchRecord]:
    """KV-cached vs uncached greedy AR at a fixed number of new tokens (eos ignored), batch by batch."""
    model, tokenizer, meta = load_checkpoint(checkpoint)
    corpus = load_corpus(corpus_name or meta["corpus"], "test")
    texts = [p.source for p in corpus.pairs] if corpus.task == "seq2seq" else [d[:400] for d in corpus.documents]
    records = []
    for bs in batch_sizes:
        prompts = [prompt_ids(tokenizer, meta["task"], t) for t in (texts * bs)[:bs]]
        for method, use_cache in (("ar", True), ("ar-nocache", False)):
            if use_cache:  # warm-up; the uncached run is long enough to need none
                generate(model, prompts, 8, pad_id=tokenizer.pad_id, eos_id=None)
            times = []
            for _ in range(repeats):
                result = generate(model, prompts, new_tokens, pad_id=tokenizer.pad_id, eos_id=None,
                                  use_cache=use_cache)
                times.append(result.seconds)
            seconds = sorted(times)[len(times) // 2]
            records.append(BenchRecord(
                method=method, task=Path(corpus.name).name, batch_size=bs,
                prompt_tokens=round(sum(map(len, prompts)) / bs), new_tokens=new_tokens,
                latency_ms=round(1000 * seconds, 1), tokens_per_s=round(bs * new_tokens / seconds, 1),
                forward_passes=result.forward_passes))
    return records


def bench_speculative(checkpoint: str, draft: str, corpus_name: str | None, n_prompts: int, new_tokens: int,
                      k: int) -> list[BenchRecord]:
    """Batch-1 greedy AR vs the lossless draft-and-verify peers (prompt lookup, a draft model), one prompt
    after another over the first n test prompts. seq2seq runs stop at eos (at most 2x the source + 16
    tokens); continuation runs make exactly `new_tokens` (eos ignored)."""
    model, tokenizer, meta = load_checkpoint(checkpoint)
    draft_model = load_draft(draft, tokenizer)
    corpus = load_corpus(corpus_name or meta["corpus"], "test")
    if corpus.task == "seq2seq":
        texts, eos = [p.source for p in corpus.pairs[:n_prompts]], tokenizer.eos_id
    else:
        texts, eos = [d[i:i + 300] for d in corpus.documents for i in range(0, len(d) - 300, 5000)][:n_prompts], None
    prompts = [prompt_ids(tokenizer, meta["task"], t) for t in texts]
    budgets = [min(2 * len(p) + 16, new_tokens) if eos is not None else new_tokens for p in prompts]
    methods = {
        "ar": lambda p, n: generate(model, [p], n, pad_id=tokenizer.pad_id, eos_id=eos),
        "ar+prompt-lookup": lambda p, n: speculative_generate(model, PromptLookup(), p, n, k=k, eos_id=eos),
        "ar+draft": lambda p, n: speculative_generate(model, DraftModel(draft_model), p, n, k=k, eos_id=eos),
    }
    records, reference = [], None
    for method, run in methods.items():
        run(prompts[0], 8)  # warm-up
        outs, seconds, passes, drafted, accepted = [], 0.0, 0, 0, 0
        for p, n in zip(prompts, budgets):
            r = run(p, n)
            outs.append(r.tokens[0] if method == "ar" else r.tokens)
            seconds += r.seconds
            passes += r.forward_passes if method == "ar" else r.target_passes
            drafted += getattr(r, "drafted", 0)
            accepted += getattr(r, "accepted", 0)
        reference = reference or outs
        new = sum(map(len, outs))
        records.append(BenchRecord(
            method=method, task=Path(corpus.name).name, batch_size=1,
            prompt_tokens=round(sum(map(len, prompts)) / len(prompts)), new_tokens=round(new / len(prompts)),
            latency_ms=round(1000 * seconds / len(prompts), 1), tokens_per_s=round(new / seconds, 1),
            forward_passes=round(passes / len(prompts)),
            extra={"prompts": len(prompts), "k": k if method != "ar" else None,
                   "tokens_per_ar_pass": round(new / passes, 3),
                   "exact_match_vs_ar": sum(a == b for a, b in zip(outs, reference)) / len(prompts),
                   "draft_acceptance": round(accepted / drafted, 3) if drafted else None}))
    return records


def print_table(records: list[BenchRecord]) -> None:
    base = {r.batch_size: r.tokens_per_s for r in records if r.method == "ar"}
    print(f"{'method':<18}{'task':<13}{'batch':>6}{'prompt':>8}{'new':>6}{'latency ms':>12}{'tok/s':>10}"
          f"{'passes':>8}{'vs ar':>8}")
    for r in records:
        speed = r.tokens_per_s / base[r.batch_size] if r.batch_size in base else float("nan")
        print(f"{r.method:<18}{r.task:<13}{r.batch_size:>6}{r.prompt_tokens:>8}{r.new_tokens:>6}"
              f"{r.latency_ms:>12.1f}{r.tokens_per_s:>10.1f}{r.forward_passes:>8}{speed:>7.2f}x")
        if r.extra:
            print(f"{'':<18}" + ", ".join(f"{k} {v}" for k, v in r.extra.items() if v is not None))
    if records:
        print(f"device: {records[0].device}, torch threads: {records[0].torch_threads}")


def write_records(records: list[BenchRecord], out: str | Path) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in records], indent=2) + "\n")
    print(f"wrote {len(records)} records to {out}")
