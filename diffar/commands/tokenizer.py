"""`diffar tokenizer train`: a byte-level BPE tokenizer from one or more corpora."""

from __future__ import annotations

from diffar.commands import flags


def register(subparsers) -> None:
    tok = subparsers.add_parser("tokenizer", help="train a byte-level BPE tokenizer")
    actions = tok.add_subparsers(dest="action", required=True, metavar="ACTION")
    t = actions.add_parser("train", help="train a tokenizer on one or more corpora",
                           parents=[flags.out("where to write the tokenizer JSON")])
    t.add_argument("--corpus", action="append", required=True, help=flags.CORPORA + " (repeatable)")
    t.add_argument("--vocab-size", type=flags.positive_int, default=8192)
    t.add_argument("--min-frequency", type=flags.positive_int, default=2)
    t.set_defaults(func=run_train)


def run_train(args) -> None:
    from diffar.data.corpora import load_corpus
    from diffar.tokenizer import train_tokenizer

    texts = [t for name in args.corpus for t in load_corpus(name, "train").texts()]
    tok = train_tokenizer(texts, args.vocab_size, args.min_frequency)
    tok.save(args.out)
    print(f"saved {tok.vocab_size}-token tokenizer to {args.out} (sha256 {tok.sha256[:12]})")
