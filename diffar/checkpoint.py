"""Checkpoints: a folder with model.safetensors, config.json (everything needed to rebuild the model)
and tokenizer.json; training runs add train_state.pt (optimizer and step) for exact resume.

A run folder holds numbered checkpoints and a `latest` pointer. Each checkpoint is written to a
temporary folder and renamed into place, then `latest` is replaced atomically, so a crash at any
moment leaves the previous checkpoint intact and loadable.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from diffar.errors import DiffarError
from diffar.models.dd2 import DD2Config, DD2Model
from diffar.models.drafter import BlockDrafter, DrafterConfig
from diffar.models.precision import place
from diffar.models.refusion import RefusionConfig, RefusionModel
from diffar.models.transformer import Transformer, TransformerConfig
from diffar.models.vqvae import TextVQVAE, VQVAEConfig
from diffar.training.lora import add_lora, merge_lora
from diffar.tokenizer import Tokenizer

FORMAT_VERSION = 1
MODEL_KINDS = {"ar": (TransformerConfig, Transformer), "refusion": (RefusionConfig, RefusionModel),
               "drafter": (DrafterConfig, BlockDrafter), "vqvae": (VQVAEConfig, TextVQVAE), "dd2": (DD2Config, DD2Model)}
# The generation methods (diffar/generation) each kind serves, its default first: a ReFusion model's AR stream
# (a drafter's target) also decodes alone; an autoencoder does not generate.
GENERATES = {"ar": ("ar",), "refusion": ("refusion", "ar"), "drafter": ("refusion", "ar"), "vqvae": (),
             "dd2": ("dd2",)}
REPO = Path(__file__).resolve().parent.parent
CHECKPOINT_NAME = re.compile(r"ckpt-\d{7}")


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` into a file of this process's own next to `path`, then rename it to `path` (durably): a reader
    sees the old file or the whole new one, and processes writing the same file at once do not collide."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)


def write_checkpoint(
    folder: Path, model: torch.nn.Module, meta: dict, tokenizer: Tokenizer, train_state: dict | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write a complete checkpoint into `folder` (which must not exist yet), atomically."""
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = model if dtype is None else copy.deepcopy(model).to(dtype)
    save_model(weights, str(tmp / "model.safetensors"))
    tokenizer.save(tmp / "tokenizer.json")
    meta = {**meta, "format_version": FORMAT_VERSION, "tokenizer_sha256": tokenizer.sha256}
    (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    if train_state is not None:
        torch.save(train_state, tmp / "train_state.pt")
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)
    os.replace(tmp, folder)
    _fsync(folder.parent)


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's entries to disk, so a rename is durable, not just atomic."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_run_checkpoint(run_dir: Path, step: int, model, meta: dict, tokenizer: Tokenizer, train_state: dict,
                        keep: int = 2) -> Path:
    """Add checkpoint `ckpt-{step}` to a run folder, point `latest` at it, keep the newest `keep`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    folder = run_dir / f"ckpt-{step:07d}"
    if folder.exists():
        shutil.rmtree(folder)
    write_checkpoint(folder, model, {**meta, "step": step}, tokenizer, train_state)
    write_atomically(run_dir / "latest", lambda tmp: tmp.write_text(folder.name + "\n"))
    complete = sorted(p for p in run_dir.iterdir() if CHECKPOINT_NAME.fullmatch(p.name))
    for old in complete[:-keep]:
        if old.name != folder.name:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def resolve(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder (follows its `latest` pointer). A relative path that is not there
    is looked for in the repository too, so `checkpoints/ar-kjv2web` names a shipped model from any folder."""
    path = Path(path)
    if not path.exists() and not path.is_absolute() and (REPO / path).exists():
        path = REPO / path
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
    if not (path / "config.json").is_file():
        raise DiffarError(f"no checkpoint at {path} (expected a folder with config.json and model.safetensors)")
    return path


def read_meta(path: str | Path) -> dict:
    path = resolve(path)
    try:
        meta = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise DiffarError(f"corrupt checkpoint {path}: config.json is unreadable") from e
    if not isinstance(meta, dict) or meta.get("kind") not in MODEL_KINDS:
        raise DiffarError(f"corrupt checkpoint {path}: config.json names no known model kind")
    if not isinstance(meta.get("model"), dict) or meta.get("task") not in ("seq2seq", "continuation") \
            or not isinstance(meta.get("corpus"), str):
        raise DiffarError(f"corrupt checkpoint {path}: config.json lacks its model, task or corpus")
    return meta


def load_checkpoint(path: str | Path, tokenizer_path: str | Path | None = None
                    ) -> tuple[torch.nn.Module, Tokenizer, dict]:
    """Rebuild (model in eval mode, in fp32 on the CPU, tokenizer, meta) from a checkpoint or run folder;
    `load_for_inference` places it at another precision or on another device."""
    path = resolve(path)
    meta = read_meta(path)
    config_cls, model_cls = MODEL_KINDS[meta["kind"]]
    try:
        config = config_cls.from_dict(meta["model"])
        with torch.device("meta"):  # count the weights before allocating any: a config may ask for terabytes
            n_params = sum(p.numel() for p in model_cls(config).parameters())
        stored = (path / "model.safetensors").stat().st_size
    except (TypeError, ValueError) as e:
        raise DiffarError(f"corrupt checkpoint {path}: bad model config ({e})") from e
    except OSError as e:
        raise DiffarError(f"corrupt checkpoint {path}: model.safetensors cannot be read") from e
    if 2 * n_params > stored:  # at least 2 bytes a weight (bf16/fp16)
        raise DiffarError(f"corrupt checkpoint {path}: weights do not match config.json (it describes {n_params:,} "
                          f"weights, model.safetensors holds {stored:,} bytes)")
    model = model_cls(config)
    if meta.get("lora"):  # a LoRA fine-tuning run: frozen weights + adapters, merged once loaded
        model = add_lora(model, **meta["lora"])
    try:
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    except (OSError, SafetensorError, RuntimeError, ValueError) as e:
        raise DiffarError(f"corrupt checkpoint {path}: model.safetensors cannot be read") from e
    if missing or unexpected:
        raise DiffarError(f"corrupt checkpoint {path}: weights do not match config.json")
    if meta.get("lora"):
        model, meta = merge_lora(model), {k: v for k, v in meta.items() if k != "lora"}
    tokenizer_path = tokenizer_path or path / "tokenizer.json"
    tokenizer = Tokenizer.load(tokenizer_path)
    if tokenizer.sha256 != meta.get("tokenizer_sha256"):
        raise DiffarError(f"tokenizer {tokenizer_path} does not match the checkpoint {path} (trained with another)")
    if meta["kind"] == "drafter":
        model.attach(drafter_target(path, meta, tokenizer))
    return model.eval(), tokenizer, meta


def target_path(name: str) -> Path:
    """Where a drafter's target lives: its path as recorded, relative to the working folder or else to the
    repository (a shipped drafter names a checkpoint under checkpoints/)."""
    try:
        return resolve(name)
    except DiffarError:
        raise DiffarError(f"the AR model this drafter drafts for, {name}, is not there (an imported model: "
                          f"make smollm2, or diffar import)") from None


def drafter_target(path: Path, meta: dict, tokenizer: Tokenizer) -> Transformer:
    """The AR model (fp32, CPU) a drafter checkpoint names as its target, checked to be the one it was built for."""
    name = meta.get("target")
    if not isinstance(name, str):
        raise DiffarError(f"corrupt checkpoint {path}: a drafter's config.json must name its target")
    target, target_tokenizer, target_meta = load_checkpoint(target_path(name))
    if target_meta["kind"] != "ar" or target_tokenizer.sha256 != tokenizer.sha256:
        raise DiffarError(f"drafter {path} was trained for another model than {name} (kind or tokenizer differ)")
    return target


def load_for_inference(path: str | Path, tokenizer_path: str | Path | None = None, *, dtype: str = "fp32",
                       device: str = "cpu") -> tuple[torch.nn.Module, Tokenizer, dict]:
    """`load_checkpoint` at a named inference precision (fp32, bf16, fp16, int8) on `device` (cpu, cuda)."""
    model, tokenizer, meta = load_checkpoint(path, tokenizer_path)
    model = model.placed(dtype, device) if isinstance(model, BlockDrafter) else place(model, dtype, device)
    return model, tokenizer, meta


def ar_stream(model: torch.nn.Module) -> Transformer:
    """The AR model that decides the text: an AR checkpoint's model, a ReFusion checkpoint's AR stream, or the
    target a drafter drafts for."""
    if isinstance(model, BlockDrafter):
        return model.target
    return model.ar if isinstance(model, RefusionModel) else model


def load_ar(path: str | Path, tokenizer: Tokenizer, flag: str, task: str | None = None,
            dtype: str = "fp32", device: str = "cpu") -> Transformer:
    """The AR model of an AR or ReFusion checkpoint passed as `flag` (a drafter, teacher, ...), which must
    share `tokenizer` with the model it works with, and its `task` where given (a baseline or a model that
    continues the other's text must read prompts the same way); at precision `dtype` on `device`."""
    model, ar_tokenizer, meta = load_for_inference(path, dtype=dtype, device=device)
    if meta["kind"] not in ("ar", "refusion", "drafter"):
        raise DiffarError(f"{flag} {path} is a {meta['kind']} checkpoint; it must be an AR, ReFusion or drafter one")
    if ar_tokenizer.sha256 != tokenizer.sha256:
        raise DiffarError(f"{flag} {path} uses another tokenizer than the model it works with; they must share one")
    if task is not None and meta["task"] != task:
        raise DiffarError(f"{flag} {path} is a {meta['task']} model; the model it works with is a {task} one")
    return ar_stream(model)
