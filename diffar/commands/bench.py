"""`diffar bench ar|speculative|refusion|dd2`: decoding speed (and, for lossy DD2, quality) against AR, as a table
and JSON records (and, with --plot, a speed-quality plot); `diffar bench plot` redraws saved records."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from diffar.commands import flags
from diffar.data.prompts import SOURCES
from diffar.errors import DiffarError
from diffar.evaluation.plot import FORMATS, draw, load_records, save, select

SHIPPED_DRAFT = "checkpoints/draft-kjv2web"  # the ar+draft peer's default (found from any folder: checkpoint.resolve)
DRAFT_HELP = (f"the small AR drafter of the ar+draft peer (default: {SHIPPED_DRAFT} where it shares the model's "
              "tokenizer; else ar+draft is skipped)")
PLOT_HELP = ("one point per method and batch size: speed (tokens/s; for dd2, latency per batch) against quality "
             "(BLEU-4, else chrF; for continuation the --scorer's perplexity of the output, else the AR model's), "
             "a panel per task and batch size. Records with no quality figure (bench ar, --set runs) are drawn "
             "as speed per method")


def image(path: str) -> str:
    """An argparse type: a file name matplotlib writes by its suffix."""
    if Path(path).suffix.lower().lstrip(".") not in FORMATS:
        raise argparse.ArgumentTypeError(f"must end in {', '.join('.' + f for f in FORMATS)}, got {path!r}")
    return path


def _prompts(prompts: int, batch_sizes: list[int]) -> argparse.ArgumentParser:
    """Where a comparison's prompts come from and how they are batched."""
    p = argparse.ArgumentParser(add_help=False, parents=[flags.split()])
    p.add_argument("--corpus", help="prompts from this corpus (default: the checkpoint's corpus)")
    p.add_argument("--prompts", type=flags.positive_int, default=prompts)
    p.add_argument("--new-tokens", type=flags.positive_int, default=256, help="continuation: tokens per prompt")
    p.add_argument("--batch-sizes", type=flags.int_in(1, flags.MAX_BATCH), nargs="+", default=batch_sizes)
    return p


def register(subparsers) -> None:
    b = subparsers.add_parser("bench", help="measure decoding speed; writes JSON records (and plots them)")
    methods = b.add_subparsers(dest="method", required=True, metavar="METHOD")
    json_out = argparse.ArgumentParser(add_help=False, parents=[flags.out("JSON file to write")])
    json_out.add_argument("--plot", type=image, metavar="FILE.png", help="also draw the records to this image: "
                          f"{PLOT_HELP} (`diffar bench plot` redraws the JSON)")
    threads = flags.threads()
    bar = methods.add_parser("ar", help="AR with vs without the KV cache, and against transformers' generate",
                             parents=[flags.dtype(), flags.device(), json_out, threads])
    bar.add_argument("--checkpoint", default="checkpoints/ar-kjv2web")
    bar.add_argument("--corpus", help="prompts from this corpus's test split (default: the checkpoint's corpus; an "
                                      "imported model needs one)")
    bar.add_argument("--methods", nargs="+", choices=["ar", "ar-nocache", "ar-compile"], default=["ar", "ar-nocache"],
                     help="ar-compile: KV-cached AR with its step compiled (--compile; compiled in the warm-up round)")
    bar.add_argument("--peer", choices=["transformers"],
                     help="also time this library's generate on the same weights (greedy text compared with ar's)")
    bar.add_argument("--batch-sizes", type=flags.int_in(1, flags.MAX_BATCH), nargs="+", default=[1, 8])
    bar.add_argument("--new-tokens", type=flags.positive_int, default=256)
    bar.add_argument("--repeats", type=flags.positive_int, default=1)
    bar.set_defaults(func=run_ar)

    verifying = argparse.ArgumentParser(add_help=False)
    verifying.add_argument("--k", type=flags.int_in(1, flags.MAX_DRAFT), default=8, help="draft length (block size)")
    verifying.add_argument("--compile", action="store_true",
                           help="compile every diffar method's passes (plain AR's too; in the warm-up round)")
    verifying.add_argument("--datastore", metavar="CORPUS",
                           help="the +datastore methods (ar+prompt-lookup+datastore, refusion+prompt-lookup+"
                                "datastore, refusion-tree+prompt-lookup+datastore): prompt lookup also drafts a "
                                "tree from this corpus's train split's n-grams, e.g. the `distill data` records "
                                "of the model's own responses")
    lossless = [_prompts(32, [1]), verifying, json_out, threads]
    bsp = methods.add_parser("speculative", help="AR vs lossless prompt-lookup and draft-model decoding",
                             parents=lossless)
    bsp.add_argument("--checkpoint", default="checkpoints/ar-kjv2web")
    bsp.add_argument("--draft", help=DRAFT_HELP)
    bsp.add_argument("--methods", nargs="+", default=["ar", "ar+prompt-lookup", "ar+draft"])
    bsp.set_defaults(func=run_speculative)
    brf = methods.add_parser("refusion", help="ReFusion lossless decoding against AR and its speculative peers",
                             parents=[*lossless, flags.dtype(), flags.seed()])
    brf.add_argument("--checkpoint", default="checkpoints/refusion-kjv2web", help="a ReFusion checkpoint")
    brf.add_argument("--draft", help=DRAFT_HELP)
    brf.add_argument("--methods", nargs="+",
                     default=["ar", "ar+prompt-lookup", "ar+draft", "refusion", "refusion-dynamic", "refusion-infill"])
    brf.add_argument("--plan-threshold", type=flags.float_in(0, 1), default=0.9,
                     help="refusion-infill: keep drafts this confident")
    brf.add_argument("--plan-slot", type=flags.positive_int, default=1, help="refusion-infill: tokens per planned slot")
    brf.add_argument("--domain", help="the domain a diffusion stream with a domain adapter drafts for (default: the "
                                      "prompt corpus's own)")
    brf.add_argument("--set", choices=SOURCES,
                     help="a chat model's prompt set instead of a corpus: code (HumanEval), chat (a fixed list, then "
                          "held-out self-written instructions), shakespeare (test windows); methods may add the "
                          "peers transformers and transformers+prompt-lookup")
    brf.add_argument("--temperature", type=flags.float_in(0, 100), default=0.0,
                     help="--set: 0 = greedy, else plain sampling")
    brf.set_defaults(func=run_refusion)

    bdd = methods.add_parser("dd2", help="DD2 one-step / few-step / hybrid sampling against AR",
                             parents=[_prompts(128, [1, 16]), flags.seed(),
                                      flags.dtype(flags.DTYPE_HELP + ", every model alike"), json_out, threads])
    bdd.add_argument("--checkpoint", default="checkpoints/dd2-kjv2web", help="a DD2 checkpoint")
    bdd.add_argument("--ar", default="checkpoints/ar-kjv2web",
                     help="the AR baseline (and hybrid's continuer, and dd2-NxK's judge)")
    bdd.add_argument("--methods", nargs="+", default=["ar", "dd2-1", "dd2-30", "dd2-50", "dd2-100", "dd2-hybrid"],
                     help="ar (greedy), ar-tT (sampled at temperature T), dd2-N (N DDIM steps), dd2-NxK (--ar "
                          "picks the best of K N-step samples), dd2-NxK-self (the decoder picks), dd2-adaptive, "
                          "dd2-hybrid, dd2-speed, dd2-quality")
    bdd.add_argument("--scorer", metavar="AR_CHECKPOINT",
                     help="a model that did not learn this data (e.g. checkpoints/smollm2-135m-instruct; any "
                          "tokenizer) scores every method's text: its perplexity of the output given the prompt")
    bdd.set_defaults(func=run_dd2)

    bpl = methods.add_parser("plot", help="redraw saved bench records as a speed-quality plot",
                             description=f"Draw `diffar bench` JSON records: {PLOT_HELP}.")
    bpl.add_argument("--results", nargs="+", required=True, metavar="JSON", help="bench JSON files, drawn together")
    bpl.add_argument("--out", type=image, required=True, metavar="FILE.png", help="the image to write")
    bpl.set_defaults(func=run_plot)


def _draft_peer(args) -> None:
    """ar+draft needs a small AR drafter: --draft, or else the shipped one where it shares the model's tokenizer;
    otherwise the method is left out, and the reason printed."""
    if "ar+draft" not in args.methods or args.draft:
        return
    from diffar.checkpoint import read_meta

    if read_meta(SHIPPED_DRAFT)["tokenizer_sha256"] == read_meta(args.checkpoint)["tokenizer_sha256"]:
        args.draft = SHIPPED_DRAFT
        return
    args.methods = [m for m in args.methods if m != "ar+draft"]
    print(f"skipping ar+draft: {SHIPPED_DRAFT} uses another tokenizer than {args.checkpoint}; pass --draft "
          f"CHECKPOINT (a small AR model with its tokenizer) to include it", file=sys.stderr)


def _report(records, args) -> None:
    """The table, the JSON records and, with --plot, their plot."""
    from diffar.evaluation.bench import print_table, write_records

    print_table(records)
    write_records(records, args.out)
    if args.plot:
        save(draw(select([asdict(r) for r in records])), args.plot)


def run_plot(args) -> None:
    save(draw(select([r for path in args.results for r in load_records(path)])), args.out)


def run_ar(args) -> None:
    from diffar.evaluation.bench import bench_ar

    records = bench_ar(args.checkpoint, args.corpus, args.batch_sizes, args.new_tokens, args.repeats, args.dtype,
                       tuple(args.methods), args.peer, args.device)
    _report(records, args)


def _lossless(args, **infill) -> None:
    """AR against the lossless draft-and-verify methods; `infill`: refusion-infill's plan settings, the domain."""
    from diffar.evaluation.bench import bench_lossless

    _draft_peer(args)
    records = bench_lossless(args.checkpoint, args.draft, args.corpus, args.prompts, args.new_tokens, args.k,
                             args.batch_sizes, args.methods, split=args.split, compile=args.compile,
                             datastore=args.datastore, **infill)
    _report(records, args)


def run_speculative(args) -> None:
    _lossless(args)


def run_refusion(args) -> None:
    if not args.set:
        if args.dtype != "fp32" or args.temperature:
            raise DiffarError("--dtype and --temperature apply to --set runs (corpus runs are greedy, fp32)")
        return _lossless(args, plan_threshold=args.plan_threshold, plan_slot=args.plan_slot, domain=args.domain)
    if args.domain:
        raise DiffarError("--domain applies to corpus runs (a --set run's block drafter has no domain adapter)")
    from diffar.evaluation.bench import bench_prompt_set

    _draft_peer(args)
    records = bench_prompt_set(args.checkpoint, args.set, args.prompts, args.new_tokens, args.batch_sizes,
                               args.methods, draft=args.draft if "ar+draft" in args.methods else None, k=args.k,
                               temperature=args.temperature, dtype=args.dtype, seed=args.seed, data=args.corpus,
                               compile=args.compile, datastore=args.datastore)
    _report(records, args)


def run_dd2(args) -> None:
    from diffar.evaluation.bench import bench_dd2

    records = bench_dd2(args.checkpoint, args.ar, args.corpus, args.prompts, args.new_tokens, args.batch_sizes,
                        args.methods, args.seed, args.split, args.dtype, args.scorer)
    _report(records, args)
