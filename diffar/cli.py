"""The `diffar` command line. Each subcommand parses its flags and hands off to the library;
any DiffarError (bad input) becomes one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, replace
from pathlib import Path

from diffar.errors import DiffarError

DEFAULT_TOKENIZER = Path(__file__).resolve().parent.parent / "tokenizer" / "diffar-8k.json"


# ---- tokenizer ------------------------------------------------------------------------------------
def cmd_tokenizer_train(args) -> None:
    from diffar.data.corpora import load_corpus
    from diffar.tokenizer import train_tokenizer

    texts = [t for name in args.corpus for t in load_corpus(name, "train").texts()]
    tok = train_tokenizer(texts, args.vocab_size, args.min_frequency)
    tok.save(args.out)
    print(f"saved {tok.vocab_size}-token tokenizer to {args.out} (sha256 {tok.sha256[:12]})")


# ---- train / export -------------------------------------------------------------------------------
def _train_config(args):
    from diffar.training.trainer import TrainConfig

    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})


def _datasets(args, tokenizer, max_seq_len: int):
    """(train, valid, task, corpus name, block size) for a `train` command."""
    from diffar.data.batching import build_dataset
    from diffar.data.corpora import load_corpus

    block = args.block_size or max_seq_len
    if block > max_seq_len:
        raise DiffarError(f"--block-size {block} exceeds the model's context of {max_seq_len}")
    train_corpus = load_corpus(args.corpus, "train")
    valid_corpus = load_corpus(args.valid_corpus, "valid", whole=True) if args.valid_corpus \
        else load_corpus(args.corpus, "valid")
    if valid_corpus.task != train_corpus.task:
        raise DiffarError(f"--valid-corpus is a {valid_corpus.task} corpus, --corpus a {train_corpus.task} one")
    train_data = build_dataset(train_corpus, tokenizer, block)
    valid_data = build_dataset(valid_corpus, tokenizer, block)
    for name, data in (("train", train_data), ("valid", valid_data)):
        if getattr(data, "dropped", 0):
            print(f"note: {data.dropped} {name} pairs longer than the {block}-token block are left out")
    return train_data, valid_data, train_corpus.task, train_corpus.name, block


def _canvas_datasets(args, tokenizer, vq_cfg, with_source: bool, examples=None, max_source: int | None = None):
    """(train, valid, task, corpus name, canvas length) for the latent-diffusion models; `examples`
    replaces the training pairs (distillation: the teacher's outputs)."""
    from diffar.data.batching import CanvasDataset, canvas_examples
    from diffar.data.corpora import load_corpus

    train_corpus = load_corpus(args.corpus, "train")
    valid_corpus = load_corpus(args.valid_corpus, "valid", whole=True) if args.valid_corpus \
        else load_corpus(args.corpus, "valid")
    if valid_corpus.task != train_corpus.task:
        raise DiffarError(f"--valid-corpus is a {valid_corpus.task} corpus, --corpus a {train_corpus.task} one")
    seq2seq = train_corpus.task == "seq2seq"
    width = vq_cfg.width if seq2seq else (lambda n: vq_cfg.target_len)
    datasets = []
    for name, corpus, pairs in (("train", train_corpus, examples), ("valid", valid_corpus, None)):
        pairs = pairs or canvas_examples(corpus, tokenizer, vq_cfg.prompt_len, vq_cfg.target_len,
                                         stride=vq_cfg.prompt_len)
        data = CanvasDataset(pairs, tokenizer, width, vq_cfg.max_len, eos=seq2seq, with_source=with_source,
                             max_source=max_source)
        if data.dropped:
            print(f"note: {data.dropped} {name} pairs longer than the {vq_cfg.max_len}-position canvas"
                  + (f" or the {max_source}-token source" if max_source else "") + " are left out")
        datasets.append(data)
    return datasets[0], datasets[1], train_corpus.task, train_corpus.name, vq_cfg.max_len


def _fit(args, model, model_cfg, kind: str, tokenizer, datasets) -> None:
    from diffar.training.trainer import Trainer

    cfg = _train_config(args)
    train_data, valid_data, task, corpus, block = datasets
    meta = {"kind": kind, "model": model_cfg.to_dict(), "task": task, "corpus": corpus, "block_size": block}
    metrics = Trainer(model, train_data, valid_data, cfg, args.out, meta, tokenizer).fit()
    if metrics:
        ppl = f", val ppl {metrics['val_ppl']:.2f}" if "val_ppl" in metrics else ""
        print(f"done: step {metrics['step']}, val loss {metrics['val_loss']:.4f}{ppl}")


def cmd_train(args) -> None:
    import torch

    from diffar.models.transformer import Transformer, TransformerConfig
    from diffar.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.load(args.tokenizer)
    model_cfg = TransformerConfig.from_preset(args.preset, vocab_size=tokenizer.vocab_size)
    torch.manual_seed(args.seed)
    _fit(args, Transformer(model_cfg), model_cfg, "ar", tokenizer, _datasets(args, tokenizer, model_cfg.max_seq_len))


def cmd_train_refusion(args) -> None:
    import torch

    from diffar.checkpoint import load_checkpoint
    from diffar.models.refusion import RefusionConfig, RefusionModel
    from diffar.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    ar = init = None
    if args.ar:
        ar, tokenizer, ar_meta = load_checkpoint(args.ar)
        if ar_meta["kind"] != "ar":
            raise DiffarError(f"--ar {args.ar} is a {ar_meta['kind']} checkpoint, not an AR one")
    else:
        tokenizer = Tokenizer.load(args.tokenizer)
    if args.init:
        init, init_tokenizer, init_meta = load_checkpoint(args.init)
        if init_meta["kind"] != "refusion":
            raise DiffarError(f"--init {args.init} is a {init_meta['kind']} checkpoint, not a ReFusion one")
        if init_tokenizer.sha256 != tokenizer.sha256 or (
                ar is not None and init.config.ar.to_dict() != ar.config.to_dict()):
            raise DiffarError(f"--init {args.init} and --ar {args.ar} do not belong together "
                              f"(different tokenizer or AR stream shape)")
    overrides = {k: getattr(args, k) for k in ("block", "anchors", "schedule", "ar_weight", "mse_weight",
                                               "kl_weight", "grad_checkpoint") if getattr(args, k) is not None}
    overrides["stage"] = args.stage
    overrides["freeze_ar"] = not args.train_ar
    if args.ar_fusion_layers is not None:
        overrides["ar_fusion_layers"] = tuple(args.ar_fusion_layers)
    model_cfg = RefusionConfig.from_dict({**init.config.to_dict(), **overrides}) if init else \
        RefusionConfig.from_preset(args.preset, tokenizer.vocab_size, **overrides)
    if model_cfg.stage == "joint" and model_cfg.freeze_ar and ar is None and init is None:
        raise DiffarError("a frozen AR stream must come from a trained model: pass --ar CHECKPOINT (or --train-ar)")
    torch.manual_seed(args.seed)
    model = RefusionModel(model_cfg)
    if init is not None:
        model.diffuser.load_state_dict(init.diffuser.state_dict())
        model.ar.load_state_dict(init.ar.state_dict())
    if ar is not None:  # the AR stream; the diffusion space too unless it comes trained with --init
        model.init_from_ar(ar, embeddings=init is None)
    _fit(args, model, model_cfg, "refusion", tokenizer, _datasets(args, tokenizer, model_cfg.ar.max_seq_len))


def cmd_train_vqvae(args) -> None:
    import torch

    from diffar.models.vqvae import TextVQVAE, VQVAEConfig
    from diffar.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.load(args.tokenizer)
    overrides = {k: getattr(args, k) for k in ("bottleneck", "d_latent", "codebook_size", "groups")
                 if getattr(args, k) is not None}
    model_cfg = VQVAEConfig.from_preset(args.preset, tokenizer.vocab_size, **overrides)
    torch.manual_seed(args.seed)
    _fit(args, TextVQVAE(model_cfg), model_cfg, "vqvae", tokenizer,
         _canvas_datasets(args, tokenizer, model_cfg, with_source=False))


def _load_kind(path: str, kind: str, flag: str):
    """(model, tokenizer, meta) of a checkpoint that must be of `kind`."""
    from diffar.checkpoint import load_checkpoint

    model, tokenizer, meta = load_checkpoint(path)
    if meta["kind"] != kind:
        raise DiffarError(f"{flag} {path} is a {meta['kind']} checkpoint, not a {kind} one")
    return model, tokenizer, meta


def _dd2_start(args, prediction: str):
    """The DD2 model a `train dd2` / `distill dd2` run starts from: --init (a DD2 checkpoint) and/or --vqvae
    (the autoencoder to build on), which must belong together, and --source-encoder (an AR model that reads
    the source; an --init model keeps its own, or gains one through a zero map, so it starts out unchanged).
    Returns (model, config, tokenizer)."""
    from torch import nn

    from diffar.checkpoint import load_ar
    from diffar.data.corpora import load_corpus
    from diffar.models.dd2 import DD2Config, DD2Model, same_weights

    init = vqvae = None
    if args.init:
        init, tokenizer, _ = _load_kind(args.init, "dd2", "--init")
    if args.vqvae:
        vqvae, vq_tokenizer, _ = _load_kind(args.vqvae, "vqvae", "--vqvae")
        if init is not None and (vq_tokenizer.sha256 != tokenizer.sha256 or not same_weights(init.vqvae, vqvae)):
            raise DiffarError(f"--init {args.init} was trained in another VQ-VAE than --vqvae {args.vqvae}; "
                              f"they do not belong together")
        tokenizer = vq_tokenizer
    if init is None and vqvae is None:
        raise DiffarError("pass --vqvae CHECKPOINT (diffar train vqvae) or --init DD2_CHECKPOINT")
    if init is not None and args.schedule and args.schedule != init.config.schedule:
        raise DiffarError(f"--init {args.init} was trained on the {init.config.schedule} noise schedule; "
                          f"--schedule cannot change it")
    if init is not None and (init.config.prediction, prediction) == ("x0", "eps"):
        raise DiffarError(f"--init {args.init} is a distilled (x0) generator; continue it with diffar distill dd2")
    task = load_corpus(args.corpus, "train").task
    if init is not None and (init.config.eos_id is not None) != (task == "seq2seq"):
        trained_on = "seq2seq" if init.config.eos_id is not None else "continuation"
        raise DiffarError(f"--init {args.init} was trained on {trained_on} data; --corpus {args.corpus} is a "
                          f"{task} one")
    encoder = None
    if args.source_encoder:
        encoder = load_ar(args.source_encoder, tokenizer, "--source-encoder")
        if init is not None and init.source_encoder is not None and not same_weights(init.source_encoder, encoder):
            raise DiffarError(f"--init {args.init} does not read its source through --source-encoder "
                              f"{args.source_encoder}; an --init model keeps its own")
    if args.canvas_len and task != "continuation":
        raise DiffarError("--canvas-len applies to continuation corpora (a seq2seq canvas is sized by its source)")
    if args.canvas_len and init is not None and args.canvas_len != init.config.vqvae.target_len:
        raise DiffarError(f"--init {args.init} samples canvases of {init.config.vqvae.target_len} tokens; "
                          f"--canvas-len cannot change that")
    if args.canvas_len and vqvae is not None:  # a layout choice: the same autoencoder reads canvases of any length
        vqvae.config = replace(vqvae.config, target_len=args.canvas_len)
    overrides = {k: getattr(args, k) for k in ("schedule", "cond_drop", "mse_weight", "ce_weight", "bleu_weight",
                                               "semantic_weight", "energy_weight", "refine_prob",
                                               "full_noise_prob")
                 if getattr(args, k, None) is not None}
    overrides["prediction"] = prediction
    if encoder is not None:
        overrides["source_encoder"] = encoder.config
    if init is not None:
        cfg = DD2Config.from_dict({**init.config.to_dict(), **overrides})
    else:
        cfg = DD2Config.from_preset(args.preset, vqvae.config, **overrides)
    model = DD2Model(cfg)
    if init is None:
        model.set_vqvae(vqvae)
    elif encoder is not None and init.source_encoder is None:
        model.load_state_dict(init.state_dict(), strict=False)  # all but the new encoder and its map
        nn.init.zeros_(model.denoiser.states_in.weight)
        nn.init.zeros_(model.denoiser.states_in.bias)
    else:
        model.load_state_dict(init.state_dict())
    if encoder is not None:
        model.set_source_encoder(encoder)
    return model, cfg, tokenizer


def _fit_dd2(args, model, cfg, tokenizer, examples=None) -> None:
    datasets = _canvas_datasets(args, tokenizer, cfg.vqvae, with_source=True, examples=examples,
                                max_source=cfg.max_source_len)
    train = datasets[0]
    cfg.eos_id = tokenizer.eos_id if datasets[2] == "seq2seq" else None
    if (Path(args.out) / "latest").is_file():  # a resumed run keeps the scale it was trained at
        from diffar.checkpoint import read_meta

        cfg.latent_scale = read_meta(args.out)["model"].get("latent_scale", cfg.latent_scale)
    elif not args.init:  # a fresh model: scale its latents to unit variance
        model.calibrate(train.batch(train.eval_indices(256))["targets"])
    print(f"latent scale {cfg.latent_scale:.4f}, prediction {cfg.prediction}")
    _fit(args, model, cfg, "dd2", tokenizer, datasets)


def cmd_train_dd2(args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, cfg, tokenizer = _dd2_start(args, "eps")
    _fit_dd2(args, model, cfg, tokenizer)


def cmd_distill_dd2(args) -> None:
    import torch

    from diffar.checkpoint import load_ar
    from diffar.data.batching import ar_prompt, canvas_examples
    from diffar.data.corpora import load_corpus
    from diffar.training.distill import teacher_outputs

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, cfg, tokenizer = _dd2_start(args, "x0")
    corpus = load_corpus(args.corpus, "train")
    teacher = load_ar(args.teacher, tokenizer, "--teacher", task=corpus.task)
    vq = cfg.vqvae
    pairs = [(src, tgt) for src, tgt in canvas_examples(corpus, tokenizer, vq.prompt_len, vq.target_len,
                                                         stride=vq.prompt_len)
             if len(src) <= cfg.max_source_len]  # longer sources are left out of training: no teacher work for them
    if args.teacher_examples and args.teacher_examples < len(pairs):  # spread evenly: the subset spans the corpus
        pairs = [pairs[i * len(pairs) // args.teacher_examples] for i in range(args.teacher_examples)]
    seq2seq = corpus.task == "seq2seq"
    if cfg.energy_weight:
        model.set_energy_model(teacher, tokenizer.sep_id if seq2seq else None)
    prompts = [ar_prompt(tokenizer, corpus.task, src) for src, _ in pairs]
    budgets = [vq.width(len(src)) - 1 if seq2seq else vq.target_len for src, _ in pairs]
    outputs = teacher_outputs(teacher, prompts, budgets, Path(args.out) / "teacher.jsonl", pad_id=tokenizer.pad_id,
                              eos_id=tokenizer.eos_id if seq2seq else None, batch_size=args.teacher_batch_size)
    _fit_dd2(args, model, cfg, tokenizer, [(src, out) for (src, _), out in zip(pairs, outputs)])


def cmd_export(args) -> None:
    from diffar.checkpoint import DTYPES, load_checkpoint, write_checkpoint

    out = Path(args.out)
    if out.exists():
        raise DiffarError(f"{out} already exists; remove it or choose another --out")
    model, tokenizer, meta = load_checkpoint(args.checkpoint)
    meta = {**meta, "model": model.config.to_dict(), "dtype": args.dtype}  # the config as this diffar reads it
    write_checkpoint(out, model, meta, tokenizer, dtype=DTYPES[args.dtype])
    print(f"exported step {meta.get('step')} to {out} ({args.dtype})")


# ---- generate -------------------------------------------------------------------------------------
def cmd_generate(args) -> None:
    import torch

    from diffar.checkpoint import DTYPES, ar_stream, load_checkpoint
    from diffar.data.batching import prompt_ids
    from diffar.decoding.ar import generate
    from diffar.decoding.refusion import DraftSchedule, refusion_generate
    from diffar.decoding.sampling import SamplingConfig
    from diffar.decoding.speculative import speculative_generate

    text = args.prompt if args.prompt is not None else sys.stdin.read()
    if not text.strip():
        raise DiffarError("empty prompt: pass --prompt TEXT or text on stdin")
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens <= 0:
        raise DiffarError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.k is not None and args.k <= 0:
        raise DiffarError(f"--k must be positive, got {args.k}")
    model, tokenizer, meta = load_checkpoint(args.checkpoint, args.tokenizer, dtype=DTYPES[args.dtype])
    method = args.method or {"refusion": "refusion", "dd2": "dd2"}.get(meta["kind"], "ar")
    for kind, label in (("refusion", "ReFusion"), ("dd2", "DD2")):
        if method == kind and meta["kind"] != kind:
            raise DiffarError(f"--method {kind} needs a {label} checkpoint (diffar train {kind}); {args.checkpoint} "
                              f"is {meta['kind']}")
    if meta["kind"] in ("vqvae", "dd2") and method != "dd2":
        raise DiffarError(f"{args.checkpoint} is a {meta['kind']} checkpoint: it generates with --method dd2 only"
                          if meta["kind"] == "dd2" else f"{args.checkpoint} is an autoencoder; it does not generate")
    if method != "refusion" and (args.dynamic or args.plan_infill is not None):
        raise DiffarError("--dynamic and --plan-infill apply to --method refusion only")
    if args.plan_slot != 1 and args.plan_infill is None:
        raise DiffarError("--plan-slot sizes --plan-infill's slots; pass --plan-infill THRESHOLD too")
    if method != "dd2" and (args.preset or args.guidance is not None or args.tau is not None or args.hybrid
                            or args.adaptive_steps or args.sampler or args.tau_min is not None or args.best_of
                            or args.judge):
        raise DiffarError("--preset, --guidance, --tau, --tau-min, --sampler, --adaptive-steps, --hybrid, --best-of "
                          "and --judge apply to --method dd2 only")
    if method == "ar" and args.steps is not None:
        raise DiffarError("--steps applies to --method refusion or dd2")
    if method == "dd2":
        return _generate_dd2(args, model, tokenizer, meta, text)
    schedule = DraftSchedule(steps=1 if args.steps is None else args.steps, dynamic=args.dynamic,
                             plan_threshold=args.plan_infill, plan_slot=args.plan_slot)
    ar = ar_stream(model)
    proposer = _proposer(args, tokenizer) if method == "ar" else None
    ids = prompt_ids(tokenizer, meta["task"], text)
    generator = torch.Generator().manual_seed(args.seed)
    new: list[int] = []
    printed = ""

    def stream(row: int, token: int) -> None:
        nonlocal printed
        new.append(token)
        decoded = tokenizer.decode(new)
        if not decoded.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(decoded[len(printed):])
            sys.stdout.flush()
            printed = decoded

    if meta["task"] == "continuation" and not args.no_echo:
        sys.stdout.write(text)
    decode = dict(eos_id=tokenizer.eos_id, sampling=sampling, generator=generator, on_token=stream)
    if method == "refusion":
        result = refusion_generate(model, [ids], args.max_new_tokens, k=args.k, schedule=schedule,
                                   prompt_words=[len(text.split())], **decode)
        label = "refusion" + ("-dynamic" if args.dynamic else "") + ("-infill" if args.plan_infill else "")
    elif proposer is not None:
        result = speculative_generate(ar, proposer, [ids], args.max_new_tokens, k=args.k or 8, **decode)
        label = "ar+draft" if args.draft else "ar+prompt-lookup"
    else:
        result = generate(ar, [ids], args.max_new_tokens, pad_id=tokenizer.pad_id, use_cache=not args.no_cache,
                          **decode)
        label = "ar"
    sys.stdout.write(tokenizer.decode(new)[len(printed):] + "\n")
    sys.stdout.flush()
    n = result.new_tokens
    if label == "ar":
        passes, extra = result.forward_passes, "KV cache" if not args.no_cache else "no cache"
    else:
        passes = result.target_passes
        drafter = "diffusion" if method == "refusion" else "draft"
        extra = f"{result.accepted}/{result.drafted} drafts accepted, {result.draft_passes} {drafter} passes"
    print(f"[{label}] {n} tokens in {result.seconds:.2f} s = {n / result.seconds:.1f} tokens/s | "
          f"{passes} AR passes ({n / passes:.2f} tokens/AR pass) | prompt {len(ids)} tokens | batch 1 | {args.dtype} | "
          f"{extra}",
          file=sys.stderr)


def _generate_dd2(args, model, tokenizer, meta, text: str) -> None:
    """Sample with DD2 (optionally hybrid with an AR model, or the best of n samples by an AR judge) and print
    the text, then the speed line."""
    import torch

    from diffar.checkpoint import DTYPES, load_ar
    from diffar.data.batching import ar_prompt, prompt_ids
    from diffar.decoding.dd2 import DD2Sampling, best_of_generate, dd2_generate, hybrid_generate

    if args.temperature or args.top_k or args.top_p != 1.0 or args.draft or args.prompt_lookup or args.no_cache:
        raise DiffarError("dd2 samples with --tau (decoding temperature); --temperature, --top-k, --top-p, "
                          "--draft, --prompt-lookup and --no-cache are AR options")
    if args.judge and (args.best_of or 1) == 1:
        raise DiffarError("--judge picks one of --best-of N samples; pass --best-of N (N >= 2) too")
    if args.best_of and args.hybrid:
        raise DiffarError("--best-of and --hybrid do not combine; choose one")
    knobs = dict(steps=args.steps, adaptive=args.adaptive_steps or None, guidance_scale=args.guidance,
                 tau_max=args.tau, tau_min=args.tau_min, sampler=args.sampler, best_of=args.best_of)
    sampling = DD2Sampling.from_preset(args.preset, **knobs) if args.preset else \
        DD2Sampling(**{k: v for k, v in {**knobs, "steps": 1 if args.steps is None else args.steps}.items()
                       if v is not None})
    if args.tau is not None and args.tau_min is None and sampling.one_step:
        raise DiffarError("a one-step sample is read out at t = 1, where tau(t) = max(tau_min, tau * (1 - t)) is "
                          "tau_min: --tau needs more --steps; pass --tau-min to sample the one-step read-out")
    ids = tokenizer.encode(text)
    source = ids[-model.config.vqvae.prompt_len:] if meta["task"] == "continuation" else ids
    if meta["task"] == "seq2seq" and len(ids) > model.config.max_source_len:
        raise DiffarError(f"the source has {len(ids)} tokens; this model reads at most {model.config.max_source_len}")
    generator = torch.Generator().manual_seed(args.seed)
    decode = dict(sampling=sampling, eos_id=tokenizer.eos_id if meta["task"] == "seq2seq" else None,
                  pad_id=tokenizer.pad_id, generator=generator)
    if args.hybrid:
        ar = load_ar(args.hybrid, tokenizer, "--hybrid", task=meta["task"], dtype=DTYPES[args.dtype])
        result = hybrid_generate(model, ar, [source], [prompt_ids(tokenizer, meta["task"], text)],
                                 args.max_new_tokens, **decode)
    elif args.best_of:
        judge = load_ar(args.judge, tokenizer, "--judge", task=meta["task"], dtype=DTYPES[args.dtype]) \
            if args.judge else None
        result = best_of_generate(model, judge, [source], [ar_prompt(tokenizer, meta["task"], source)],
                                  args.max_new_tokens, **decode)
    else:
        result = dd2_generate(model, [source], args.max_new_tokens, **decode)
    if meta["task"] == "continuation" and not args.no_echo:
        sys.stdout.write(text)
    print(tokenizer.decode(result.tokens[0]))
    n = result.new_tokens
    label = f"dd2-hybrid, {result.steps}-step prefix" if args.hybrid else \
        f"dd2 {result.steps}-step {sampling.sampler}" + (
        f", best of {args.best_of} by the {'AR judge' if args.judge else 'decoder'}" if args.best_of else "")
    print(f"[{label}] {n} tokens in {result.seconds:.3f} s = {n / result.seconds:.1f} tokens/s | "
          f"{result.forward_passes} forward passes ({n / result.forward_passes:.2f} tokens/pass), "
          f"{result.decoder_passes} decoder passes | guidance {sampling.guidance_scale}, tau {result.tau:.3g} | "
          f"prompt {len(source)} tokens | batch 1 | {args.dtype}", file=sys.stderr)


def _proposer(args, tokenizer):
    """The drafter plain AR `generate` verifies against, if any: a draft model or prompt lookup."""
    from diffar.checkpoint import DTYPES, load_ar
    from diffar.decoding.speculative import DraftModel, PromptLookup

    if args.draft and args.prompt_lookup:
        raise DiffarError("choose one drafter: --draft or --prompt-lookup")
    if args.prompt_lookup:
        return PromptLookup()
    if not args.draft:
        return None
    return DraftModel(load_ar(args.draft, tokenizer, "--draft", dtype=DTYPES[args.dtype]))


# ---- eval / bench ---------------------------------------------------------------------------------
def cmd_eval(args) -> None:
    from diffar.evaluation.evaluate import evaluate_checkpoint

    report = evaluate_checkpoint(args.checkpoint, args.corpus, args.split, args.limit, args.batch_size)
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


def cmd_bench_ar(args) -> None:
    from diffar.evaluation.bench import bench_ar, print_table, write_records

    records = bench_ar(args.checkpoint, args.corpus, args.batch_sizes, args.new_tokens, args.repeats, args.dtype)
    print_table(records)
    write_records(records, args.out)


# ---- serve ----------------------------------------------------------------------------------------
def cmd_serve(args) -> None:
    import uvicorn

    from diffar.checkpoint import DTYPES, ar_stream, load_ar, load_checkpoint
    from diffar.serving.app import create_app
    from diffar.serving.methods import ARMethod, DD2Method, RefusionMethod

    model, tokenizer, meta = load_checkpoint(args.checkpoint, dtype=DTYPES[args.dtype])
    kind = meta["kind"]
    if kind not in ("ar", "refusion", "dd2"):
        raise DiffarError(f"{args.checkpoint} is a {kind} checkpoint, which does not generate text")
    method = args.method or kind
    if method != kind and (method, kind) != ("ar", "refusion"):  # a ReFusion model's AR stream serves as ar
        raise DiffarError(f"--method {method} cannot serve this {kind} checkpoint")
    if args.judge and method != "dd2":
        raise DiffarError("--judge picks among DD2 samples; it applies to a DD2 checkpoint only")
    judge = load_ar(args.judge, tokenizer, "--judge", task=meta["task"], dtype=DTYPES[args.dtype]) if args.judge \
        else None
    served = {"ar": lambda: ARMethod(ar_stream(model), tokenizer, meta["task"]),
              "refusion": lambda: RefusionMethod(model, tokenizer, meta["task"]),
              "dd2": lambda: DD2Method(model, tokenizer, meta["task"], judge)}[method]()
    app = create_app(served, tokenizer, meta, args.model_id or Path(args.checkpoint).resolve().name,
                     max_batch_size=args.max_batch_size, window_ms=args.batch_window_ms, max_queue=args.max_queue)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, backlog=4096)


def cmd_loadtest(args) -> None:
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
    load = dict(concurrency=args.concurrency, max_tokens=args.max_tokens, time_limit=args.time_limit)
    if args.url:
        results = [run_load(args.url, prompts, requests=args.requests, label="server", max_batch_size=None, **load)]
    else:
        results = []
        runs = [(args.max_batch_size, args.requests)] + ([(1, args.unbatched_requests)] if args.compare_unbatched
                                                         else [])
        for batch, n in runs:
            with local_server(args.checkpoint, batch, max_queue=max(4096, args.concurrency)) as url:
                label = f"batched (max {batch})" if batch > 1 else "one at a time"
                print(f"{label}: {n} requests from {args.concurrency} concurrent clients...", file=sys.stderr)
                results.append(run_load(url, prompts, requests=n, label=label, max_batch_size=batch, **load))
    print_results(results)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results_json(results), indent=2) + "\n")


def cmd_bench_dd2(args) -> None:
    from diffar.evaluation.bench import bench_dd2, print_table, write_records

    records = bench_dd2(args.checkpoint, args.ar, args.corpus, args.prompts, args.new_tokens, args.batch_sizes,
                        args.methods, args.seed, args.split, args.dtype)
    print_table(records)
    write_records(records, args.out)


def cmd_bench_lossless(args) -> None:
    from diffar.evaluation.bench import bench_lossless, print_table, write_records

    if args.k <= 0:
        raise DiffarError(f"--k must be positive, got {args.k}")
    records = bench_lossless(args.checkpoint, args.draft, args.corpus, args.prompts, args.new_tokens, args.k,
                             args.batch_sizes, args.methods, getattr(args, "plan_threshold", 0.9),
                             getattr(args, "plan_slot", 1), args.split)
    print_table(records)
    write_records(records, args.out)


# ---- parser ---------------------------------------------------------------------------------------
SPLIT_HELP = "valid for comparing training choices (ablations), test for the reported figures"
INFERENCE_DTYPES = ("fp32", "bf16")
DTYPE_HELP = "weights and activations at inference; bf16 is faster on CPUs with bf16 matrix units"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    from diffar.training.trainer import TrainConfig

    for f in fields(TrainConfig):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                       help=f"(default {f.default})")


def _add_dd2_flags(p: argparse.ArgumentParser, corpora: str) -> None:
    p.add_argument("--corpus", required=True, help=corpora)
    p.add_argument("--valid-corpus", help="validation data (default: the corpus's valid split)")
    p.add_argument("--schedule", choices=["linear", "cosine", "learned"], help="noise schedule (default cosine)")
    p.add_argument("--cond-drop", type=float, help="share of examples trained without their source (CFG; 0.1)")
    p.add_argument("--source-encoder", help="an AR checkpoint (e.g. the teacher) whose frozen hidden states over the "
                                            "source join the denoiser's source prefix")
    p.add_argument("--canvas-len", type=_positive_int,
                   help="continuation: tokens per canvas (default: the autoencoder's target_len); longer outputs "
                        "are sampled canvas after canvas")
    p.add_argument("--out", required=True, help="run folder (checkpoints, metrics.jsonl)")
    p.add_argument("--threads", type=_positive_int, help="torch CPU threads")
    _add_train_flags(p)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2) like every other diffar error."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from diffar.data.corpora import EMBEDDED
    from diffar.models.refusion import PRESETS as REFUSION_PRESETS
    from diffar.models.transformer import PRESETS
    from diffar.models.dd2 import PRESETS as DD2_PRESETS
    from diffar.models.vqvae import PRESETS as VQVAE_PRESETS

    parser = _Parser(prog="diffar", description="Fast text generation: diffusion fused with AR.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    corpora = f"an embedded corpus ({', '.join(EMBEDDED)}), a text file/folder, or a JSONL of source/target"

    tok = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer")
    tok_sub = tok.add_subparsers(dest="action", required=True, metavar="ACTION")
    t = tok_sub.add_parser("train", help="train a tokenizer on one or more corpora")
    t.add_argument("--corpus", action="append", required=True, help=corpora + " (repeatable)")
    t.add_argument("--vocab-size", type=_positive_int, default=8192)
    t.add_argument("--min-frequency", type=_positive_int, default=2)
    t.add_argument("--out", required=True, help="where to write the tokenizer JSON")
    t.set_defaults(func=cmd_tokenizer_train)

    tr = sub.add_parser("train", help="train a model (resumes if --out holds a run)")
    tr_sub = tr.add_subparsers(dest="model_kind", required=True, metavar="MODEL")
    ar = tr_sub.add_parser("ar", help="the autoregressive transformer baseline")
    ar.add_argument("--corpus", required=True, help=corpora)
    ar.add_argument("--valid-corpus", help="validation data (default: the corpus's valid split)")
    ar.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ar.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
    ar.add_argument("--block-size", type=_positive_int, help="training sequence length (default: the context)")
    ar.add_argument("--out", required=True, help="run folder (checkpoints, metrics.jsonl)")
    ar.add_argument("--threads", type=_positive_int, help="torch CPU threads")
    _add_train_flags(ar)
    ar.set_defaults(func=cmd_train)
    rf = tr_sub.add_parser("refusion", help="ReFusion: a diffusion stream drafting for a (frozen) AR stream")
    rf.add_argument("--corpus", required=True, help=corpora)
    rf.add_argument("--valid-corpus", help="validation data (default: the corpus's valid split)")
    rf.add_argument("--ar", help="AR checkpoint to start the AR stream from (its tokenizer is used)")
    rf.add_argument("--init", help="ReFusion checkpoint (e.g. stage 1) to start both streams from")
    rf.add_argument("--preset", default="small", choices=sorted(REFUSION_PRESETS))
    rf.add_argument("--stage", choices=["diffusion", "joint"], default="joint",
                    help="diffusion: the diffusion stream alone (stage 1); joint: with fusion and the AR stream")
    rf.add_argument("--train-ar", action="store_true", help="also train the AR stream (default: frozen)")
    rf.add_argument("--block", type=_positive_int, help="tokens drafted per block")
    rf.add_argument("--anchors", type=_positive_int, help="training blocks per sequence")
    rf.add_argument("--schedule", choices=["linear", "cosine", "learned"], help="noise schedule")
    rf.add_argument("--ar-fusion-layers", type=int, nargs="*", help="AR layers that read the diffusion stream")
    rf.add_argument("--ar-weight", type=float, help="weight of CE_AR (default 1)")
    rf.add_argument("--mse-weight", type=float, help="weight of the diffusion MSE (default 0.5)")
    rf.add_argument("--kl-weight", type=float, help="weight of KL(AR || diffusion) (default 0.1)")
    rf.add_argument("--grad-checkpoint", action="store_true", default=None, help="recompute activations in backward")
    rf.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="without --ar")
    rf.add_argument("--block-size", type=_positive_int, help="training sequence length, e.g. 256 to chunk long text")
    rf.add_argument("--out", required=True, help="run folder (checkpoints, metrics.jsonl)")
    rf.add_argument("--threads", type=_positive_int, help="torch CPU threads")
    _add_train_flags(rf)
    rf.set_defaults(func=cmd_train_refusion)

    vq = tr_sub.add_parser("vqvae", help="DD2 stage 1: the text autoencoder (VQ-VAE) the diffusion runs in")
    vq.add_argument("--corpus", required=True, help=corpora)
    vq.add_argument("--valid-corpus", help="validation data (default: the corpus's valid split)")
    vq.add_argument("--preset", default="small", choices=sorted(VQVAE_PRESETS))
    vq.add_argument("--bottleneck", choices=["vq", "kl"], help="vector-quantised (default) or KL-continuous")
    vq.add_argument("--d-latent", type=_positive_int, help="latent width (default 256)")
    vq.add_argument("--codebook-size", type=_positive_int, help="codes per group")
    vq.add_argument("--groups", type=_positive_int, help="product-quantisation groups per latent")
    vq.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
    vq.add_argument("--out", required=True, help="run folder (checkpoints, metrics.jsonl)")
    vq.add_argument("--threads", type=_positive_int, help="torch CPU threads")
    _add_train_flags(vq)
    vq.set_defaults(func=cmd_train_vqvae)

    dd = tr_sub.add_parser("dd2", help="DD2 stage 2: an eps-predicting diffusion model in a VQ-VAE's latent space")
    dd.add_argument("--vqvae", help="the trained autoencoder (diffar train vqvae); its tokenizer is used")
    dd.add_argument("--init", help="a DD2 checkpoint to continue from (must be built on --vqvae, if given)")
    dd.add_argument("--preset", default="small", choices=sorted(DD2_PRESETS))
    _add_dd2_flags(dd, corpora)
    dd.set_defaults(func=cmd_train_dd2)

    di = sub.add_parser("distill", help="distil an AR teacher into a fast student")
    di_sub = di.add_subparsers(dest="model_kind", required=True, metavar="MODEL")
    dd = di_sub.add_parser("dd2", help="a one-step DD2 generator (x0 prediction) trained on the teacher's outputs")
    dd.add_argument("--teacher", required=True, help="the AR checkpoint whose greedy outputs are the targets")
    dd.add_argument("--vqvae", help="the autoencoder to build on (without --init)")
    dd.add_argument("--init", help="a DD2 checkpoint to start from, e.g. the stage-2 eps model")
    dd.add_argument("--preset", default="small", choices=sorted(DD2_PRESETS))
    dd.add_argument("--teacher-examples", type=_positive_int,
                    help="distil on N training examples spread evenly over the corpus")
    dd.add_argument("--teacher-batch-size", type=_positive_int, default=32)
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
    _add_dd2_flags(dd, corpora)
    dd.set_defaults(func=cmd_distill_dd2)

    ex = sub.add_parser("export", help="write a run's latest checkpoint as a compact folder (no optimizer state)")
    ex.add_argument("--checkpoint", required=True, help="run or checkpoint folder")
    ex.add_argument("--out", required=True)
    ex.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    ex.set_defaults(func=cmd_export)

    g = sub.add_parser("generate", help="generate text from a prompt (argument or stdin), streaming")
    g.add_argument("--checkpoint", required=True)
    g.add_argument("--tokenizer", help="override the checkpoint's own tokenizer (must be the same one)")
    g.add_argument("--prompt", help="prompt text (default: read stdin)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="fp32", choices=INFERENCE_DTYPES, help=DTYPE_HELP + ", every model loaded")
    g.add_argument("--no-cache", action="store_true", help="recompute every step (slow; for comparison)")
    g.add_argument("--no-echo", action="store_true", help="do not repeat a continuation prompt")
    g.add_argument("--draft", help="speculative decoding: a small AR checkpoint (same tokenizer) drafts tokens")
    g.add_argument("--prompt-lookup", action="store_true", help="speculative decoding: draft by copying n-grams")
    g.add_argument("--k", type=int, help="drafts verified per AR pass (default 8; refusion: the model's block)")
    g.add_argument("--method", choices=["ar", "refusion", "dd2"], help="default: the checkpoint's own kind")
    g.add_argument("--steps", type=int, help="refusion: denoising steps per draft; dd2: sampling steps (default 1)")
    g.add_argument("--adaptive-steps", action="store_true", help="dd2: min(100, 50 + length // 10) steps")
    g.add_argument("--preset", choices=["speed", "quality"], help="dd2: the seed's sampling presets")
    g.add_argument("--guidance", type=float, help="dd2: classifier-free guidance scale (1 = conditional only)")
    g.add_argument("--tau", type=float, help="dd2: decoding temperature tau_max (0 = argmax)")
    g.add_argument("--tau-min", type=float, help="dd2: the temperature floor tau_min")
    g.add_argument("--sampler", choices=["ddim", "ddpm"], help="dd2: the scheduler (default ddim)")
    g.add_argument("--hybrid", metavar="AR_CHECKPOINT",
                   help="dd2: sample the first 50 tokens (one step unless --steps/--preset say more), then this AR "
                        "model continues with its KV cache")
    g.add_argument("--best-of", type=_positive_int, metavar="N",
                   help="dd2: sample N texts from independent noise and keep the likeliest (by the decoder's own "
                        "confidence, or by --judge)")
    g.add_argument("--judge", metavar="AR_CHECKPOINT", help="dd2 --best-of: an AR model that scores the samples")
    g.add_argument("--dynamic", action="store_true", help="refusion: the seed's dynamic schedule")
    g.add_argument("--plan-infill", type=float, metavar="THRESHOLD",
                   help="refusion: keep drafts at least this confident unverified (faster, not lossless)")
    g.add_argument("--plan-slot", type=_positive_int, default=1, metavar="N",
                   help="refusion --plan-infill: plan slots of N tokens, each kept or infilled whole (default 1)")
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("eval", help="BLEU-4/chrF/ROUGE-L and perplexity on a corpus split")
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--corpus", help="default: the corpus the checkpoint was trained on")
    e.add_argument("--split", default="test", choices=["train", "valid", "test"])
    e.add_argument("--limit", type=_positive_int, help="evaluate the first N examples only")
    e.add_argument("--batch-size", type=_positive_int, default=16)
    e.add_argument("--out", help="also write the report as JSON")
    e.set_defaults(func=cmd_eval)

    b = sub.add_parser("bench", help="measure decoding speed; writes JSON records")
    b_sub = b.add_subparsers(dest="method", required=True, metavar="METHOD")
    bar = b_sub.add_parser("ar", help="AR with vs without the KV cache")
    bar.add_argument("--checkpoint", default="checkpoints/ar-kjv2web")
    bar.add_argument("--corpus", help="prompts from this corpus's test split (default: the checkpoint's corpus)")
    bar.add_argument("--batch-sizes", type=_positive_int, nargs="+", default=[1, 8])
    bar.add_argument("--new-tokens", type=_positive_int, default=256)
    bar.add_argument("--repeats", type=_positive_int, default=1)
    bar.add_argument("--dtype", default="fp32", choices=INFERENCE_DTYPES, help=DTYPE_HELP)
    bar.add_argument("--out", required=True, help="JSON file to write")
    bar.set_defaults(func=cmd_bench_ar)
    bsp = b_sub.add_parser("speculative", help="AR vs lossless prompt-lookup and draft-model decoding")
    bsp.add_argument("--checkpoint", default="checkpoints/ar-kjv2web")
    bsp.add_argument("--draft", default="checkpoints/draft-kjv2web", help="the small AR drafter")
    bsp.add_argument("--methods", nargs="+", default=["ar", "ar+prompt-lookup", "ar+draft"])
    brf = b_sub.add_parser("refusion", help="ReFusion lossless decoding against AR and its speculative peers")
    brf.add_argument("--checkpoint", default="checkpoints/refusion-kjv2web", help="a ReFusion checkpoint")
    brf.add_argument("--draft", default="checkpoints/draft-kjv2web", help="the small AR drafter peer")
    brf.add_argument("--methods", nargs="+",
                     default=["ar", "ar+prompt-lookup", "ar+draft", "refusion", "refusion-dynamic", "refusion-infill"])
    brf.add_argument("--plan-threshold", type=float, default=0.9, help="refusion-infill: keep drafts this confident")
    brf.add_argument("--plan-slot", type=_positive_int, default=1, help="refusion-infill: tokens per planned slot")
    for p in (bsp, brf):
        p.add_argument("--corpus", help="prompts from this corpus (default: the checkpoint's corpus)")
        p.add_argument("--split", default="test", choices=("valid", "test"), help=SPLIT_HELP)
        p.add_argument("--prompts", type=_positive_int, default=32)
        p.add_argument("--new-tokens", type=_positive_int, default=256, help="continuation: tokens per prompt")
        p.add_argument("--batch-sizes", type=_positive_int, nargs="+", default=[1])
        p.add_argument("--k", type=int, default=8, help="draft length (block size)")
        p.add_argument("--out", required=True, help="JSON file to write")
        p.set_defaults(func=cmd_bench_lossless)

    bdd = b_sub.add_parser("dd2", help="DD2 one-step / few-step / hybrid sampling against AR")
    bdd.add_argument("--checkpoint", default="checkpoints/dd2-kjv2web", help="a DD2 checkpoint")
    bdd.add_argument("--ar", default="checkpoints/ar-kjv2web",
                     help="the AR baseline (and hybrid's continuer, and dd2-NxK's judge)")
    bdd.add_argument("--methods", nargs="+", default=["ar", "dd2-1", "dd2-30", "dd2-50", "dd2-100", "dd2-hybrid"],
                     help="ar, dd2-N (N DDIM steps), dd2-NxK (--ar picks the best of K N-step samples), "
                          "dd2-NxK-self (the decoder picks), dd2-adaptive, dd2-hybrid, dd2-speed, dd2-quality")
    bdd.add_argument("--corpus", help="prompts from this corpus (default: the checkpoint's corpus)")
    bdd.add_argument("--split", default="test", choices=("valid", "test"), help=SPLIT_HELP)
    bdd.add_argument("--prompts", type=_positive_int, default=128)
    bdd.add_argument("--new-tokens", type=_positive_int, default=256, help="continuation: tokens per prompt")
    bdd.add_argument("--batch-sizes", type=_positive_int, nargs="+", default=[1, 16])
    bdd.add_argument("--seed", type=int, default=0)
    bdd.add_argument("--dtype", default="fp32", choices=INFERENCE_DTYPES, help=DTYPE_HELP + ", every model alike")
    bdd.add_argument("--out", required=True, help="JSON file to write")
    bdd.set_defaults(func=cmd_bench_dd2)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with dynamic batching and streaming")
    sv.add_argument("--checkpoint", required=True)
    sv.add_argument("--method", choices=("ar", "dd2", "refusion"),
                    help="decoding method (default: the checkpoint's kind; a ReFusion checkpoint can also serve its AR "
                         "stream as ar)")
    sv.add_argument("--model-id", help="the model name clients use (default: the checkpoint folder's name)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--max-batch-size", type=_positive_int, default=16)
    sv.add_argument("--batch-window-ms", type=float, default=10.0, help="how long a batch waits to fill")
    sv.add_argument("--max-queue", type=_positive_int, default=4096, help="waiting requests before 429")
    sv.add_argument("--dtype", default="fp32", choices=INFERENCE_DTYPES, help=DTYPE_HELP)
    sv.add_argument("--judge", metavar="AR_CHECKPOINT",
                    help="dd2: the AR model that picks among a request's best_of samples (without it, the "
                         "decoder's own confidence picks)")
    sv.add_argument("--log-level", default="warning")
    sv.set_defaults(func=cmd_serve)

    lt = sub.add_parser("loadtest", help="concurrent clients against a server on this machine (bounded)")
    lt.add_argument("--url", help="a running diffar server")
    lt.add_argument("--checkpoint", help="start a server for this checkpoint on 127.0.0.1 instead")
    lt.add_argument("--concurrency", type=_positive_int, default=1000)
    lt.add_argument("--requests", type=_positive_int, default=2000)
    lt.add_argument("--max-tokens", type=_positive_int, default=32)
    lt.add_argument("--time-limit", type=float, default=600.0, help="seconds; unanswered requests count as lost")
    lt.add_argument("--max-batch-size", type=_positive_int, default=32)
    lt.add_argument("--compare-unbatched", action="store_true",
                    help="also measure a server that decodes one request at a time")
    lt.add_argument("--unbatched-requests", type=_positive_int, default=300)
    lt.add_argument("--corpus", default="kjv2web", help="prompts come from this corpus's test split")
    lt.add_argument("--out", help="write the results as JSON")
    lt.set_defaults(func=cmd_loadtest)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except DiffarError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # an unwritable --out, a full disk...
        print(f"error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
