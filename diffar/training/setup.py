"""What a training run starts from: its data sets, and its model built from a preset and/or trained checkpoints
(checked to belong together). Each config is complete before its model is built; `fit` then hands both to
the Trainer."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from diffar.checkpoint import load_ar, load_checkpoint, read_meta
from diffar.data.batching import CanvasDataset, PairDataset, WindowDataset, ar_prompt, build_dataset, canvas_examples
from diffar.data.corpora import is_embedded, load_corpus
from diffar.errors import DiffarError
from diffar.decoding.sampling import SamplingConfig
from diffar.models.dd2 import DD2Config, DD2Model, example_noise, same_weights, token_noise
from diffar.models.drafter import BlockDrafter, DrafterConfig
from diffar.models.precision import place
from diffar.models.refusion import RefusionConfig, RefusionModel
from diffar.models.vqvae import TextVQVAE
from diffar.tokenizer import Tokenizer
from diffar.training.distill import teacher_outputs
from diffar.training.trainer import TrainConfig, Trainer


TOKENS_PER_WORD_HIGH = 2.0
ADVICE_SAMPLE_CHARS = 200_000


class Datasets(NamedTuple):
    train: object
    valid: object
    task: str  # the training corpus's: "seq2seq" or "continuation"
    corpus: str
    block_size: int  # the longest training sequence (a canvas model's: its canvas)


class DD2Start(NamedTuple):
    model: DD2Model
    tokenizer: Tokenizer
    calibrate: bool  # a new model: its latent scale is measured on its training data first


def _load_kind(path: str, kind: str, flag: str, name: str | None = None):
    """(model, tokenizer, meta) of a checkpoint that must be of `kind` (`name`: how the error calls it)."""
    model, tokenizer, meta = load_checkpoint(path)
    if meta["kind"] != kind:
        raise DiffarError(f"{flag} {path} is a {meta['kind']} checkpoint, not {name or 'a ' + kind} one")
    return model, tokenizer, meta


def _corpora(corpus: str, valid_corpus: str | None):
    """The training corpus and the validation one: its own valid split, or all of `valid_corpus` (and then none of
    a user's training file is held out)."""
    train = load_corpus(corpus, "train", whole=valid_corpus is not None)
    valid = load_corpus(valid_corpus, "valid", whole=True) if valid_corpus else load_corpus(corpus, "valid")
    if valid.task != train.task:
        raise DiffarError(f"--valid-corpus is a {valid.task} corpus, --corpus a {train.task} one")
    return train, valid


def datasets(tokenizer: Tokenizer, corpus: str, valid_corpus: str | None, max_seq_len: int,
             block_size: int | None = None, domains: tuple[str, ...] = ()) -> Datasets:
    """Token sequences of `block_size` (default: the model's context) for the AR and ReFusion models; `domains`:
    a domain-adapted model's, whose batches then say each sequence's domain."""
    block = block_size or max_seq_len
    if block > max_seq_len:
        raise DiffarError(f"--block-size {block} exceeds the model's context of {max_seq_len}")
    train_corpus, valid_corpus = _corpora(corpus, valid_corpus)
    train_data = build_dataset(train_corpus, tokenizer, block, domains)
    valid_data = build_dataset(valid_corpus, tokenizer, block, domains)
    for name, data in (("train", train_data), ("valid", valid_data)):
        if getattr(data, "dropped", 0):
            print(f"note: {data.dropped} {name} pairs longer than the {block}-token block are left out")
    return Datasets(train_data, valid_data, train_corpus.task, train_corpus.name, block)


def data_advice(corpus: str, tokenizer: Tokenizer, data: Datasets, n_params: int) -> list[str]:
    """What a new model on a user's own data should be told before training from scratch: a tokenizer that
    splits the text finely (tokens per word above TOKENS_PER_WORD_HIGH: train one), and too little data for the
    model's size (fewer training tokens than a tenth of its parameters: start from a pretrained model)."""
    if is_embedded(corpus):
        return []
    notes = []
    train_corpus = load_corpus(corpus, "train")
    sample = "" if train_corpus.sequences is not None else "\n".join(train_corpus.texts())[:ADVICE_SAMPLE_CHARS]
    words = len(sample.split())  # token-id records (`diffar distill data`) were made with this tokenizer
    per_word = len(tokenizer.encode(sample)) / words if words else 0.0
    if per_word > TOKENS_PER_WORD_HIGH:
        notes.append(f"note: {per_word:.1f} tokens per word of this corpus under this tokenizer (English under "
                     f"diffar-8k: ~1.3); a tokenizer of its own shortens its sequences (diffar tokenizer train "
                     f"--corpus {corpus} --out my-tok.json, then --tokenizer my-tok.json)")
    train = data.train
    tokens = len(train.tokens) if hasattr(train, "tokens") else sum(map(len, train.seqs))
    if tokens * 10 < n_params:
        notes.append(f"warning: {tokens:,} training tokens for a model of {n_params / 1e6:.1f}M parameters trained "
                     f"from scratch is very little data; expect it to memorise, or fine-tune a pretrained model "
                     f"(--init checkpoints/smollm2-135m-instruct, after make smollm2)")
    return notes


def canvas_datasets(tokenizer: Tokenizer, corpus: str, valid_corpus: str | None, vq_cfg, *, with_source: bool,
                    examples=None, max_source: int | None = None, noise=None) -> Datasets:
    """Canvases laid out by the autoencoder's config for the latent-diffusion models; `examples` replaces the
    training pairs (distillation: the teacher's outputs), and `noise` gives each its own (`CanvasDataset`)."""
    train_corpus, valid_corpus = _corpora(corpus, valid_corpus)
    seq2seq = train_corpus.task == "seq2seq"
    width = vq_cfg.width if seq2seq else (lambda n: vq_cfg.target_len)
    data = []
    for name, part, pairs, own_noise in (("train", train_corpus, examples, noise),
                                         ("valid", valid_corpus, None, None)):
        pairs = pairs or canvas_examples(part, tokenizer, vq_cfg.prompt_len, vq_cfg.target_len,
                                         stride=vq_cfg.prompt_len)
        canvases = CanvasDataset(pairs, tokenizer, width, vq_cfg.max_len, eos=seq2seq, with_source=with_source,
                                 max_source=max_source, noise=own_noise)
        if canvases.dropped:
            print(f"note: {canvases.dropped} {name} pairs longer than the {vq_cfg.max_len}-position canvas"
                  + (f" or the {max_source}-token source" if max_source else "") + " are left out")
        data.append(canvases)
    return Datasets(data[0], data[1], train_corpus.task, train_corpus.name, vq_cfg.max_len)


def fit(model: nn.Module, kind: str, tokenizer: Tokenizer, data: Datasets, config: TrainConfig, out: str,
        init: str | None = None, lora: dict | None = None, target: str | None = None, override: bool = False) -> None:
    """Train (or resume) in `out`; the checkpoint's meta records the model's config, the data it saw, the
    checkpoint it started from (`init`), its adapters (`lora`: add_lora's arguments) and the AR checkpoint a
    drafter drafts for (`target`), if any. `override`: a resumed run may change its training settings."""
    meta = {"kind": kind, "model": model.config.to_dict(), "task": data.task, "corpus": data.corpus,
            "block_size": data.block_size, **({"init": str(init)} if init else {}), **({"lora": lora} if lora else {}),
            **({"target": str(target)} if target else {})}
    metrics = Trainer(model, data.train, data.valid, config, out, meta, tokenizer, override).fit()
    if metrics:
        ppl = f", val ppl {metrics['val_ppl']:.2f}" if "val_ppl" in metrics else ""
        print(f"done: step {metrics['step']}, val loss {metrics['val_loss']:.4f}{ppl}")


def ar_start(init: str, task: str) -> tuple[nn.Module, Tokenizer]:
    """(the AR model of checkpoint `init` in fp32, its tokenizer) to fine-tune on a corpus of `task`. An imported
    model has no source/target separator; seq2seq fine-tuning then gives that role to its end-of-sequence token
    (recorded in the checkpoint's tokenizer config, so every later command reads pairs the same way)."""
    model, tokenizer, _ = _load_kind(init, "ar", "--init", "an AR")
    if task == "seq2seq" and tokenizer.sep_id is None:
        tokenizer = Tokenizer(tokenizer.hf, {**tokenizer.specials, "sep": tokenizer.specials["eos"]},
                              tokenizer.chat_template)
    return model.train(), tokenizer


def refusion_model(tokenizer_path: str, *, ar: str | None, init: str | None, preset: str, seed: int,
                   **overrides) -> tuple[RefusionModel, Tokenizer]:
    """A ReFusion model from a preset or --init (a ReFusion checkpoint, e.g. stage 1, with its tokenizer; a domain
    adapter may be added to its stream), its AR stream from --ar where given (and its diffusion space too, unless
    --init brings a trained one). `overrides` (None: keep) are RefusionConfig fields; the model's weights are
    initialised with `seed`."""
    ar_model = init_model = None
    if ar:
        ar_model, tokenizer, _ = _load_kind(ar, "ar", "--ar", "an AR")
    if init:
        init_model, init_tokenizer, _ = _load_kind(init, "refusion", "--init", "a ReFusion")
        if ar_model is not None and (init_tokenizer.sha256 != tokenizer.sha256
                                     or init_model.config.ar.to_dict() != ar_model.config.to_dict()):
            raise DiffarError(f"--init {init} and --ar {ar} do not belong together "
                              f"(different tokenizer or AR stream shape)")
        tokenizer = init_tokenizer
    elif not ar:
        tokenizer = Tokenizer.load(tokenizer_path)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    cfg = RefusionConfig.from_dict({**init_model.config.to_dict(), **overrides}) if init_model else \
        RefusionConfig.from_preset(preset, tokenizer.vocab_size, **overrides)
    if cfg.stage == "joint" and cfg.freeze_ar and ar_model is None and init_model is None:
        raise DiffarError("a frozen AR stream must come from a trained model: pass --ar CHECKPOINT (or --train-ar)")
    torch.manual_seed(seed)
    model = RefusionModel(cfg)
    if init_model is not None:
        if init_model.config.domains and init_model.config.domains != cfg.domains:
            raise DiffarError(f"--init {init} has a domain adapter for {', '.join(init_model.config.domains)}; "
                              f"it cannot serve other domains")
        # strict but for a new adapter, which starts fresh
        missing, unexpected = model.diffuser.load_state_dict(init_model.diffuser.state_dict(), strict=False)
        assert not unexpected and all(key.startswith("adapter.") for key in missing), (missing, unexpected)
        model.ar.load_state_dict(init_model.ar.state_dict())
    if ar_model is not None:
        model.init_from_ar(ar_model, embeddings=init_model is None)
    return model, tokenizer


def drafter_model(ar: str, *, preset: str, precision: str, seed: int, init: str | None = None,
                  **overrides) -> tuple[BlockDrafter, Tokenizer, str]:
    """(a block drafter (models/drafter.py) for the AR checkpoint `ar`, its tokenizer, the target's task: how the
    drafter's prompts read, whatever its training data). The target is loaded frozen, in bf16 when training in
    bf16 (it only runs forward). The draft layers start from the target's last layers, or from the drafter
    checkpoint `init` (same shape; e.g. to go on training on more data; its draft vocabulary may differ, as it is
    chosen from the training data anyway). `overrides` (None: keep) are DrafterConfig fields."""
    target, tokenizer, target_meta = _load_kind(ar, "ar", "--ar", "an AR")
    cfg = DrafterConfig.from_preset(preset, target=target.config,
                                    **{k: v for k, v in overrides.items() if v is not None})
    torch.manual_seed(seed)
    model = BlockDrafter(cfg)
    model.attach(place(target, precision))
    if init is None:
        model.init_from_target()
        return model, tokenizer, target_meta["task"]
    start, init_tokenizer, _ = _load_kind(init, "drafter", "--init", "a drafter")
    if init_tokenizer.sha256 != tokenizer.sha256 or start.config.target.to_dict() != cfg.target.to_dict():
        raise DiffarError(f"--init {init} drafts for another AR model than --ar {ar}")
    weights = {k: v for k, v in start.state_dict().items() if k != "vocab"}  # the draft vocabulary: from the data
    try:
        keys = model.load_state_dict(weights, strict=False)
        fits = keys.missing_keys == ["vocab"] and not keys.unexpected_keys
    except RuntimeError:  # a weight of another size
        fits = False
    if not fits:
        raise DiffarError(f"--init {init} has another shape (draft layers, feature layers) than this drafter")
    return model, tokenizer, target_meta["task"]


def token_counts(data: PairDataset | WindowDataset, vocab_size: int) -> torch.Tensor:
    """How often each token occurs in a training set (V,): what a draft vocabulary is chosen by."""
    tokens = data.tokens if isinstance(data, WindowDataset) else torch.tensor([t for seq in data.seqs for t in seq])
    return torch.bincount(tokens, minlength=vocab_size).float()


def _dd2_checkpoints(init: str | None, vqvae: str | None, prediction: str, schedule: str | None):
    """(DD2 model of --init or None, autoencoder of --vqvae or None, tokenizer), checked to belong together
    and to the run (`prediction`: eps for `train dd2`, x0 for `distill dd2`)."""
    init_model = autoencoder = None
    if init:
        init_model, tokenizer, _ = _load_kind(init, "dd2", "--init")
    if vqvae:
        autoencoder, vq_tokenizer, _ = _load_kind(vqvae, "vqvae", "--vqvae")
        if init_model is not None and (vq_tokenizer.sha256 != tokenizer.sha256
                                       or not same_weights(init_model.vqvae, autoencoder)):
            raise DiffarError(f"--init {init} was trained in another VQ-VAE than --vqvae {vqvae}; "
                              f"they do not belong together")
        tokenizer = vq_tokenizer
    if init_model is None and autoencoder is None:
        raise DiffarError("pass --vqvae CHECKPOINT (diffar train vqvae) or --init DD2_CHECKPOINT")
    if init_model is not None and schedule and schedule != init_model.config.schedule:
        raise DiffarError(f"--init {init} was trained on the {init_model.config.schedule} noise schedule; "
                          f"--schedule cannot change it")
    if init_model is not None and (init_model.config.prediction, prediction) == ("x0", "eps"):
        raise DiffarError(f"--init {init} is a distilled (x0) generator; continue it with diffar distill dd2")
    return init_model, autoencoder, tokenizer


def _canvas_len(autoencoder: TextVQVAE | None, init_model: DD2Model | None, init: str | None, task: str,
                canvas_len: int | None) -> TextVQVAE | None:
    """The autoencoder laid out for canvases of `canvas_len` tokens (a layout choice: the same weights read
    canvases of any length), after checking that the run may choose it."""
    if canvas_len and task != "continuation":
        raise DiffarError("--canvas-len applies to continuation corpora (a seq2seq canvas is sized by its source)")
    if canvas_len and init_model is not None and canvas_len != init_model.config.vqvae.target_len:
        raise DiffarError(f"--init {init} samples canvases of {init_model.config.vqvae.target_len} tokens; "
                          f"--canvas-len cannot change that")
    if not canvas_len or autoencoder is None:
        return autoencoder
    with torch.random.fork_rng(devices=[]):  # a copy of loaded weights: the models built next start as before
        resized = TextVQVAE(replace(autoencoder.config, target_len=canvas_len))
    resized.load_state_dict(autoencoder.state_dict())
    return resized


def dd2_model(corpus: str, out: str, *, prediction: str, preset: str, vqvae: str | None = None,
              init: str | None = None, source_encoder: str | None = None, canvas_len: int | None = None,
              **overrides) -> DD2Start:
    """The DD2 model a `train dd2` / `distill dd2` run in `out` on `corpus` starts from: --init (a DD2
    checkpoint) and/or --vqvae (the autoencoder to build on), and --source-encoder (an AR model that reads the
    source; an --init model keeps its own, or gains one through a zero map, so it starts out unchanged).
    `overrides` (None: keep) are DD2Config fields. A resumed run keeps the latent scale it was trained at."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    init_model, autoencoder, tokenizer = _dd2_checkpoints(init, vqvae, prediction, overrides.get("schedule"))
    task = load_corpus(corpus, "train").task
    if init_model is not None and (init_model.config.eos_id is not None) != (task == "seq2seq"):
        trained_on = "seq2seq" if init_model.config.eos_id is not None else "continuation"
        raise DiffarError(f"--init {init} was trained on {trained_on} data; --corpus {corpus} is a {task} one")
    encoder = None
    if source_encoder:
        encoder = load_ar(source_encoder, tokenizer, "--source-encoder")
        if init_model is not None and init_model.source_encoder is not None \
                and not same_weights(init_model.source_encoder, encoder):
            raise DiffarError(f"--init {init} does not read its source through --source-encoder "
                              f"{source_encoder}; an --init model keeps its own")
    autoencoder = _canvas_len(autoencoder, init_model, init, task, canvas_len)
    overrides.update(prediction=prediction, eos_id=tokenizer.eos_id if task == "seq2seq" else None)
    if encoder is not None:
        overrides["source_encoder"] = encoder.config
    resumed = (Path(out) / "latest").is_file()
    saved = read_meta(out)["model"] if resumed else {}
    if "latent_scale" in saved:  # a resumed run keeps the scale it was trained at
        overrides["latent_scale"] = saved["latent_scale"]
    cfg = DD2Config.from_dict({**init_model.config.to_dict(), **overrides}) if init_model is not None else \
        DD2Config.from_preset(preset, autoencoder.config, **overrides)
    model = DD2Model(cfg)
    if init_model is None:
        model.set_vqvae(autoencoder)
    elif encoder is not None and init_model.source_encoder is None:
        model.load_state_dict(init_model.state_dict(), strict=False)  # all but the new encoder and its map
        nn.init.zeros_(model.denoiser.states_in.weight)
        nn.init.zeros_(model.denoiser.states_in.bias)
    else:
        model.load_state_dict(init_model.state_dict())
    if encoder is not None:
        model.set_source_encoder(encoder)
    return DD2Start(model, tokenizer, calibrate=init_model is None and not resumed)


def fit_dd2(start: DD2Start, corpus: str, valid_corpus: str | None, config: TrainConfig, out: str,
            examples=None, override: bool = False) -> None:
    """Train a DD2 model on canvases of `corpus` (or on `examples`, a distillation's teacher outputs; a coupled
    one's each with the noise `distillation_pairs` sampled it for)."""
    model, cfg = start.model, start.model.config
    noise = partial(example_noise, config.seed, d_latent=cfg.vqvae.d_latent) if cfg.coupled else None
    data = canvas_datasets(start.tokenizer, corpus, valid_corpus, cfg.vqvae, with_source=True, examples=examples,
                           max_source=cfg.max_source_len, noise=noise)
    if start.calibrate:  # a fresh model: scale its latents to unit variance
        model.calibrate(data.train.batch(data.train.eval_indices(256))["targets"])
    print(f"latent scale {cfg.latent_scale:.4f}, prediction {cfg.prediction}")
    fit(model, "dd2", start.tokenizer, data, config, out, override=override)


def distillation_pairs(start: DD2Start, teacher_path: str, corpus: str, out: str, *, limit: int | None,
                       batch_size: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(source, the AR teacher's output) for the training canvases of `corpus` (`limit`: that many, spread
    evenly over the corpus), cached in `out`/teacher.jsonl: its greedy text, or for a coupled config the sample
    that example i's noise (`example_noise(seed, i, ...)`, through `token_noise`) determines. The teacher also
    scores the student's output where the config weighs its energy."""
    model, tokenizer, cfg = start.model, start.tokenizer, start.model.config
    train = load_corpus(corpus, "train")
    teacher = load_ar(teacher_path, tokenizer, "--teacher", task=train.task)
    vq = cfg.vqvae
    pairs = [(src, tgt) for src, tgt in canvas_examples(train, tokenizer, vq.prompt_len, vq.target_len,
                                                         stride=vq.prompt_len)
             if len(src) <= cfg.max_source_len]  # longer sources are left out of training: no teacher work for them
    if limit and limit < len(pairs):  # spread evenly: the subset spans the corpus
        pairs = [pairs[i * len(pairs) // limit] for i in range(limit)]
    seq2seq = train.task == "seq2seq"
    if cfg.energy_weight:
        model.set_energy_model(teacher, tokenizer.sep_id if seq2seq else None)
    prompts = [ar_prompt(tokenizer, train.task, src) for src, _ in pairs]
    budgets = [vq.width(len(src)) - 1 if seq2seq else vq.target_len for src, _ in pairs]
    coupled = {} if not cfg.coupled else dict(
        sampling=SamplingConfig(temperature=cfg.teacher_temperature, top_p=cfg.teacher_top_p),
        noise=[token_noise(example_noise(seed, i, cfg.canvas_width(len(src)), vq.d_latent))[:budget].clone()
               for i, ((src, _), budget) in enumerate(zip(pairs, budgets))])
    outputs = teacher_outputs(teacher, prompts, budgets, Path(out) / "teacher.jsonl", pad_id=tokenizer.pad_id,
                              eos_id=tokenizer.eos_id if seq2seq else None, batch_size=batch_size, **coupled)
    return [(src, output) for (src, _), output in zip(pairs, outputs)]
