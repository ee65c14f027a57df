"""Speed benchmarks. Each record is one (method, task, batch size) measurement in a shared schema that
later methods (DD2, ReFusion) extend; `diffar bench ...` prints a table and writes the records as JSON."""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Collection

import torch
from tqdm import tqdm

from diffar.checkpoint import ar_stream, load_ar, load_for_inference, read_meta, target_path
from diffar.data.corpora import checkpoint_corpus, domain_name
from diffar.decoding.datastore import Datastore, load_datastore
from diffar.decoding.refusion import DraftSchedule
from diffar.decoding.result import GenerationResult
from diffar.decoding.speculative import DraftModel, PromptLookup
from diffar.errors import DiffarError
from diffar.evaluation.hardware import cpu_name, memory_bandwidth, weight_bytes_per_step
from diffar.evaluation.metrics import conditional_perplexity, repetition, text_metrics, unigram_entropy
from diffar.data.prompts import prompt_set as prompt_set_ids
from diffar.decoding.sampling import SamplingConfig
from diffar.evaluation.peers import PEERS, transformers_generate, transformers_llama, transformers_version
from diffar.generation import ARMethod, DD2Method, GenerationMethod, Options, RefusionMethod, compile_models
from diffar.models.precision import compile_decode, draft_dtype
from diffar.models.refusion import RefusionModel


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
    date: str = field(default_factory=lambda: datetime.date.today().isoformat())  # when it was measured


def _batches(n: int, batch_size: int) -> list[range]:
    return [range(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


Runner = Callable[[range], GenerationResult]  # a method over one batch's rows


def _interleaved(runners: dict[str, Runner], batches: list[range], warm_every: Collection[str] = ()
                 ) -> dict[str, list[GenerationResult]]:
    """Each runner over every batch, interleaved: batch i is run by every runner in turn, the order rotating from
    batch to batch, so that a host whose speed drifts over minutes (shared cores, clocks: this project's 2-core
    machine ran the same bench 30 % faster a few minutes later) slows every method alike, not those that happened
    to run last. Each runner first warms up on the first batch, as a pass at a new shape sets up its kernels, which
    is not what decoding costs; those in `warm_every` (compiled methods) on every batch, as a prompt or block of a
    new kind (longer caches, no drafts) makes a graph of its own."""
    results: dict[str, list[GenerationResult]] = {name: [] for name in runners}
    names = list(runners)
    for i, rows in enumerate(tqdm(batches, desc=f"{len(names)} methods", unit="batch", leave=False,
                                  dynamic_ncols=True)):
        for name in names[i % len(names):] + names[:i % len(names)]:
            if i == 0 or name in warm_every:
                runners[name](rows)
            results[name].append(runners[name](rows))
    return results


def _runner(method: GenerationMethod, settings, prompts: list[list[int]], budget, *,
            generator: torch.Generator | None = None, ignore_eos: bool = False) -> Runner:
    """`method` over a batch of the prompts, `budget(rows)` new tokens each."""
    return lambda rows: method.generate([prompts[i] for i in rows], budget(rows), settings, generator=generator,
                                        ignore_eos=ignore_eos)


def _compiled(methods: dict[str, GenerationMethod | None]) -> set[str]:
    """The methods to warm up on every batch: compiled ones (each new kind of pass makes a graph)."""
    return {name for name, method in methods.items() if getattr(method, "compiled", False)}


def _chosen(results: list[GenerationResult]) -> int:
    """Tokens the AR model chose, each row's end token included (choosing it took a pass): plain AR makes one a
    pass."""
    return sum(r.new_tokens + sum(r.ended) for r in results)


def _passes(results: list[GenerationResult], kind: str) -> int:
    return sum(r.passes.get(kind, 0) for r in results)


def _step_seconds(results: list[GenerationResult]) -> float:
    """Plain AR's seconds per step (per pass of the target)."""
    return sum(r.seconds for r in results) / _passes(results, "target")


def _draft_cost(results: list[GenerationResult], step_s: float | None) -> float | None:
    """A drafting pass's seconds relative to a plain AR step at the same batch size (None: nothing timed)."""
    draft_s, passes = sum(r.extra.get("draft_seconds", 0) for r in results), _passes(results, "draft")
    return round(draft_s / passes / step_s, 3) if draft_s and passes and step_s else None


def _record(method: str, task: str, prompts: list[list[int]], results: list[GenerationResult], **fields) -> BenchRecord:
    """A record of a method's run over every prompt: per-batch means of latency and passes."""
    seconds, new = sum(r.seconds for r in results), sum(r.new_tokens for r in results)
    return BenchRecord(method=method, task=task, batch_size=fields.pop("batch_size"),
                       prompt_tokens=round(sum(map(len, prompts)) / len(prompts)),
                       new_tokens=round(new / len(prompts)), latency_ms=round(1000 * seconds / len(results), 1),
                       tokens_per_s=round(new / seconds, 1),
                       forward_passes=round(sum(r.forward_passes for r in results) / len(results)), **fields)


def bench_ar(checkpoint: str, corpus_name: str | None, batch_sizes: list[int], new_tokens: int,
             repeats: int, dtype: str = "fp32", methods: tuple[str, ...] = ("ar", "ar-nocache"),
             peer: str | None = None, device: str = "cpu") -> list[BenchRecord]:
    """KV-cached vs uncached greedy AR (and the cached one with its step compiled, "ar-compile") at a fixed
    number of new tokens (eos ignored), batch by batch, each after one warm-up run of the same size (a whole
    run: the first pass at each new length sets up its kernels, and ar-compile compiles; its seconds are
    recorded as warm_up_s); the median of `repeats` runs, taken in turns
    (method after method, so that a neighbour's load on a shared machine falls on every method alike).

    `peer` ("transformers") adds transformers' `generate` on the same weights, prompts and lengths, with the
    share of its rows whose greedy text equals diffar's (ar-compile's is compared alike). Every record carries
    the memory-bandwidth ceiling: bandwidth / bytes of weights a step reads, times the batch (one step reads the
    weights once for all rows).
    Prompts: seq2seq sources, or 300-character windows of the continuation corpus's test works."""
    if peer is not None and peer not in PEERS:
        raise DiffarError(f"unknown peer {peer!r}; choose one of {', '.join(PEERS)}")
    model, tokenizer, meta = load_for_inference(checkpoint, dtype=dtype, device=device)
    corpus = checkpoint_corpus(meta, corpus_name, "test", prompts_only=True)
    texts = [p.source for p in corpus.pairs] if corpus.task == "seq2seq" else _prompts(corpus, max(batch_sizes))[0]
    model = ar_stream(model)
    base = ARMethod(model, tokenizer, meta["task"])
    runners = {name: ARMethod(model, tokenizer, meta["task"], use_cache=name == "ar") for name in methods
               if name != "ar-compile"}
    if "ar-compile" in methods:  # a second copy of the weights, so that "ar" stays the eager decoder
        compiled = ar_stream(load_for_inference(checkpoint, dtype=dtype, device=device)[0])
        compile_decode(compiled)
        runners["ar-compile"] = ARMethod(compiled, tokenizer, meta["task"], compiled=True)
    if peer:
        hf = transformers_llama(model, tokenizer.pad_id)
        runners[peer] = lambda prompts: transformers_generate(hf, prompts, new_tokens, tokenizer.pad_id)
    bandwidth = memory_bandwidth()
    weights = weight_bytes_per_step(model)
    records = []
    for bs in batch_sizes:
        prompts = [base.prompt(t) for t in (texts * bs)[:bs]]
        runs, warm_up = {name: [] for name in runners}, {}
        for i in range(repeats + 1):  # the first round warms up (and compiles)
            for name, runner in runners.items():
                result = runner(prompts) if name == peer else runner.generate(
                    prompts, new_tokens, runner.settings(Options()), ignore_eos=True)
                if i:
                    runs[name].append(result)
                else:
                    warm_up[name] = result.seconds
        ceiling = bs * bandwidth * 1e9 / weights
        for name, results in runs.items():
            median = sorted(results, key=lambda r: r.seconds)[len(results) // 2]
            extra = {"bandwidth_gb_s": round(bandwidth, 1), "weight_mb_per_step": round(weights / 1e6, 1),
                     "ceiling_tokens_per_s": round(ceiling, 1), "device_kind": device,
                     "warm_up_s": round(warm_up[name], 2)}
            if name == peer:
                extra["peer"] = f"transformers {transformers_version()} generate (sdpa, greedy)"
            if name in (peer, "ar-compile") and "ar" in runs:  # greedy text against the eager decoder's
                reference = runs["ar"][0].tokens
                extra["identical_rows"] = round(sum(a == b for a, b in zip(median.tokens, reference)) / bs, 3)
                extra["tokens_before_first_difference"] = round(sum(_agree(a, b) for a, b in zip(
                    median.tokens, reference)) / bs, 1)
            records.append(_record(name, Path(corpus.name).name, prompts, [median], batch_size=bs, dtype=dtype,
                                   extra=extra))
            records[-1].extra["share_of_ceiling"] = round(records[-1].tokens_per_s / ceiling, 3)
    return records


def _agree(a: list[int], b: list[int]) -> int:
    """How many tokens two outputs share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _prompts(corpus, n_prompts: int) -> tuple[list[str], list[str]]:
    """(prompts, references): seq2seq sources and targets; continuation windows of 300 characters from the
    corpus's works and the text that really follows them."""
    if corpus.task == "seq2seq":
        pairs = corpus.pairs[:n_prompts]
        return [p.source for p in pairs], [p.target for p in pairs]
    starts = [(d, i) for d in corpus.documents for i in range(0, len(d) - 1500, 5000)][:n_prompts]
    return [d[i:i + 300] for d, i in starts], [d[i + 300:i + 1500] for d, i in starts]


def _budget(prompts: list[list[int]], new_tokens: int, seq2seq: bool):
    """New tokens for a batch: seq2seq stops at eos, at most 2x the longest AR prompt of the batch + 16 (and
    `new_tokens`); continuation makes exactly `new_tokens`."""
    if not seq2seq:
        return lambda rows: new_tokens
    return lambda rows: min(2 * max(len(prompts[i]) for i in rows) + 16, new_tokens)


TREE_NODES = 24  # refusion-tree's node budget


def _datastore(path: str | None, methods: list[str], tokenizer) -> Datastore | None:
    """The datastore the `+datastore` methods draft from, loaded when one of them runs."""
    wanted = any(m.endswith("+datastore") for m in methods)
    if path and not wanted:
        raise DiffarError("--datastore serves the +datastore methods (e.g. ar+prompt-lookup+datastore): add one")
    if wanted and not path:
        raise DiffarError("the +datastore methods draft from a datastore: pass --datastore CORPUS")
    return load_datastore(path, tokenizer) if wanted else None


def lossless_methods(model, tokenizer, task: str, draft_model, k: int, plan_threshold: float,
                     plan_slot: int, compiled: bool = False, datastore: Datastore | None = None) -> dict:
    """The lossless bench's methods by name, all verifying with the same AR weights; `compiled`: their passes are
    (generation.compile_models); the `+datastore` ones: prompt lookup also drafts from `datastore` (None when
    none of them runs)."""
    ar = ar_stream(model)
    # ReFusion drafts `block` tokens a pass; a block drafter verifies its whole block (the anchor aside)
    k_refusion = min(k, model.config.block) if isinstance(model, RefusionModel) else None

    def refusion(store: bool = False, **schedule):
        return lambda: RefusionMethod(model, tokenizer, task, k=k_refusion, schedule=DraftSchedule(**schedule),
                                      compiled=compiled, datastore=datastore if store else None)
    return {
        "ar": lambda: ARMethod(ar, tokenizer, task, compiled=compiled),
        "ar+prompt-lookup": lambda: ARMethod(ar, tokenizer, task, proposer=PromptLookup(), k=k, compiled=compiled),
        "ar+draft": lambda: ARMethod(ar, tokenizer, task, proposer=DraftModel(draft_model), k=k, compiled=compiled),
        "refusion": refusion(),
        "refusion-dynamic": refusion(dynamic=True),
        "refusion-infill": refusion(plan_threshold=plan_threshold, plan_slot=plan_slot),
        "refusion-tree": refusion(tree=TREE_NODES),
        "refusion+prompt-lookup": refusion(lookup=True),
        "refusion-tree+prompt-lookup": refusion(tree=TREE_NODES, lookup=True),
        "ar+prompt-lookup+datastore": lambda: ARMethod(ar, tokenizer, task, proposer=PromptLookup(datastore=datastore),
                                                       k=k, compiled=compiled),
        "refusion+prompt-lookup+datastore": refusion(store=True, lookup=True),
        "refusion-tree+prompt-lookup+datastore": refusion(store=True, tree=TREE_NODES, lookup=True),
    }


def bench_lossless(checkpoint: str, draft: str | None, corpus_name: str | None, n_prompts: int, new_tokens: int,
                   k: int, batch_sizes: list[int], methods: list[str], plan_threshold: float = 0.9, plan_slot: int = 1,
                   split: str = "test", domain: str | None = None, compile: bool = False,
                   datastore: str | None = None) -> list[BenchRecord]:
    """Greedy AR against the draft-and-verify methods, all verifying with the same AR weights (a ReFusion
    checkpoint's AR stream, a block drafter's target, or an AR checkpoint), on the same prompts in the same
    batches, from `split` (valid when comparing training choices; a drafter's prompts come from its target's
    corpus). All are lossless but `refusion-infill` (plan-and-infill, keeping diffusion drafts at least
    `plan_threshold` confident, in slots of `plan_slot` tokens). A diffusion stream with a domain adapter drafts
    for `domain`, by default the prompt corpus's own.

    seq2seq runs stop at eos (`_budget`); continuation runs make exactly `new_tokens` (eos ignored). Outputs
    are scored against the references (the real continuation, for continuation) and compared with plain
    AR's token for token. `compile` and `datastore`: as in `bench_prompt_set`.
    """
    model, tokenizer, meta = load_for_inference(checkpoint)
    if any(m.startswith("refusion") for m in methods) and meta["kind"] not in ("refusion", "drafter"):
        raise DiffarError(f"{checkpoint} is an AR checkpoint; the refusion methods need a ReFusion or drafter one")
    draft_model = load_ar(draft, tokenizer, "--draft", dtype=draft_dtype("fp32")) if "ar+draft" in methods else None
    builders = lossless_methods(model, tokenizer, meta["task"], draft_model, k, plan_threshold, plan_slot, compile,
                                _datastore(datastore, methods, tokenizer))
    unknown = set(methods) - set(builders)
    if unknown:
        raise DiffarError(f"unknown method(s) {', '.join(sorted(unknown))}; choose from {', '.join(builders)}")
    if compile:
        compile_models(model, draft_model)
    if meta["kind"] == "drafter" and not corpus_name:  # prompts from its target's corpus, not its training data
        corpus_name = read_meta(target_path(meta["target"]))["corpus"] or None
    corpus = checkpoint_corpus(meta, corpus_name, split)
    texts, references = _prompts(corpus, n_prompts)
    if not texts:
        raise DiffarError(f"{corpus.name} gives no {split} prompts")
    seq2seq = corpus.task == "seq2seq"
    if isinstance(model, RefusionModel) and model.config.domains:
        domain = domain or domain_name(corpus.name)
    options = Options(domain=domain)
    records = []
    built = {name: builders[name]() for name in methods}
    prompts = {name: [method.prompt(t) for t in texts] for name, method in built.items()}
    runners = {name: _runner(method, method.settings(options), prompts[name],
                             _budget(prompts[name], new_tokens, seq2seq), ignore_eos=not seq2seq)
               for name, method in built.items()}
    for bs in batch_sizes:
        batches = _batches(len(texts), bs)
        runs = _interleaved(runners, batches, _compiled(built))
        reference_outputs = [t for r in runs[methods[0]] for t in r.tokens]
        step_s = _step_seconds(runs["ar"]) if "ar" in runs else None
        for name, method in built.items():
            results = runs[name]
            outs = [t for r in results for t in r.tokens]
            row_passes = sum(r.passes["target"] * len(r.tokens) for r in results)
            drafted, accepted = (sum(r.extra.get(key, 0) for r in results) for key in ("drafted", "accepted"))
            quality = text_metrics([tokenizer.decode(o).strip() for o in outs], references)
            records.append(_record(name, Path(corpus.name).name, prompts[name], results, batch_size=bs, extra={
                "split": split, "prompts": len(texts), "compiled": compile,
                **({"domain": domain} if domain and name.startswith("refusion") else {}),
                "plan_threshold": plan_threshold if name == "refusion-infill" else None,
                "plan_slot": plan_slot if name == "refusion-infill" else None,
                "k": None if name == "ar" else method.k,
                "tokens_per_ar_pass": round(_chosen(results) / row_passes, 3),
                "draft_passes": round(_passes(results, "draft") / len(batches)) if name != "ar" else None,
                "draft_acceptance": round(accepted / drafted, 3) if drafted else None,
                "draft_cost_vs_ar_step": _draft_cost(results, step_s),
                "exact_match_vs_ar": sum(a == b for a, b in zip(outs, reference_outputs)) / len(outs),
                "bleu4": quality["bleu4"], "rougeL": quality["rougeL"]}))
    return records


PEER_METHODS = ("transformers", "transformers+prompt-lookup")
PEER_LOOKUP = 10  # transformers+prompt-lookup's drafted tokens (its documented example's value)


def bench_prompt_set(checkpoint: str, prompt_set: str, n_prompts: int, new_tokens: int, batch_sizes: list[int],
                     methods: list[str], *, draft: str | None = None, k: int = 8, temperature: float = 0.0,
                     dtype: str = "bf16", seed: int = 0, data: str | None = None,
                     compile: bool = False, datastore: str | None = None) -> list[BenchRecord]:
    """The lossless methods on a pretrained chat model's prompt sets (data/prompts.py: code = HumanEval, chat,
    shakespeare), against the peers its users run on the same weights in the same run: transformers' `generate`
    and its prompt lookup (batch 1 only, as transformers allows). Chat and code stop at eos (at most
    `new_tokens`), Shakespeare makes exactly `new_tokens`. Greedy (`temperature` 0) or sampled.

    Records: tokens/s, tokens per AR pass (tau, the bonus token included), draft acceptance, the drafter's cost
    per pass relative to a plain AR step at the same batch size, and (greedy) the share of rows equal to
    diffar AR's. `data`: the `distill data` file whose held-out chat prompts join the chat set (default: a
    drafter's training corpus). `compile`: every diffar method's passes compiled (`generation.compile_models`;
    compiled in the warm-up round), plain AR's included, so that each is measured against compiled AR.
    `datastore`: the corpus whose train split the `+datastore` methods' prompt lookup also drafts from."""
    model, tokenizer, meta = load_for_inference(checkpoint, dtype=dtype)
    ar = ar_stream(model)
    if any(m.startswith("refusion") for m in methods) and meta["kind"] not in ("refusion", "drafter"):
        raise DiffarError(f"{checkpoint} is an AR checkpoint; the refusion methods need a drafter or ReFusion one")
    draft_model = load_ar(draft, tokenizer, "--draft", dtype=draft_dtype(dtype)) if "ar+draft" in methods else None
    builders = lossless_methods(model, tokenizer, meta["task"], draft_model, k, 0.9, 1, compile,
                                _datastore(datastore, methods, tokenizer))
    unknown = set(methods) - set(builders) - set(PEER_METHODS)
    if unknown:
        raise DiffarError(f"unknown method(s) {', '.join(sorted(unknown))}; choose from "
                          f"{', '.join([*builders, *PEER_METHODS])}")
    if compile:
        compile_models(model, draft_model)
    prompts = prompt_set_ids(prompt_set, tokenizer, n_prompts, data or (meta["corpus"] if meta["kind"] == "drafter"
                                                                          else None))
    to_eos = prompt_set != "shakespeare"
    eos_id = tokenizer.eos_id if to_eos else None
    settings = SamplingConfig(temperature=temperature)
    peer = transformers_llama(ar, tokenizer.pad_id) if set(methods) & set(PEER_METHODS) else None
    records = []
    built = {name: None if name in PEER_METHODS else builders[name]() for name in methods}

    def peer_run(lookup: int) -> Runner:
        return lambda rows: transformers_generate(peer, [prompts[i] for i in rows], new_tokens, tokenizer.pad_id,
                                                  eos_id=eos_id, temperature=temperature, prompt_lookup=lookup)
    for bs in batch_sizes:
        batches = _batches(len(prompts), bs)
        runners = {}
        for name, method in built.items():
            lookup = PEER_LOOKUP if name == "transformers+prompt-lookup" else 0
            if lookup and bs > 1:
                print(f"note: {name} runs at batch size 1 only (transformers' assisted decoding); skipped at {bs}")
            elif method is None:
                runners[name] = peer_run(lookup)
            else:
                runners[name] = _runner(method, settings, prompts, lambda rows: new_tokens,
                                        generator=torch.Generator().manual_seed(seed), ignore_eos=not to_eos)
        torch.manual_seed(seed)  # transformers samples from the global generator
        runs = _interleaved(runners, batches, _compiled(built))
        reference = [t for r in runs["ar"] for t in r.tokens] if "ar" in runs else None
        step_s = _step_seconds(runs["ar"]) if "ar" in runs else None
        for name, results in runs.items():
            method = built[name]
            outs = [t for r in results for t in r.tokens]
            extra = {"prompt_set": prompt_set, "prompts": len(prompts), "temperature": temperature,
                     "compiled": compile and method is not None,
                     "peer": f"transformers {transformers_version()}" if method is None else None,
                     "prompt_lookup_tokens": PEER_LOOKUP if name == "transformers+prompt-lookup" else None}
            if method is not None and name != "ar":
                drafted, accepted = (sum(r.extra.get(key, 0) for r in results) for key in ("drafted", "accepted"))
                extra.update(k=method.k, draft_acceptance=round(accepted / drafted, 3) if drafted else None,
                             draft_cost_vs_ar_step=_draft_cost(results, step_s))
            if method is not None:
                rows_passes = sum(r.passes["target"] * len(r.tokens) for r in results)
                extra["tokens_per_ar_pass"] = round(_chosen(results) / rows_passes, 3)
            if reference is not None and not temperature:
                extra["exact_match_vs_ar"] = round(sum(a == b for a, b in zip(outs, reference)) / len(outs), 3)
            records.append(_record(name, prompt_set, prompts, results, batch_size=bs, dtype=dtype, extra=extra))
    return records


DD2_METHODS = {  # name -> options (None: plain AR); dd2-hybrid: one step for 50 tokens, then AR; and dd2-N
    "ar": None, "dd2-adaptive": Options(adaptive=True), "dd2-hybrid": Options(steps=1),
    "dd2-speed": Options(preset="speed"), "dd2-quality": Options(preset="quality"),
}


def dd2_options(name: str) -> Options | None:
    """The options a bench method name stands for: one of DD2_METHODS, ar-tT (AR sampled at temperature T),
    dd2-N (N DDIM steps), dd2-NxK (the best of K N-step samples by the AR model) or dd2-NxK-self (by the
    generator's own decoder)."""
    if name in DD2_METHODS:
        return DD2_METHODS[name]
    match = re.fullmatch(r"ar-t([0-9]*\.?[0-9]+)", name)
    if match and 0 < float(match[1]) <= 100:
        return Options(temperature=float(match[1]))
    match = re.fullmatch(r"dd2-([0-9]+)(?:x([0-9]+)(-self)?)?", name)
    if match and int(match[1]) > 0 and int(match[2] or 1) > 0:
        return Options(steps=int(match[1]), best_of=int(match[2] or 1))
    raise DiffarError(f"unknown method {name!r}; choose dd2-N (N sampling steps), dd2-NxK (the AR model's pick of "
                      f"K N-step samples), dd2-NxK-self (the decoder's own pick), ar-tT (AR sampled at temperature "
                      f"T) or {', '.join(DD2_METHODS)}")


def bench_dd2(checkpoint: str, ar_checkpoint: str, corpus_name: str | None, n_prompts: int, new_tokens: int,
              batch_sizes: list[int], methods: list[str], seed: int = 0, split: str = "test",
              dtype: str = "fp32", scorer: str | None = None) -> list[BenchRecord]:
    """Greedy AR (KV cache) against DD2 sampling with 1/30/50/100 steps, the DD2 seed post's presets and
    hybrid sampling, on the same prompts in the same batches, from `split` (valid when comparing training
    choices, so that no choice is tuned on the test split). seq2seq: the sources, AR stops at eos (`_budget`),
    DD2 fills its canvas; continuation: exactly `new_tokens` per row from every method (DD2 canvas after
    canvas). Quality: BLEU-4, chrF and ROUGE-L against the references, and for continuation the AR model's
    perplexity of each method's output, its repetition (seq-rep-4) and unigram entropy. `scorer`: an AR
    checkpoint with any tokenizer, a model diffar did not train on this data (an imported one), whose
    perplexity of each output given its prompt text (both re-tokenized by it) every record gets as
    `scorer_perplexity`. `dtype` applies to every model (the baseline's speed and text change with it too)."""
    model, tokenizer, meta = load_for_inference(checkpoint, dtype=dtype)
    if meta["kind"] != "dd2":
        raise DiffarError(f"{checkpoint} is a {meta['kind']} checkpoint; bench dd2 needs a DD2 one")
    task = meta["task"]
    ar = load_ar(ar_checkpoint, tokenizer, "--ar", task=task, dtype=dtype)
    options = {name: dd2_options(name) for name in methods}
    corpus = checkpoint_corpus(meta, corpus_name, split)
    texts, references = _prompts(corpus, n_prompts)
    if not texts:
        raise DiffarError(f"{corpus.name} gives no {split} prompts")
    seq2seq = corpus.task == "seq2seq"
    plain = DD2Method(model, tokenizer, task)
    fits = [plain.room(plain.prompt(t)) > 0 for t in texts]
    if not all(fits):  # sources longer than the denoiser reads are left out for every method alike
        print(f"note: {fits.count(False)} {split} sources longer than {model.config.max_source_len} tokens left out")
        texts, references = [t for t, ok in zip(texts, fits) if ok], [r for r, ok in zip(references, fits) if ok]
        if not texts:
            raise DiffarError(f"no {split} source of {corpus.name} fits the model's "
                              f"{model.config.max_source_len} tokens")
    baseline = ARMethod(ar, tokenizer, task)
    ar_prompts = [baseline.prompt(t) for t in texts]
    if scorer is not None:
        judge, judge_tokenizer, judge_meta = load_for_inference(scorer, dtype=dtype)
        if judge_meta["kind"] != "ar":
            raise DiffarError(f"--scorer {scorer} is a {judge_meta['kind']} checkpoint; it must be an AR one")
        judge_prompts = [judge_tokenizer.encode(t) for t in texts]  # prompt and output alike: plain text
    budget = _budget(ar_prompts, new_tokens, seq2seq)
    records = []
    # the AR model judges best-of-n samples (but for -self) and continues hybrid's prefix
    built = {name: DD2Method(model, tokenizer, task, judge=None if name.endswith("-self") else ar,
                             hybrid=ar if name == "dd2-hybrid" else None) if name.startswith("dd2") else baseline
             for name in methods}
    chosen = {name: method.settings(options[name] or Options()) for name, method in built.items()}
    prompts = {name: [method.prompt(t) for t in texts] for name, method in built.items()}
    for bs in batch_sizes:  # each batch size's runners sample from freshly seeded generators
        batches = _batches(len(texts), bs)
        runs = _interleaved({name: _runner(method, chosen[name], prompts[name], budget,
                                           generator=torch.Generator().manual_seed(seed), ignore_eos=not seq2seq)
                             for name, method in built.items()}, batches)
        for name, results in runs.items():
            dd2, method, settings = name.startswith("dd2"), built[name], chosen[name]
            outs = [t for r in results for t in r.tokens]
            steps, taus = ({r.extra.get(key) for r in results} for key in ("steps", "tau"))
            extra = {"split": split, "prompts": len(texts), "steps": steps.pop() if len(steps) == 1 else "adaptive",
                     "best_of": settings.best_of if dd2 else None,
                     "judge": ("decoder" if method.judge is None else "ar") if dd2 and settings.best_of > 1 else None,
                     "guidance_scale": settings.guidance_scale if dd2 else None,
                     "tau_max": settings.tau_max if dd2 else None,
                     "tau": (round(taus.pop(), 4) if len(taus) == 1 else "adaptive") if dd2 else None,
                     **text_metrics([tokenizer.decode(o).strip() for o in outs], references)}
            if not dd2:
                extra["temperature"] = settings.temperature
            if not seq2seq:
                extra["ar_perplexity"] = round(conditional_perplexity(ar, ar_prompts, outs), 2)
                extra["seq_rep4"] = round(repetition(outs), 1)
                extra["unigram_entropy"] = round(unigram_entropy(outs), 3)
            judged = [judge_tokenizer.encode(tokenizer.decode(o)) for o in outs] if scorer is not None else []
            if any(judged):
                extra["scorer_perplexity"] = round(conditional_perplexity(
                    judge, [p for p, o in zip(judge_prompts, judged) if o], [o for o in judged if o]), 2)
            records.append(_record(name, Path(corpus.name).name, ar_prompts, results, batch_size=bs, dtype=dtype,
                                   extra=extra))
    return records


def print_table(records: list[BenchRecord]) -> None:
    base = {(r.task, r.batch_size): r.tokens_per_s for r in records if r.method == "ar"}
    m = max([len("method"), *(len(r.method) for r in records)]) + 2  # columns as wide as the longest name
    t = max([len("task"), *(len(r.task) for r in records)]) + 2
    print(f"{'method':<{m}}{'task':<{t}}{'batch':>6}{'prompt':>8}{'new':>6}{'latency ms':>12}{'tok/s':>10}"
          f"{'passes':>8}{'vs ar':>8}")
    for r in records:
        speed = r.tokens_per_s / base[r.task, r.batch_size] if (r.task, r.batch_size) in base else float("nan")
        print(f"{r.method:<{m}}{r.task:<{t}}{r.batch_size:>6}{r.prompt_tokens:>8}{r.new_tokens:>6}"
              f"{r.latency_ms:>12.1f}{r.tokens_per_s:>10.1f}{r.forward_passes:>8}{speed:>7.2f}x")
        if r.extra:
            print(" " * m + ", ".join(f"{k} {v}" for k, v in r.extra.items() if v is not None))
    if records:
        print(f"device: {records[0].device}, torch threads: {records[0].torch_threads}, dtype: {records[0].dtype}")


def write_records(records: list[BenchRecord], out: str | Path) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in records], indent=2) + "\n")
    print(f"wrote {len(records)} records to {out}")
