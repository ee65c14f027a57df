"""`diffar serve`: an OpenAI-compatible HTTP server with dynamic batching and streaming."""

from __future__ import annotations

import os
from pathlib import Path

from diffar.commands import flags


def register(subparsers) -> None:
    sv = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with dynamic batching and streaming",
                               parents=[flags.dtype(), flags.device(), flags.compile_step(), flags.prompt_lookup(),
                                        flags.threads()])
    sv.add_argument("--checkpoint", required=True)
    sv.add_argument("--method", choices=("ar", "dd2", "refusion"),
                    help="decoding method (default: the checkpoint's kind; a ReFusion checkpoint can also serve its AR "
                         "stream as ar)")
    sv.add_argument("--model-id", type=flags.text,
                    help="the model name clients use (default: the checkpoint folder's name)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=flags.int_in(1, 65535), default=8000)
    sv.add_argument("--max-batch-size", type=flags.positive_int, default=16)
    sv.add_argument("--batch-window-ms", type=flags.float_in(0, 10_000), default=10.0,
                    help="how long a batch waits to fill (0..10000 ms)")
    sv.add_argument("--max-queue", type=flags.positive_int, default=4096, help="waiting requests before 429")
    sv.add_argument("--max-wait-s", type=flags.float_in(0.1, 3600), default=3.0,
                    help="a request that would wait longer than this before its batch starts (queued work at the "
                         "measured step cost) gets a 429 with Retry-After (0.1..3600 s, default 3)")
    sv.add_argument("--max-body-bytes", type=flags.positive_int, default=1 << 20,
                    help="larger request bodies get a 413 before they are read (default 1 MiB)")
    sv.add_argument("--judge", metavar="AR_CHECKPOINT",
                    help="dd2: the AR model that picks among a request's best_of samples (without it, the "
                         "decoder's own confidence picks)")
    sv.add_argument("--allowed-host", action="append", dest="allowed_hosts", metavar="HOST",
                    help="a Host header the server answers (repeatable; default: --host, localhost and 127.0.0.1; "
                         "'*' for any)")
    sv.add_argument("--api-key", default=os.environ.get("DIFFAR_API_KEY"),
                    help="clients must send 'Authorization: Bearer KEY' on every route but /health and the page "
                         "(default: $DIFFAR_API_KEY; none: open)")
    sv.add_argument("--docs", action="store_true", help="serve the interactive API docs at /docs")
    sv.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug", "trace"))
    sv.set_defaults(func=run)


def run(args) -> None:
    import uvicorn

    from diffar.generation import load_method
    from diffar.serving.app import create_app

    flags.announce_compile(args)
    method = load_method(args.checkpoint, args.method, dtype=args.dtype, device=args.device, judge=args.judge,
                         compile=args.compile, prompt_lookup=args.prompt_lookup, datastore=args.datastore)
    app = create_app(method, args.model_id or Path(args.checkpoint).resolve().name, max_batch_size=args.max_batch_size,
                     window_ms=args.batch_window_ms, max_queue=args.max_queue, max_wait_s=args.max_wait_s,
                     max_body_bytes=args.max_body_bytes, api_key=args.api_key or None,
                     allowed_hosts=args.allowed_hosts or [args.host, "localhost", "127.0.0.1"], docs=args.docs)
    # keep-alive outlasts a Retry-After, so a client that waits one out does not reuse a connection closed under it
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, backlog=4096, timeout_keep_alive=75)
