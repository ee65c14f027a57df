"""`diffar distill dd2`: a one-step DD2 generator (x0 prediction) trained on an AR teacher's greedy outputs, or
(`--coupled`) on its samples, each for the noise the generator reads.
`diffar distill data`: a model's own responses to prompts it writes or is given, the training data of its
drafter (`diffar train refusion --drafter block --corpus FILE`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from diffar.checkpoint import load_for_inference
from diffar.commands import flags
from diffar.data.prompts import DATA_SOURCES
from diffar.errors import DiffarError
from diffar.models.dd2 import PRESETS as DD2_PRESETS
from diffar.models.precision import PRECISIONS
from diffar.training import setup
from diffar.training.self_data import self_data

# the DD2Config fields this command sets from flags of the same name (None: the preset's or --init's)
OVERRIDES = ("schedule", "cond_drop", "mse_weight", "ce_weight", "bleu_weight", "semantic_weight", "energy_weight",
             "refine_prob", "full_noise_prob", "coupled")


def register(subparsers) -> None:
    di = subparsers.add_parser("distill", help="distil an AR teacher into a fast student")
    models = di.add_subparsers(dest="model_kind", required=True, metavar="MODEL")
    dd = models.add_parser("dd2", help="a one-step DD2 generator (x0 prediction) trained on the teacher's outputs",
                           parents=[flags.training(), flags.dd2_training()])
    dd.add_argument("--teacher", required=True, help="the AR checkpoint whose outputs are the targets")
    dd.add_argument("--vqvae", help="the autoencoder to build on (without --init)")
    dd.add_argument("--init", help="a DD2 checkpoint to start from, e.g. the stage-2 eps model")
    dd.add_argument("--preset", default="small", choices=sorted(DD2_PRESETS))
    dd.add_argument("--teacher-examples", type=flags.positive_int,
                    help="distil on N training examples spread evenly over the corpus")
    dd.add_argument("--teacher-batch-size", type=flags.positive_int, default=32)
    dd.add_argument("--mse-weight", type=float, help="latent MSE (default 1)")
    dd.add_argument("--ce-weight", type=float, help="token cross-entropy through the decoder (default 1)")
    dd.add_argument("--bleu-weight", type=float, help="minimum-risk expected-BLEU loss (default 0)")
    dd.add_argument("--semantic-weight", type=float, help="1 - cosine of mean embeddings (default 0)")
    dd.add_argument("--energy-weight", type=float,
                    help="the teacher's energy (cross-entropy) of the relaxed one-step output (ENGINE; default 0)")
    dd.add_argument("--refine-prob", type=float,
                    help="share of the t < 1 examples noised from the model's own one-step draft, so that "
                         "few-step sampling refines drafts (default 0)")
    dd.add_argument("--full-noise-prob", type=float,
                    help="share of examples at t = 1, where one-step sampling starts (default 0.75); the energy "
                         "scores only these")
    dd.add_argument("--coupled", action=argparse.BooleanOptionalAction,
                    help="coupled distillation (DD1): each example's target is the teacher's sample for a noise of "
                         "its own, which the generator reads as its input (default: the teacher's greedy text)")
    dd.add_argument("--temperature", type=flags.float_in(0, 100),
                    help="the coupled teacher's sampling temperature (default 0.8)")
    dd.add_argument("--top-p", type=flags.float_in(0, 1), help="the coupled teacher's top-p (default 0.95)")
    dd.set_defaults(func=run_dd2)

    da = models.add_parser("data", help="a model's own greedy responses, as token ids (a drafter's training data)",
                           parents=[flags.out("a JSONL file; records are appended, a finished source is reused "
                                              "(resumed with the same settings)"),
                                    flags.seed(), flags.device(), flags.threads()])
    da.add_argument("--checkpoint", required=True, help="the AR model (a chat model for --source chat and code)")
    da.add_argument("--source", required=True, choices=DATA_SOURCES,
                    help="chat: instructions the model writes itself (Magpie); code: standard-library functions to "
                         "complete; shakespeare: windows of the train split to continue; corpus: the train split of "
                         "--corpus (a seq2seq corpus's sources, a continuation corpus's windows); not answered but "
                         "recorded as they are, in windows of --max-new-tokens + 1: stdlib (Python's standard "
                         "library's modules, in an order shuffled by --seed), text (a continuation --corpus)")
    da.add_argument("--corpus", help="--source corpus or text: the corpus (default: the one the checkpoint was "
                                     "trained on)")
    da.add_argument("--examples", required=True, type=flags.positive_int, help="records of this source")
    da.add_argument("--max-new-tokens", type=flags.positive_int, default=256)
    da.add_argument("--batch-size", type=flags.positive_int, default=8)
    da.add_argument("--dtype", default="bf16", choices=PRECISIONS, help="the model's precision (default bf16)")
    da.set_defaults(func=run_data)


def run_dd2(args) -> None:
    torch.manual_seed(args.seed)
    start = setup.dd2_model(args.corpus, args.out, prediction="x0", preset=args.preset, vqvae=args.vqvae,
                            init=args.init, source_encoder=args.source_encoder, canvas_len=args.canvas_len,
                            teacher_temperature=args.temperature, teacher_top_p=args.top_p,
                            **{k: getattr(args, k) for k in OVERRIDES})
    if not start.model.config.coupled and (args.temperature, args.top_p) != (None, None):
        raise DiffarError("--temperature and --top-p set the coupled teacher's sampling; add --coupled")
    examples = setup.distillation_pairs(start, args.teacher, args.corpus, args.out, limit=args.teacher_examples,
                                        batch_size=args.teacher_batch_size, seed=args.seed)
    setup.fit_dd2(start, args.corpus, args.valid_corpus, flags.train_config(args), args.out, examples,
                  override=args.override)


def run_data(args) -> None:
    model, tokenizer, meta = load_for_inference(args.checkpoint, dtype=args.dtype, device=args.device)
    if meta["kind"] != "ar":
        raise DiffarError(f"--checkpoint {args.checkpoint} is a {meta['kind']} checkpoint, not an AR one")
    if args.corpus and args.source not in ("corpus", "text"):
        raise DiffarError("--corpus names the data of --source corpus or text")
    made = self_data(model, tokenizer, args.source, args.examples, Path(args.out), max_new_tokens=args.max_new_tokens,
                     batch_size=args.batch_size, seed=args.seed, corpus=args.corpus or meta["corpus"])
    print(f"{args.out}: {made} {args.source} records made, {args.examples - made} were there already")
