"""`diffar import`: a pretrained Llama-family model (Hugging Face folder or GGUF file) as a diffar checkpoint."""

from __future__ import annotations

import time

from diffar.commands import flags
from diffar.importing.embedded import PACKAGED


def register(subparsers) -> None:
    im = subparsers.add_parser("import", parents=[flags.out("the new checkpoint folder")],
                               help="write a Hugging Face Llama folder or a Llama GGUF file as a diffar checkpoint")
    im.add_argument("--from", dest="source", required=True, metavar="PATH",
                    help="a Hugging Face model folder (config.json, *.safetensors, tokenizer.json), a .gguf file, "
                         f"or a model a pip package ships ({', '.join(PACKAGED)})")
    im.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="weight precision (bf16)")
    im.set_defaults(func=run)


def run(args) -> None:
    from diffar.importing import import_model
    from diffar.importing.embedded import source_path

    start = time.perf_counter()
    out = import_model(source_path(args.source), args.out, dtype=args.dtype)
    print(f"imported {args.source} to {out} ({args.dtype}) in {time.perf_counter() - start:.1f} s")
