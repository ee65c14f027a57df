"""Speed benchmarks. Each record is one (method, task, batch size) measurement in a shared schema that
later methods (DD2, ReFusion) extend; `diffar bench ...` prints a table and writes the records as JSON."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from diffar.checkpoint import DTYPES, ar_stream, load_ar, load_checkpoint
from diffar.data.batching import ar_prompt, prompt_ids
from diffar.data.corpora import load_corpus
from diffar.decoding.ar import generate
from diffar.decoding.dd2 import DD2Sampling, best_of_generate, dd2_generate, hybrid_generate
from diffar.decoding.refusion import DraftSchedule, refusion_generate
from diffar.decoding.speculative import DraftModel, PromptLookup, speculative_generate
from diffar.errors import DiffarError
from diffar.evaluation.hardware import cpu_name
from diffar.evaluation.metrics import conditional_perplexity, repetition, text_metrics


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
    dtype: str = "fp32"  # the models' type at inference
    extra: dict = field(default_factory=dict)


def bench_ar(checkpoint: str, corpus_name: str | None, batch_sizes: list[int], new_tokens: int,
             repeats: int, dtype: str = "fp32") -> list[BenchRecord]:
    """KV-cached vs uncached greedy AR at a fixed number of new tokens (eos ignored), batch by batch, each
    after one warm-up run of the same size; the median of `repeats` runs."""
    model, tokenizer, meta = load_checkpoint(checkpoint, dtype=DTYPES[dtype])
    model = ar_stream(model)
    corpus = load_corpus(corpus_name or meta["corpus"], "test")
    texts = [p.source for p in corpus.pairs] if corpus.task == "seq2seq" else [d[:400] for d in corpus.documents]
    records = []
    for bs in batch_sizes:
        prompts = [prompt_ids(tokenizer, meta["task"], t) for t in (texts * bs)[:bs]]
        for method, use_cache in (("ar", True), ("ar-nocache", False)):
            # a whole warm-up run: the first pass at each new length sets up its kernels (in bf16 here, the
            # first 256-token run took seconds), which is not what a cached step costs
            generate(model, prompts, new_tokens, pad_id=tokenizer.pad_id, eos_id=None, use_cache=use_cache)
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
                forward_passes=result.forward_passes, dtype=dtype))
    return records


def _prompts(corpus, n_prompts: int) -> tuple[list[str], list[str]]:
    """(prompts, references): seq2seq sources and targets; continuation windows of 300 characters from the
    corpus's works and the text that really follows them."""
    if corpus.task == "seq2seq":
        pairs = corpus.pairs[:n_prompts]
        return [p.source for p in pairs], [p.target for p in pairs]
    starts = [(d, i) for d in corpus.documents for i in range(0, len(d) - 1500, 5000)][:n_prompts]
    return [d[i:i + 300] for d, i in starts], [d[i + 300:i + 1500] for d, i in starts]


def bench_lossless(checkpoint: str, draft: str | None, corpus_name: str | None, n_prompts: int, new_tokens: int,
                   k: int, batch_sizes: list[int], methods: list[str], plan_threshold: float = 0.9, plan_slot: int = 1,
                   split: str = "test") -> list[BenchRecord]:
    """Greedy AR against the draft-and-verify methods, all verifying with the same AR weights (a ReFusion
    checkpoint's AR stream, or an AR checkpoint), on the same prompts in the same batches, from `split`
    (valid when comparing training choices). All are lossless but `refusion-infill` (plan-and-infill,
    keeping diffusion drafts at least `plan_threshold` confident, in slots of `plan_slot` tokens).

    seq2seq runs stop at eos (at most 2x the longest source of the batch + 16 tokens); continuation runs
    make exactly `new_tokens` (eos ignored). Outputs are scored against the references (the real
    continuation, for continuation) and compared with plain AR's token for token.
    """
    model, tokenizer, meta = load_checkpoint(checkpoint)
    ar = ar_stream(model)
    if any(m.startswith("refusion") for m in methods) and meta["kind"] != "refusion":
        raise DiffarError(f"{checkpoint} is an AR checkpoint; the refusion methods need a ReFusion one")
    draft_model = load_ar(draft, tokenizer, "--draft") if "ar+draft" in methods else None
    corpus = load_corpus(corpus_name or meta["corpus"], split)
    texts, references = _prompts(corpus, n_prompts)
    if not texts:
        raise DiffarError(f"{corpus.name} gives no {split} prompts")
    eos = tokenizer.eos_id if corpus.task == "seq2seq" else None
    prompts = [prompt_ids(tokenizer, meta["task"], t) for t in texts]
    words = [len(t.split()) for t in texts]
    k_refusion = min(k, model.config.block) if meta["kind"] == "refusion" else k  # it drafts `block` per pass
    runners = {
        "ar": lambda ps, n, w: generate(ar, ps, n, pad_id=tokenizer.pad_id, eos_id=eos),
        "ar+prompt-lookup": lambda ps, n, w: speculative_generate(ar, PromptLookup(), ps, n, k=k, eos_id=eos),
        "ar+draft": lambda ps, n, w: speculative_generate(ar, DraftModel(draft_model), ps, n, k=k, eos_id=eos),
        "refusion": lambda ps, n, w: refusion_generate(model, ps, n, k=k_refusion, eos_id=eos),
        "refusion-dynamic": lambda ps, n, w: refusion_generate(model, ps, n, k=k_refusion, eos_id=eos, prompt_words=w,
                                                               schedule=DraftSchedule(dynamic=True)),
        "refusion-infill": lambda ps, n, w: refusion_generate(model, ps, n, k=k_refusion, eos_id=eos,
                                                              schedule=DraftSchedule(plan_threshold=plan_threshold,
                                                                                     plan_slot=plan_slot)),
    }
    unknown = set(methods) - set(runners)
    if unknown:
        raise DiffarError(f"unknown method(s) {', '.join(sorted(unknown))}; choose from {', '.join(runners)}")
    records = []
    for bs in batch_sizes:
        batches = [range(i, min(i + bs, len(prompts))) for i in range(0, len(prompts), bs)]
        reference_outputs = None
        for method in methods:
            run = runners[method]
            run([prompts[i] for i in batches[0]], 8, [words[i] for i in batches[0]])  # warm-up
            outs, seconds, passes, row_passes, draft_passes, drafted, accepted = [], 0.0, 0, 0, 0, 0, 0
            for rows in batches:
                batch = [prompts[i] for i in rows]
                budget = min(2 * max(map(len, batch)) + 16, new_tokens) if eos is not None else new_tokens
                r = run(batch, budget, [words[i] for i in rows])
                ar_passes = r.forward_passes if method == "ar" else r.target_passes
                outs += r.tokens
                seconds += r.seconds
                passes, row_passes = passes + ar_passes, row_passes + ar_passes * len(rows)
                draft_passes += getattr(r, "draft_passes", 0)
                drafted, accepted = drafted + getattr(r, "drafted", 0), accepted + getattr(r, "accepted", 0)
            reference_outputs = reference_outputs or outs
            new = sum(map(len, outs))
            quality = text_metrics([tokenizer.decode(o).strip() for o in outs], references)
            records.append(BenchRecord(
                method=method, task=Path(corpus.name).name, batch_size=bs,
                prompt_tokens=round(sum(map(len, prompts)) / len(prompts)), new_tokens=round(new / len(prompts)),
                latency_ms=round(1000 * seconds / len(batches), 1), tokens_per_s=round(new / seconds, 1),
                forward_passes=round(passes / len(batches)),
                extra={"split": split, "prompts": len(prompts),
                       "plan_threshold": plan_threshold if method == "refusion-infill" else None,
                       "plan_slot": plan_slot if method == "refusion-infill" else None,
                       "k": None if method == "ar" else k_refusion if method.startswith("refusion") else k,
                       "tokens_per_ar_pass": round(new / row_passes, 3),
                       "draft_passes": round(draft_passes / len(batches)) if method != "ar" else None,
                       "draft_acceptance": round(accepted / drafted, 3) if drafted else None,
                       "exact_match_vs_ar": sum(a == b for a, b in zip(outs, reference_outputs)) / len(outs),
                       "bleu4": quality["bleu4"], "rougeL": quality["rougeL"]}))
    return records


DD2_METHODS = {  # name -> sampling (None: plain AR); dd2-hybrid: one step for 50 tokens, then AR; and dd2-N
    "ar": None, "dd2-adaptive": DD2Sampling(adaptive=True), "dd2-hybrid": DD2Sampling(steps=1),
    "dd2-speed": DD2Sampling.from_preset("speed"), "dd2-quality": DD2Sampling.from_preset("quality"),
}


def dd2_method(name: str) -> DD2Sampling | None:
    """The sampling a bench method name stands for: one of DD2_METHODS, dd2-N (N DDIM steps), dd2-NxK (the
    best of K N-step samples by the AR model) or dd2-NxK-self (by the generator's own decoder)."""
    if name in DD2_METHODS:
        return DD2_METHODS[name]
    match = re.fullmatch(r"dd2-([0-9]+)(?:x([0-9]+)(-self)?)?", name)
    if match and int(match[1]) > 0 and int(match[2] or 1) > 0:
        return DD2Sampling(steps=int(match[1]), best_of=int(match[2] or 1))
    raise DiffarError(f"unknown method {name!r}; choose dd2-N (N sampling steps), dd2-NxK (the AR model's pick of "
                      f"K N-step samples), dd2-NxK-self (the decoder's own pick) or {', '.join(DD2_METHODS)}")


def bench_dd2(checkpoint: str, ar_checkpoint: str, corpus_name: str | None, n_prompts: int, new_tokens: int,
              batch_sizes: list[int], methods: list[str], seed: int = 0, split: str = "test",
              dtype: str = "fp32") -> list[BenchRecord]:
    """Greedy AR (KV cache) against DD2 sampling with 1/30/50/100 steps, the seed's presets and hybrid
    sampling, on the same prompts in the same batches, from `split` (valid when comparing training choices,
    so that no choice is tuned on the test split). seq2seq: the sources, AR stops at eos (at most
    2x the longest source + 16 tokens), DD2 fills its canvas; continuation: exactly `new_tokens` per row from
    every method (DD2 canvas after canvas). Quality: BLEU-4, chrF and ROUGE-L against the references, and for
    continuation the AR model's perplexity of each method's output and its repetition (seq-rep-4). `dtype`
    applies to both models (the baseline's speed and text change with it too)."""
    model, tokenizer, meta = load_checkpoint(checkpoint, dtype=DTYPES[dtype])
    if meta["kind"] != "dd2":
        raise DiffarError(f"{checkpoint} is a {meta['kind']} checkpoint; bench dd2 needs a DD2 one")
    ar = load_ar(ar_checkpoint, tokenizer, "--ar", task=meta["task"], dtype=DTYPES[dtype])
    samplings = {method: dd2_method(method) for method in methods}
    corpus = load_corpus(corpus_name or meta["corpus"], split)
    if corpus.task != meta["task"]:
        raise DiffarError(f"{corpus.name} is a {corpus.task} corpus but the checkpoint was trained for {meta['task']}")
    texts, references = _prompts(corpus, n_prompts)
    if not texts:
        raise DiffarError(f"{corpus.name} gives no {split} prompts")
    seq2seq = corpus.task == "seq2seq"
    eos = tokenizer.eos_id if seq2seq else None
    prompts = [prompt_ids(tokenizer, meta["task"], t) for t in texts]
    fits = [not seq2seq or len(p) - 1 <= model.config.max_source_len for p in prompts]
    if not all(fits):  # sources longer than the denoiser reads are left out for every method alike
        print(f"note: {fits.count(False)} {split} sources longer than {model.config.max_source_len} tokens left out")
        prompts, references = [p for p, ok in zip(prompts, fits) if ok], [r for r, ok in zip(references, fits) if ok]
        if not prompts:
            raise DiffarError(f"no {split} source of {corpus.name} fits the model's "
                              f"{model.config.max_source_len} tokens")
    sources = [p[:-1] if seq2seq else p[-model.config.vqvae.prompt_len:] for p in prompts]
    judged = [ar_prompt(tokenizer, meta["task"], s) for s in sources]  # the judge reads what the generator reads
    records = []
    for bs in batch_sizes:
        batches = [range(i, min(i + bs, len(prompts))) for i in range(0, len(prompts), bs)]
        for method in methods:
            sampling = samplings[method]
            judge = None if method.endswith("-self") else ar  # who picks among best_of samples
            generator = torch.Generator().manual_seed(seed)

            def run(rows, n):
                if sampling is None:
                    return generate(ar, [prompts[i] for i in rows], n, pad_id=tokenizer.pad_id, eos_id=eos)
                decode = dict(sampling=sampling, eos_id=eos, pad_id=tokenizer.pad_id, generator=generator)
                if method == "dd2-hybrid":
                    return hybrid_generate(model, ar, [sources[i] for i in rows], [prompts[i] for i in rows], n,
                                           **decode)
                if sampling.best_of > 1:
                    return best_of_generate(model, judge, [sources[i] for i in rows], [judged[i] for i in rows], n,
                                            **decode)
                return dd2_generate(model, [sources[i] for i in rows], n, **decode)

            run(batches[0], 8)  # warm-up
            outs, seconds, passes, steps, taus = [], 0.0, 0, [], []
            for rows in batches:
                budget = min(2 * max(len(prompts[i]) for i in rows) + 16, new_tokens) if seq2seq else new_tokens
                r = run(rows, budget)
                outs += r.tokens
                seconds, passes = seconds + r.seconds, passes + r.forward_passes
                steps.append(getattr(r, "steps", None))
                taus.append(round(r.tau, 4) if hasattr(r, "tau") else None)
            new = sum(map(len, outs))
            quality = text_metrics([tokenizer.decode(o).strip() for o in outs], references)
            extra = {"split": split, "prompts": len(prompts), "steps": steps[0] if len(set(steps)) == 1 else "adaptive",
                     "best_of": sampling.best_of if sampling else None,
                     "judge": ("decoder" if judge is None else "ar") if sampling and sampling.best_of > 1 else None,
                     "guidance_scale": sampling.guidance_scale if sampling else None,
                     "tau_max": sampling.tau_max if sampling else None,
                     "tau": taus[0] if len(set(taus)) == 1 else "adaptive", **quality}
            if not seq2seq:
                extra["ar_perplexity"] = round(conditional_perplexity(ar, [prompts[i] for i in range(len(outs))],
                                                                      outs), 2)
                extra["seq_rep4"] = round(repetition(outs), 1)
            records.append(BenchRecord(
                method=method, task=Path(corpus.name).name, batch_size=bs,
                prompt_tokens=round(sum(map(len, prompts)) / len(prompts)), new_tokens=round(new / len(prompts)),
                latency_ms=round(1000 * seconds / len(batches), 1), tokens_per_s=round(new / seconds, 1),
                forward_passes=round(passes / len(batches)), dtype=dtype, extra=extra))
    return records


def print_table(records: list[BenchRecord]) -> None:
    base = {(r.task, r.batch_size): r.tokens_per_s for r in records if r.method == "ar"}
    print(f"{'method':<18}{'task':<13}{'batch':>6}{'prompt':>8}{'new':>6}{'latency ms':>12}{'tok/s':>10}"
          f"{'passes':>8}{'vs ar':>8}")
    for r in records:
        speed = r.tokens_per_s / base[r.task, r.batch_size] if (r.task, r.batch_size) in base else float("nan")
        print(f"{r.method:<18}{r.task:<13}{r.batch_size:>6}{r.prompt_tokens:>8}{r.new_tokens:>6}"
              f"{r.latency_ms:>12.1f}{r.tokens_per_s:>10.1f}{r.forward_passes:>8}{speed:>7.2f}x")
        if r.extra:
            print(f"{'':<18}" + ", ".join(f"{k} {v}" for k, v in r.extra.items() if v is not None))
    if records:
        print(f"device: {records[0].device}, torch threads: {records[0].torch_threads}, dtype: {records[0].dtype}")


def write_records(records: list[BenchRecord], out: str | Path) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in records], indent=2) + "\n")
    print(f"wrote {len(records)} records to {out}")
