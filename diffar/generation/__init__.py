"""Generation methods: one interface (`GenerationMethod`, method.py) over every decoder, registered here once;
`diffar generate`, `eval`, `bench`, `serve` and `loadtest` all build their methods through `load_method` or
the classes in `METHODS`. Which methods a checkpoint kind serves is declared in `checkpoint.GENERATES`."""

from __future__ import annotations

from dataclasses import replace

from diffar.checkpoint import GENERATES, ar_stream, load_ar, load_for_inference, read_meta
from diffar.decoding.datastore import load_datastore
from diffar.decoding.refusion import DraftSchedule
from diffar.decoding.speculative import DraftModel, PromptLookup
from diffar.errors import DiffarError
from diffar.generation.ar import ARMethod, RefusionMethod
from diffar.generation.dd2 import DD2Method
from diffar.generation.method import GenerationMethod, OptionError, Options
from diffar.models.drafter import BlockDrafter
from diffar.models.precision import compile_decode, compile_draft, draft_dtype
from diffar.models.transformer import Transformer

METHODS: dict[str, type] = {"ar": ARMethod, "refusion": RefusionMethod, "dd2": DD2Method}

__all__ = ["METHODS", "ARMethod", "DD2Method", "GenerationMethod", "OptionError", "Options", "RefusionMethod",
           "compile_models", "load_method", "resolve_method"]


def resolve_method(checkpoint: str, method: str | None = None) -> str:
    """The method that decodes a checkpoint: `method` if its kind serves it, else its kind's default."""
    kind = read_meta(checkpoint)["kind"]
    if not GENERATES[kind]:
        raise DiffarError(f"{checkpoint} is a {kind} checkpoint, which does not generate text")
    if method is not None and method not in GENERATES[kind]:
        raise OptionError("method", f"method {method} cannot decode {checkpoint}, a {kind} checkpoint (it serves "
                                    f"{', '.join(GENERATES[kind])})")
    return method or GENERATES[kind][0]


def compile_models(model, draft_model: Transformer | None = None) -> None:
    """Compile, in place, the passes a method over `model` decodes with: its AR model's (`precision.compile_decode`),
    a block drafter's (`compile_draft`), a draft model's."""
    compile_decode(ar_stream(model))
    if isinstance(model, BlockDrafter):
        compile_draft(model)
    if draft_model is not None:
        compile_decode(draft_model)


def load_method(checkpoint: str, method: str | None = None, *, dtype: str = "fp32", tokenizer: str | None = None,
                draft: str | None = None, prompt_lookup: bool = False, datastore: str | None = None,
                k: int | None = None, schedule: DraftSchedule | None = None, judge: str | None = None,
                hybrid: str | None = None, use_cache: bool = True, device: str = "cpu",
                compile: bool = False) -> GenerationMethod:
    """The generation method `method` (default: the checkpoint's own) over a checkpoint, with what it works
    with: an AR drafter (`draft` checkpoint or `prompt_lookup`, verifying `k` drafts a pass), ReFusion's draft
    `schedule` (with `prompt_lookup`, the copies join its drafts), prompt lookup's `datastore` (a corpus whose
    train split's n-grams add a tree of likely continuations, decoding/datastore.py), DD2's best-of `judge` or
    `hybrid` continuer (AR checkpoints). Every model loads in `dtype` (fp32, bf16, fp16, int8) on `device` (cpu,
    cuda), and decodes there, a drafter at `precision.draft_dtype` (bf16 beside fp32 on most CPUs); `compile`
    compiles the AR model's decoding passes and a drafter's (models/precision.compile_decode, compile_draft)."""
    method = resolve_method(checkpoint, method)
    given = {"draft": draft, "prompt_lookup": prompt_lookup, "datastore": datastore, "schedule": schedule,
             "judge": judge, "hybrid": hybrid, "no_cache": not use_cache, "compile": compile}
    takes = {"ar": {"draft", "prompt_lookup", "datastore", "no_cache", "compile"},
             "refusion": {"schedule", "prompt_lookup", "datastore", "compile"}, "dd2": {"judge", "hybrid"}}
    for name, value in given.items():
        if value and name not in takes[method]:
            owners = " and ".join(m for m, names in takes.items() if name in names)
            raise OptionError(name, f"{name} applies to method {owners} only, not to {method}")
    if datastore and not prompt_lookup and not (schedule and schedule.lookup):
        raise OptionError("datastore", "a datastore serves prompt lookup: add --prompt-lookup")
    model, tok, meta = load_for_inference(checkpoint, tokenizer, dtype=dtype, device=device)
    store = load_datastore(datastore, tok) if datastore else None
    alike = dict(dtype=dtype, device=device)  # every model it works with
    task = meta["task"]
    if method == "dd2":
        return DD2Method(model, tok, task, judge=judge and load_ar(judge, tok, "judge", task, **alike),
                         hybrid=hybrid and load_ar(hybrid, tok, "hybrid", task, **alike))
    if method == "refusion":
        schedule = schedule or DraftSchedule()
        refusion = RefusionMethod(model, tok, task, schedule=replace(schedule, lookup=schedule.lookup or prompt_lookup),
                                  k=k, compiled=compile, datastore=store)
        if compile:
            compile_models(model)
        return refusion
    if draft and prompt_lookup:
        raise OptionError("draft", "choose one drafter: a draft model or prompt lookup")
    if compile and not use_cache:
        raise OptionError("compile", "compile applies to KV-cached decoding, not to the uncached decoder")
    draft_model = load_ar(draft, tok, "draft", dtype=draft_dtype(dtype, device), device=device) if draft else None
    if compile:
        compile_models(model, draft_model)
    proposer = PromptLookup(datastore=store) if prompt_lookup else DraftModel(draft_model) if draft else None
    return ARMethod(ar_stream(model), tok, task, proposer=proposer, k=k or 8, use_cache=use_cache, compiled=compile)
