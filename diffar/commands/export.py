"""`diffar export`: a run's latest checkpoint as a compact folder (weights at a chosen dtype, no optimizer)."""

from __future__ import annotations

from pathlib import Path

from diffar.commands import flags
from diffar.errors import DiffarError


def register(subparsers) -> None:
    ex = subparsers.add_parser("export", parents=[flags.out()],
                               help="write a run's latest checkpoint as a compact folder (no optimizer state)")
    ex.add_argument("--checkpoint", required=True, help="run or checkpoint folder")
    ex.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    ex.set_defaults(func=run)


def run(args) -> None:
    from diffar.checkpoint import load_checkpoint, write_checkpoint
    from diffar.models.precision import DTYPES

    out = Path(args.out)
    if out.exists():
        raise DiffarError(f"{out} already exists; remove it or choose another --out")
    model, tokenizer, meta = load_checkpoint(args.checkpoint)
    meta = {**meta, "model": model.config.to_dict(), "dtype": args.dtype}  # the config as this diffar reads it
    write_checkpoint(out, model, meta, tokenizer, dtype=DTYPES[args.dtype])
    print(f"exported step {meta.get('step')} to {out} ({args.dtype})")
