"""`diffar generate`: text from a prompt (argument or stdin) with AR (optionally speculative), ReFusion or DD2,
streamed to stdout, then one line of speed on stderr. `--chat` sends the prompt to a chat model as one user
message. `stream_answer` and `speed_line` are shared with `diffar chat`."""

from __future__ import annotations

import sys
from dataclasses import replace

from diffar.commands import flags
from diffar.errors import DiffarError


def register(subparsers) -> None:
    g = subparsers.add_parser("generate", help="generate text from a prompt (argument or stdin), streaming",
                              parents=[flags.seed(), flags.dtype(flags.DTYPE_HELP + ", every model loaded"),
                                       flags.device(), flags.compile_step(), flags.prompt_lookup(),
                                       flags.sampling(), flags.threads()])
    g.add_argument("--checkpoint", required=True)
    g.add_argument("--tokenizer", help="override the checkpoint's own tokenizer (must be the same one)")
    g.add_argument("--prompt", help="prompt text (default: read stdin)")
    g.add_argument("--chat", action="store_true",
                   help="a chat model (an imported one with a chat template): the prompt is one user message")
    g.add_argument("--no-cache", action="store_true", help="recompute every step (slow; for comparison)")
    g.add_argument("--no-echo", action="store_true", help="do not repeat a continuation prompt")
    g.add_argument("--draft", help="speculative decoding: a small AR checkpoint (same tokenizer) drafts tokens")
    g.add_argument("--k", type=flags.int_in(1, flags.MAX_DRAFT),
                   help=f"drafts verified per AR pass (1..{flags.MAX_DRAFT}, default 8; refusion: the model's block)")
    g.add_argument("--method", choices=["ar", "refusion", "dd2"], help="default: the checkpoint's own kind")
    g.add_argument("--steps", type=flags.int_in(1, flags.MAX_STEPS),
                   help=f"refusion: denoising steps per draft; dd2: sampling steps (1..{flags.MAX_STEPS}, default 1)")
    g.add_argument("--adaptive-steps", action="store_true", help="dd2: min(100, 50 + length // 10) steps")
    g.add_argument("--preset", choices=["speed", "quality"], help="dd2: the DD2 seed post's sampling presets")
    g.add_argument("--guidance", type=flags.float_in(0, 100),
                   help="dd2: classifier-free guidance scale (1 = conditional only)")
    g.add_argument("--tau", type=flags.float_in(0, 100), help="dd2: decoding temperature tau_max (0 = argmax)")
    g.add_argument("--tau-min", type=flags.float_in(0, 100), help="dd2: the temperature floor tau_min")
    g.add_argument("--sampler", choices=["ddim", "ddpm"], help="dd2: the scheduler (default ddim)")
    g.add_argument("--hybrid", metavar="AR_CHECKPOINT",
                   help="dd2: sample the first 50 tokens (one step unless --steps/--preset say more), then this AR "
                        "model continues with its KV cache")
    g.add_argument("--best-of", type=flags.positive_int, metavar="N",
                   help="dd2: sample N texts from independent noise and keep the likeliest (by the decoder's own "
                        "confidence, or by --judge)")
    g.add_argument("--judge", metavar="AR_CHECKPOINT", help="dd2 --best-of: an AR model that scores the samples")
    g.add_argument("--dynamic", action="store_true", help="refusion: the ReFusion seed post's dynamic schedule")
    g.add_argument("--plan-infill", type=flags.float_in(0, 1), metavar="THRESHOLD",
                   help="refusion: keep drafts at least this confident unverified (faster, not lossless)")
    g.add_argument("--plan-slot", type=flags.positive_int, default=1, metavar="N",
                   help="refusion --plan-infill: plan slots of N tokens, each kept or infilled whole (default 1)")
    g.add_argument("--tree", type=flags.int_in(1, flags.MAX_TREE), metavar="NODES",
                   help="refusion: verify a tree of the NODES likeliest drafts in each pass (lossless)")
    g.add_argument("--domain", help="refusion: the domain its diffusion stream drafts for (a stream trained with "
                                    "--domain-adapter on a mixture; one of its corpora)")
    g.set_defaults(func=run)


def sampling_options(args):
    """The `Options` that `flags.sampling` gives (0 and 1.0 leave them to the method)."""
    from diffar.generation import Options

    return Options(temperature=args.temperature or None, top_k=args.top_k or None,
                   top_p=None if args.top_p == 1.0 else args.top_p)


def chat_ids(method, messages: list[dict[str, str]], checkpoint: str) -> list[int]:
    """A conversation rendered by the model's chat template, up to where the assistant's answer begins."""
    if method.tokenizer.chat_template is None:
        raise DiffarError(f"{checkpoint} has no chat template: only a chat model imported with one (e.g. "
                          f"`make smollm2`) can chat")
    if method.task != "continuation":
        raise DiffarError(f"{checkpoint} is a {method.task} model; only a continuation (chat) model can chat")
    return method.tokenizer.encode_chat(messages)


def stream_answer(method, ids: list[int], budget: int, settings, generator):
    """Generate up to `budget` tokens after `ids`, writing the text to stdout as it becomes safe to show (whole
    characters) and ending the line; returns (the text, the GenerationResult)."""
    tokenizer, new, printed = method.tokenizer, [], ""

    def stream(row: int, token: int, origin: str) -> None:
        nonlocal printed
        new.append(token)
        text = tokenizer.decode_complete(new)
        if text is not None:
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text

    result = method.generate([ids], budget, settings, on_token=stream, generator=generator)
    text = tokenizer.decode(new)
    sys.stdout.write(text[len(printed):] + "\n")
    sys.stdout.flush()
    return text, result


def speed_line(method, result, settings, prompt_tokens: int, dtype: str) -> str:
    """The one line of speed every generating command prints (on stderr) after its text."""
    label, passes = method.describe(result, settings)
    n = result.new_tokens
    return (f"[{label}] {n} tokens in {result.seconds:.3f} s = {n / result.seconds:.1f} tokens/s | {passes} | "
            f"prompt {prompt_tokens} tokens | batch 1 | {dtype}")


# the `Options` field each generation flag sets
OPTION_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "steps": "--steps",
                "guidance_scale": "--guidance", "preset": "--preset", "tau": "--tau", "tau_min": "--tau-min",
                "sampler": "--sampler", "adaptive": "--adaptive-steps", "best_of": "--best-of",
                "domain": "--domain"}


def _options(args, method: str):
    """The sampling options the flags give; a flag the method does not read is an error, not ignored."""
    from diffar.generation import METHODS

    options = replace(sampling_options(args), steps=None if method == "refusion" else args.steps,  # its drafts'
                      guidance_scale=args.guidance, preset=args.preset, tau=args.tau, tau_min=args.tau_min,
                      sampler=args.sampler, adaptive=args.adaptive_steps, best_of=args.best_of or 1,
                      domain=args.domain)
    unread = sorted(OPTION_FLAGS[name] for name in options.given() - METHODS[method].options)
    if unread:
        reads = ", ".join(OPTION_FLAGS[name] for name in sorted(METHODS[method].options))
        raise DiffarError(f"{', '.join(unread)}: not read by --method {method}, which reads {reads}")
    if args.judge and (args.best_of or 1) == 1:
        raise DiffarError("--judge picks one of --best-of N samples; pass --best-of N (N >= 2) too")
    return options


def run(args) -> None:
    import torch

    from diffar.decoding.refusion import DraftSchedule
    from diffar.generation import load_method, resolve_method

    text = args.prompt if args.prompt is not None else read_stdin()
    if any("\ud800" <= c <= "\udfff" for c in text):
        raise DiffarError("--prompt is not valid UTF-8 text (the shell passed undecodable bytes)")
    if not text.strip():
        raise DiffarError("empty prompt: pass --prompt TEXT or text on stdin")
    name = resolve_method(args.checkpoint, args.method)
    if name != "refusion" and (args.dynamic or args.plan_infill is not None or args.tree):
        raise DiffarError("--dynamic, --plan-infill and --tree apply to --method refusion only")
    if args.plan_slot != 1 and args.plan_infill is None:
        raise DiffarError("--plan-slot sizes --plan-infill's slots; pass --plan-infill THRESHOLD too")
    options = _options(args, name)
    schedule = DraftSchedule(steps=1 if args.steps is None else args.steps, dynamic=args.dynamic,
                             plan_threshold=args.plan_infill, plan_slot=args.plan_slot, tree=args.tree or 0) \
        if name == "refusion" else None
    flags.announce_compile(args)
    method = load_method(args.checkpoint, name, dtype=args.dtype, tokenizer=args.tokenizer, draft=args.draft,
                         prompt_lookup=args.prompt_lookup, datastore=args.datastore, k=args.k, schedule=schedule,
                         judge=args.judge, hybrid=args.hybrid, use_cache=not args.no_cache, device=args.device,
                         compile=args.compile)
    settings = method.settings(options)
    ids = chat_ids(method, [{"role": "user", "content": text}], args.checkpoint) if args.chat else method.prompt(text)
    if method.room(ids, settings) <= 0:
        raise DiffarError(f"the prompt ({len(ids)} tokens) leaves this model no room to write")
    if method.task == "continuation" and not (args.no_echo or args.chat):
        sys.stdout.write(text)
    _, result = stream_answer(method, ids, args.max_new_tokens, settings,
                              torch.Generator().manual_seed(args.seed))
    print(speed_line(method, result, settings, len(ids), args.dtype), file=sys.stderr)


def read_stdin() -> str:
    """Standard input as text: UTF-8, or a one-line error (not a tokenizer traceback)."""
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DiffarError(f"standard input is not UTF-8 text (byte {e.start}: {e.reason})") from None
