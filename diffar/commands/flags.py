"""Flags that several commands share, as argparse parent parsers (`parents=[...]`): each is defined once, so
it has the same name, default and help wherever it appears."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from diffar.data.corpora import EMBEDDED
from diffar.training.trainer import TrainConfig

DEFAULT_TOKENIZER = Path(__file__).resolve().parents[2] / "tokenizer" / "diffar-8k.json"
CORPORA = (f"an embedded corpus ({', '.join(EMBEDDED)}; fixed splits), or a file/folder of your own: a text file, "
           "a folder of *.txt, or JSON Lines of source/target (gzipped or not). A file's splits: train = 19 of every "
           "20 records (or the first 95%% of each text), valid = the 20th (the last 5%%), test = the whole file "
           "(so test on a separate file). Several of one task, comma-separated (shakespeare,rv1909), are one mixture, "
           "each record labelled with its corpus (a domain adapter's domain)")
SPLIT_HELP = ("valid for comparing training choices (ablations), test for the reported figures; of your own file, "
              "valid is the held-out 1/20 of the training file and test a whole separate file")
INFERENCE_DTYPES = ("fp32", "bf16", "int8")
DTYPE_HELP = ("weights and activations at inference; bf16 is faster on CPUs with bf16 matrix units; int8: "
              "int8 weights in the linear layers, bf16 activations (CPU only)")


def int_in(lo: int, hi: int | None = None):
    """An argparse type: an integer in [lo, hi] (no upper bound: hi None)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        if value < lo or (hi is not None and value > hi):
            bounds = f"in {lo}..{hi}" if hi is not None else "positive" if lo == 1 else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value
    return parse


positive_int = int_in(1)


def float_in(lo: float, hi: float):
    """An argparse type: a finite number in [lo, hi]."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
        if not lo <= value <= hi:  # also rejects nan
            raise argparse.ArgumentTypeError(f"must be a number in [{lo:g}, {hi:g}], got {text}")
        return value
    return parse


SEEDS = int_in(0, 2**63 - 1)  # what torch.Generator.manual_seed takes
MAX_DRAFT = 64  # tokens drafted per verification (--k); more only costs
MAX_TREE = 1024  # nodes of a verified draft tree (--tree)
MAX_STEPS = 1000  # denoising steps (--steps)
MAX_BATCH = 1024  # a benchmark's batch size (--batch-sizes)


def text(value: str) -> str:
    """An argparse type: a non-empty string."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def _parent() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(add_help=False)


def out(help: str | None = None, required: bool = True) -> argparse.ArgumentParser:
    p = _parent()
    p.add_argument("--out", required=required, help=help)
    return p


def dtype(help: str = DTYPE_HELP) -> argparse.ArgumentParser:
    """The precision a generating command runs its models at."""
    p = _parent()
    p.add_argument("--dtype", default="fp32", choices=INFERENCE_DTYPES, help=help)
    return p


def device() -> argparse.ArgumentParser:
    """Where a generating command runs its models (decoding follows the model)."""
    p = _parent()
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N] (an error if this machine has none)")
    return p


def compile_step() -> argparse.ArgumentParser:
    """`--compile`: torch.compile of the AR model's decoding passes and a drafter's (models/precision.py)."""
    p = _parent()
    p.add_argument("--compile", action="store_true",
                   help="compile the AR model's decoding passes (and a block drafter's or draft model's) with "
                        "torch.compile: faster passes after a one-time compile per batch size (tens of seconds on "
                        "a CPU, cached on disk)")
    return p


def prompt_lookup() -> argparse.ArgumentParser:
    """Lossless drafting by prompt lookup, with a datastore (decoding/datastore.py), for AR and refusion models."""
    p = _parent()
    p.add_argument("--prompt-lookup", action="store_true",
                   help="speculative decoding: draft by copying n-grams (refusion: a copy goes first, the "
                        "drafter drafts where the text holds none)")
    p.add_argument("--datastore", help="with --prompt-lookup: a corpus whose train split's n-grams add a tree of "
                                       "likely continuations to each draft, e.g. `distill data` records of this "
                                       "model's own responses (retrieval-based speculative decoding)")
    return p


def announce_compile(args) -> None:
    if args.compile:
        print("--compile: the first decoding step of each batch size compiles (tens of seconds on a CPU the first "
              "time; later runs read inductor's cache)", file=sys.stderr)


def sampling() -> argparse.ArgumentParser:
    """The budget and sampling flags of the commands that write an AR model's text (generate, chat)."""
    p = _parent()
    p.add_argument("--max-new-tokens", type=positive_int, default=128,
                   help="the most new tokens (an AR model refuses more than its context holds; a DD2 model writes "
                        "at most its canvas, which the source sets)")
    p.add_argument("--temperature", type=float_in(0, 100), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int_in(0), default=0, help="0 = no top-k cut")
    p.add_argument("--top-p", type=float_in(0, 1), default=1.0)
    return p


def seed() -> argparse.ArgumentParser:
    """The seed of a sampling command (training's --seed is a TrainConfig field)."""
    p = _parent()
    p.add_argument("--seed", type=SEEDS, default=0)
    return p


def split(choices: Sequence[str] = ("valid", "test"), help: str | None = SPLIT_HELP) -> argparse.ArgumentParser:
    p = _parent()
    p.add_argument("--split", default="test", choices=choices, help=help)
    return p


def training() -> argparse.ArgumentParser:
    """A training run: its data, its run folder and threads, and every TrainConfig field as a flag (listed in a
    group of their own, after the model's flags)."""
    p = argparse.ArgumentParser(add_help=False, parents=[threads()])
    p.add_argument("--corpus", required=True, help=CORPORA)
    p.add_argument("--valid-corpus", help="validation data, all of it (default: the corpus's valid split); with it, "
                                           "nothing of a --corpus file is held out")
    run = p.add_argument_group("training")
    run.add_argument("--out", required=True, help="run folder (checkpoints, metrics.jsonl)")
    run.add_argument("--override", action="store_true",
                     help="resume even though training settings (--lr, --batch-size, --seed...) changed; the change "
                          "is recorded in the checkpoint's history")
    for f in fields(TrainConfig):
        run.add_argument(f"--{f.name.replace('_', '-')}", type=SEEDS if f.name == "seed" else type(f.default),
                         default=f.default,
                         help=f"(default {f.default})")
    return p


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig that the flags of `training()` spell out."""
    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})


def threads() -> argparse.ArgumentParser:
    """The CPU threads of a command that computes (default: torch's, one per core); `cli.main` applies it."""
    p = _parent()
    p.add_argument("--threads", type=positive_int,
                   help="torch CPU threads (default: one per core; fewer when other work shares the machine)")
    return p


def use_threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def dd2_training() -> argparse.ArgumentParser:
    """The flags `train dd2` and `distill dd2` share besides `training()`'s."""
    p = _parent()
    p.add_argument("--schedule", choices=["linear", "cosine", "learned"], help="noise schedule (default cosine)")
    p.add_argument("--cond-drop", type=float, help="share of examples trained without their source (CFG; 0.1)")
    p.add_argument("--source-encoder", help="an AR checkpoint (e.g. the teacher) whose frozen hidden states over the "
                                            "source join the denoiser's source prefix")
    p.add_argument("--canvas-len", type=positive_int,
                   help="continuation: tokens per canvas (default: the autoencoder's target_len); longer outputs "
                        "are sampled canvas after canvas")
    return p
