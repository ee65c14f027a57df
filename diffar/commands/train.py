"""`diffar train ar|refusion|vqvae|dd2`: train a model from a preset and/or checkpoints (resumes if --out holds
a run). What each starts from is built in `diffar.training.setup`."""

from __future__ import annotations

from pathlib import Path

import torch

from diffar.checkpoint import resolve
from diffar.commands import flags
from diffar.data.corpora import domain_name, load_corpus, mixture_parts
from diffar.errors import DiffarError
from diffar.models.dd2 import PRESETS as DD2_PRESETS
from diffar.models.drafter import PRESETS as DRAFTER_PRESETS
from diffar.models.refusion import PRESETS as REFUSION_PRESETS
from diffar.models.transformer import PRESETS, Transformer, TransformerConfig
from diffar.models.vqvae import PRESETS as VQVAE_PRESETS
from diffar.models.vqvae import TextVQVAE, VQVAEConfig
from diffar.tokenizer import Tokenizer
from diffar.training import setup
from diffar.training.feature_cache import build_cache
from diffar.training.lora import add_lora


def register(subparsers) -> None:
    tr = subparsers.add_parser("train", help="train a model (resumes if --out holds a run)")
    models = tr.add_subparsers(dest="model_kind", required=True, metavar="MODEL")
    ar = models.add_parser("ar", help="the autoregressive transformer baseline, or fine-tune one (--init)",
                           parents=[flags.training()])
    ar.add_argument("--preset", choices=sorted(PRESETS), help="a new model's size (default small)")
    ar.add_argument("--init", help="an AR checkpoint (trained or imported) to fine-tune: its architecture, weights "
                                   "and tokenizer")
    ar.add_argument("--tokenizer", help=f"a new model's (default {flags.DEFAULT_TOKENIZER})")
    ar.add_argument("--lora-rank", type=flags.positive_int,
                    help="with --init: train rank-R adapters on every linear layer (peft), the model frozen")
    ar.add_argument("--lora-alpha", type=float, default=16.0, help="the adapters' scale is alpha / rank (default 16)")
    ar.add_argument("--block-size", type=flags.positive_int, help="training sequence length (default: the context)")
    ar.set_defaults(func=run_ar)
    _register_refusion(models)

    vq = models.add_parser("vqvae", help="DD2 stage 1: the text autoencoder (VQ-VAE) the diffusion runs in",
                           parents=[flags.training()])
    vq.add_argument("--preset", default="small", choices=sorted(VQVAE_PRESETS))
    vq.add_argument("--bottleneck", choices=["vq", "kl"], help="vector-quantised (default) or KL-continuous")
    vq.add_argument("--d-latent", type=flags.positive_int, help="latent width (default 256)")
    vq.add_argument("--codebook-size", type=flags.positive_int, help="codes per group")
    vq.add_argument("--groups", type=flags.positive_int, help="product-quantisation groups per latent")
    vq.add_argument("--tokenizer", default=str(flags.DEFAULT_TOKENIZER))
    vq.set_defaults(func=run_vqvae)

    dd = models.add_parser("dd2", help="DD2 stage 2: an eps-predicting diffusion model in a VQ-VAE's latent space",
                           parents=[flags.training(), flags.dd2_training()])
    dd.add_argument("--vqvae", help="the trained autoencoder (diffar train vqvae); its tokenizer is used")
    dd.add_argument("--init", help="a DD2 checkpoint to continue from (must be built on --vqvae, if given)")
    dd.add_argument("--preset", default="small", choices=sorted(DD2_PRESETS))
    dd.set_defaults(func=run_dd2)


def _register_refusion(models) -> None:
    rf = models.add_parser("refusion", help="ReFusion: a diffusion stream drafting for a (frozen) AR stream",
                           parents=[flags.training()])
    rf.add_argument("--ar", help="AR checkpoint to start the AR stream from (its tokenizer is used)")
    rf.add_argument("--init", help="ReFusion checkpoint (e.g. stage 1) to start both streams from; with --drafter "
                                   "block, a drafter checkpoint to go on from")
    rf.add_argument("--preset", choices=sorted({*REFUSION_PRESETS, *DRAFTER_PRESETS}),
                    help="the diffusion stream's size (default small; a block drafter's: block)")
    rf.add_argument("--stage", choices=["diffusion", "joint"], default="joint",
                    help="diffusion: the diffusion stream alone (stage 1); joint: with fusion and the AR stream")
    rf.add_argument("--train-ar", action="store_true", help="also train the AR stream (default: frozen)")
    rf.add_argument("--block", type=flags.positive_int, help="tokens drafted per block")
    rf.add_argument("--anchors", type=flags.positive_int, help="training blocks per sequence")
    rf.add_argument("--schedule", choices=["linear", "cosine", "learned"], help="noise schedule")
    rf.add_argument("--ar-fusion-layers", type=int, nargs="*", help="AR layers that read the diffusion stream")
    rf.add_argument("--ar-weight", type=float, help="weight of CE_AR (default 1)")
    rf.add_argument("--mse-weight", type=float, help="weight of the diffusion MSE (default 0.5)")
    rf.add_argument("--kl-weight", type=float, help="weight of KL(AR || diffusion) (default 0.1); a block drafter's: "
                                                    "of KL from the AR model's 8 likeliest tokens to its drafts, next "
                                                    "to the cross-entropy with the AR model's greedy token (default 0)")
    rf.add_argument("--grad-checkpoint", action="store_true", default=None, help="recompute activations in backward")
    rf.add_argument("--domain-adapter", action="store_true", default=None,
                    help="a domain adapter in the diffusion stream (models/domain_adapter.py): one embedding per "
                         "corpus of the --corpus mixture (e.g. shakespeare,rv1909), each sequence told its own; "
                         "decoding then names one (--domain)")
    rf.add_argument("--tokenizer", default=str(flags.DEFAULT_TOKENIZER), help="without --ar")
    rf.add_argument("--drafter", choices=["embedding", "block"], default="embedding",
                    help="embedding: Gaussian diffusion in the embedding space (the shipped 7M models); block: a "
                         "DFlash-style block drafter reading several AR layers, for pretrained models (presets "
                         f"{', '.join(DRAFTER_PRESETS)}; default block)")
    rf.add_argument("--draft-layers", type=flags.positive_int, help="block drafter: its layers (default 2)")
    rf.add_argument("--feature-layers", type=int, nargs="+",
                    help="block drafter: the AR layers it reads (default: 3 spread through the depth)")
    rf.add_argument("--draft-vocab", type=int,
                    help="block drafter: draft over the N most frequent training tokens (default 0: all)")
    rf.add_argument("--loss-decay", type=float, help="block drafter: slot j's loss weight exp(-(j-1)/decay) (7)")
    rf.add_argument("--feature-cache", type=Path,
                    help="block drafter: compute the AR model's part of training (its features, greedy and likeliest "
                         "tokens) once for the training data, in this folder (reused; an interrupted build resumes), "
                         "instead of at every step")
    rf.add_argument("--block-size", type=flags.positive_int,
                    help="training sequence length, e.g. 256 to chunk long text")
    rf.set_defaults(func=run_refusion)


def run_ar(args) -> None:
    lora = {"rank": args.lora_rank, "alpha": args.lora_alpha} if args.lora_rank else None
    torch.manual_seed(args.seed)  # a new model's weights, or new adapters'
    if args.init:
        if args.preset or args.tokenizer:
            raise DiffarError("--init brings its own architecture and tokenizer: drop --preset and --tokenizer")
        model, tokenizer = setup.ar_start(args.init, load_corpus(args.corpus, "train").task)
        if lora:
            model = add_lora(model, **lora)
    elif lora:
        raise DiffarError("--lora-rank adapts a trained model: pass --init CHECKPOINT")
    else:
        tokenizer = Tokenizer.load(args.tokenizer or flags.DEFAULT_TOKENIZER)
        cfg = TransformerConfig.from_preset(args.preset or "small", vocab_size=tokenizer.vocab_size)
        model = Transformer(cfg)
    data = setup.datasets(tokenizer, args.corpus, args.valid_corpus, model.config.max_seq_len, args.block_size)
    if not args.init:
        for note in setup.data_advice(args.corpus, tokenizer, data, sum(p.numel() for p in model.parameters())):
            print(note)
    setup.fit(model, "ar", tokenizer, data, flags.train_config(args), args.out, init=args.init, lora=lora,
              override=args.override)


def run_refusion(args) -> None:
    if args.drafter == "block":
        return run_block_drafter(args)
    given = [f"--{n.replace('_', '-')}" for n in ("draft_layers", "feature_layers", "draft_vocab", "loss_decay",
                                                   "feature_cache") if getattr(args, n) is not None]
    if given:
        raise DiffarError(f"{', '.join(given)} apply to --drafter block only")
    domains = tuple(domain_name(part) for part in mixture_parts(args.corpus)) if args.domain_adapter else None
    model, tokenizer = setup.refusion_model(
        args.tokenizer, ar=args.ar, init=args.init, preset=args.preset or "small", seed=args.seed, stage=args.stage,
        freeze_ar=not args.train_ar, block=args.block, anchors=args.anchors, schedule=args.schedule,
        ar_weight=args.ar_weight, mse_weight=args.mse_weight, kl_weight=args.kl_weight,
        grad_checkpoint=args.grad_checkpoint, domains=domains,
        ar_fusion_layers=None if args.ar_fusion_layers is None else tuple(args.ar_fusion_layers))
    data = setup.datasets(tokenizer, args.corpus, args.valid_corpus, model.config.ar.max_seq_len, args.block_size,
                          model.config.domains)
    setup.fit(model, "refusion", tokenizer, data, flags.train_config(args), args.out, override=args.override)


def run_block_drafter(args) -> None:
    """`train refusion --drafter block`: the target (--ar) frozen, the drafter's checkpoint naming it."""
    if not args.ar:
        raise DiffarError("a block drafter drafts for a trained AR model: pass --ar CHECKPOINT")
    if args.train_ar or args.stage != "joint" or args.domain_adapter:
        raise DiffarError("--train-ar, --stage and --domain-adapter apply to the embedding drafter only")
    if (args.preset or "block") not in DRAFTER_PRESETS:
        raise DiffarError(f"a block drafter's preset is one of {', '.join(DRAFTER_PRESETS)}, not {args.preset}")
    model, tokenizer, task = setup.drafter_model(
        args.ar, preset=args.preset or "block", precision=args.precision, seed=args.seed, init=args.init,
        n_layer=args.draft_layers,
        block=args.block, anchors=args.anchors, draft_vocab=args.draft_vocab, loss_decay=args.loss_decay,
        kl_weight=args.kl_weight, feature_layers=args.feature_layers and tuple(args.feature_layers))
    data = setup.datasets(tokenizer, args.corpus, args.valid_corpus, model.config.target.max_seq_len, args.block_size)
    data = data._replace(task=task)  # it decodes through its target: prompts read as the target's (e.g. seq2seq)
    if model.config.draft_vocab:
        share = model.set_vocab(setup.token_counts(data.train, model.config.target.vocab_size))
        print(f"draft vocabulary: its {model.config.draft_vocab} tokens cover {share:.1%} of the training text")
    if args.feature_cache:
        cached = build_cache(data.train, model, args.feature_cache, precision=args.precision,
                             target_weights=resolve(args.ar) / "model.safetensors", batch_size=args.batch_size)
        data = data._replace(train=cached)
    setup.fit(model, "drafter", tokenizer, data, flags.train_config(args), args.out, target=args.ar,
              override=args.override)


def run_vqvae(args) -> None:
    tokenizer = Tokenizer.load(args.tokenizer)
    overrides = {k: getattr(args, k) for k in ("bottleneck", "d_latent", "codebook_size", "groups")
                 if getattr(args, k) is not None}
    cfg = VQVAEConfig.from_preset(args.preset, tokenizer.vocab_size, **overrides)
    torch.manual_seed(args.seed)
    model = TextVQVAE(cfg)
    data = setup.canvas_datasets(tokenizer, args.corpus, args.valid_corpus, cfg, with_source=False)
    setup.fit(model, "vqvae", tokenizer, data, flags.train_config(args), args.out, override=args.override)


def run_dd2(args) -> None:
    torch.manual_seed(args.seed)
    start = setup.dd2_model(args.corpus, args.out, prediction="eps", preset=args.preset, vqvae=args.vqvae,
                            init=args.init, source_encoder=args.source_encoder, canvas_len=args.canvas_len,
                            schedule=args.schedule, cond_drop=args.cond_drop)
    setup.fit_dd2(start, args.corpus, args.valid_corpus, flags.train_config(args), args.out, override=args.override)
