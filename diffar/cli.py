"""The `diffar` command line. Each command is a module of diffar/commands/ that adds its own parser; this file
only wires them together. Any DiffarError (bad input) becomes one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import sys

from diffar.commands import bench, chat, distill, export, generate, loadtest, serve, tokenizer, train
from diffar.commands import eval as evaluate
from diffar.commands import flags, import_
from diffar.errors import DiffarError, Interrupted

COMMANDS = (tokenizer, train, distill, export, import_, generate, chat, evaluate, bench, serve, loadtest)  # in --help's order


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2) like every other diffar error."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="diffar", description="Fast text generation: diffusion fused with AR.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    flags.use_threads(args)
    try:
        args.func(args)
    except DiffarError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # an unwritable --out, a full disk...
        print(f"error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(e, file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
