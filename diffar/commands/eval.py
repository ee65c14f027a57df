"""`diffar eval`: BLEU-4/chrF/ROUGE-L and perplexity of a checkpoint on a corpus split, as JSON."""

from __future__ import annotations

import json
from pathlib import Path

from diffar.commands import flags


def register(subparsers) -> None:
    e = subparsers.add_parser("eval", help="BLEU-4/chrF/ROUGE-L and perplexity on a corpus split",
                              parents=[flags.split(["train", "valid", "test"], help=None), flags.dtype(),
                                       flags.out("also write the report as JSON", required=False), flags.threads()])
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--corpus", help="default: the corpus the checkpoint was trained on")
    e.add_argument("--limit", type=flags.positive_int, help="evaluate the first N examples only")
    e.add_argument("--batch-size", type=flags.positive_int, default=16)
    e.add_argument("--block-size", type=flags.positive_int,
                   help="perplexity window of a continuation model (default: its training block, else its context)")
    e.set_defaults(func=run)


def run(args) -> None:
    from diffar.evaluation.evaluate import evaluate_checkpoint

    if args.out:  # an unwritable --out fails now, not after the evaluation
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report = evaluate_checkpoint(args.checkpoint, args.corpus, args.split, args.limit, args.batch_size,
                                 args.block_size, args.dtype)
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
