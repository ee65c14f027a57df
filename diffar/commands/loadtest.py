"""`diffar loadtest`: many concurrent clients against a server on this machine (bounded by a time limit)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from diffar.commands import flags
from diffar.errors import DiffarError


def register(subparsers) -> None:
    lt = subparsers.add_parser("loadtest", help="concurrent clients against a server on this machine (bounded)",
                               parents=[flags.out("write the results as JSON", required=False)])
    lt.add_argument("--url", help="a running diffar server")
    lt.add_argument("--checkpoint", help="start a server for this checkpoint on 127.0.0.1 instead")
    lt.add_argument("--concurrency", type=flags.positive_int, default=1000)
    lt.add_argument("--requests", type=flags.positive_int, default=2000)
    lt.add_argument("--max-tokens", type=flags.positive_int, default=32)
    lt.add_argument("--time-limit", type=flags.float_in(1, 86_400), default=600.0,
                    help="seconds; unanswered requests count as lost")
    lt.add_argument("--client-timeout", type=flags.float_in(0.1, 86_400),
                    help="each client gives up on a request after this many seconds (and sends its next)")
    lt.add_argument("--max-retries", type=flags.int_in(0, 100), default=2,
                    help="a client sends a request again after a 429's Retry-After up to this many times (as "
                         "OpenAI's client does; 0: a 429 is final)")
    lt.add_argument("--max-wait-s", type=flags.float_in(0.1, 3600), default=3.0,
                    help="--checkpoint: the started server's admission bound (diffar serve --max-wait-s)")
    lt.add_argument("--max-batch-size", type=flags.positive_int, default=32)
    lt.add_argument("--compare-unbatched", action="store_true",
                    help="also measure a server that decodes one request at a time")
    lt.add_argument("--unbatched-requests", type=flags.positive_int, default=300)
    lt.add_argument("--corpus", default="kjv2web", help="prompts come from this corpus's test split")
    lt.set_defaults(func=run)


def run(args) -> None:
    from diffar.data.corpora import load_corpus
    from diffar.serving.loadtest import local_server, print_results, raise_fd_limit, results_json, run_load

    if (args.url is None) == (args.checkpoint is None):
        raise DiffarError("give either --url (a running server) or --checkpoint (start one here)")
    corpus = load_corpus(args.corpus, "test")
    prompts = [p.source for p in corpus.pairs] if corpus.task == "seq2seq" else \
        [d[i:i + 200] for d in corpus.documents for i in range(0, max(1, len(d) - 200), 997)]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise DiffarError(f"{corpus.name} gives no prompts")
    raise_fd_limit()
    load = dict(concurrency=args.concurrency, max_tokens=args.max_tokens, time_limit=args.time_limit,
                client_timeout=args.client_timeout, max_retries=args.max_retries)
    if args.url:
        results = [run_load(args.url, prompts, requests=args.requests, label="server", max_batch_size=None, **load)]
    else:
        results = []
        runs = [(args.max_batch_size, args.requests)] + ([(1, args.unbatched_requests)] if args.compare_unbatched
                                                         else [])
        for batch, n in runs:
            with local_server(args.checkpoint, batch, max_queue=max(4096, args.concurrency),
                              max_wait_s=args.max_wait_s) as url:
                label = f"batched (max {batch})" if batch > 1 else "one at a time"
                print(f"{label}: {n} requests from {args.concurrency} concurrent clients...", file=sys.stderr)
                results.append(run_load(url, prompts, requests=n, label=label, max_batch_size=batch, **load))
    print_results(results)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results_json(results), indent=2) + "\n")
