"""`diffar chat`: a conversation with a chat model (an imported one with a chat template). Each line on stdin
is a user turn; the answer streams to stdout and one line of speed goes to stderr per turn. The whole
conversation is re-rendered by the model's template every turn; when it no longer leaves room for an answer,
the oldest exchanges are dropped (the system message stays) and stderr says so."""

from __future__ import annotations

import sys

from diffar.commands import flags
from diffar.commands.generate import chat_ids, sampling_options, speed_line, stream_answer
from diffar.errors import DiffarError


def register(subparsers) -> None:
    c = subparsers.add_parser("chat", help="chat with a chat model: user turns from stdin, answers streamed",
                              parents=[flags.seed(), flags.dtype(), flags.device(), flags.compile_step(),
                                       flags.prompt_lookup(), flags.sampling(), flags.threads()])
    c.add_argument("--checkpoint", required=True)
    c.add_argument("--system", help="a system message that opens the conversation")
    c.set_defaults(func=run)


def fit(method, messages: list[dict[str, str]], budget: int, settings, checkpoint: str) -> tuple[list[int], int]:
    """The ids of the conversation without its oldest exchanges, as few dropped as leave room for an answer of
    `budget` tokens (the system message and the last user turn always stay), and how many were dropped."""
    system = messages[:1] if messages[0]["role"] == "system" else []
    turns, dropped = messages[len(system):], 0
    while True:
        ids = chat_ids(method, system + turns, checkpoint)
        room = method.room(ids, settings)
        if room >= budget or len(turns) == 1:
            if room <= 0:
                raise DiffarError(f"this turn ({len(ids)} tokens with the template) leaves the model no room to "
                                  "answer")
            return ids, dropped
        turns, dropped = turns[2:], dropped + 1  # a user message and its answer


def run(args) -> None:
    import torch

    from diffar.generation import load_method

    flags.announce_compile(args)
    method = load_method(args.checkpoint, dtype=args.dtype, device=args.device, compile=args.compile,
                         prompt_lookup=args.prompt_lookup, datastore=args.datastore)
    settings = method.settings(sampling_options(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    chat_ids(method, messages + [{"role": "user", "content": "Hello"}], args.checkpoint)  # fail before any turn
    generator = torch.Generator().manual_seed(args.seed)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {args.checkpoint}: one line per turn, Ctrl-D ends", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\r\n")})
        ids, dropped = fit(method, messages, args.max_new_tokens, settings, args.checkpoint)
        if dropped:
            start = 1 if args.system else 0
            del messages[start:start + 2 * dropped]
            print(f"[the conversation outgrew the context: dropped its oldest {dropped} exchange(s)]",
                  file=sys.stderr)
        answer, result = stream_answer(method, ids, min(args.max_new_tokens, method.room(ids, settings)), settings,
                                       generator)
        messages.append({"role": "assistant", "content": answer})
        print(speed_line(method, result, settings, len(ids), args.dtype), file=sys.stderr)
