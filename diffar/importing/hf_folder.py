"""Read a Hugging Face Llama model folder: config.json, model.safetensors (or the shards that
model.safetensors.index.json lists), tokenizer.json, and tokenizer_config.json for the special tokens and
the chat template (newer folders keep the template in chat_template.jinja)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from diffar.errors import DiffarError
from diffar.importing.llama import LlamaSource, transformer_config
from diffar.tokenizer import ROLES, Tokenizer


def read_hf_folder(folder: Path) -> LlamaSource:
    config = read_json(folder / "config.json")
    return LlamaSource(transformer_config(config, str(folder)), read_tensors(folder), read_tokenizer(folder, config),
                       origin={"format": "huggingface", "name": folder.resolve().name})


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise DiffarError(f"{path.parent} has no {path.name} (expected a Hugging Face model folder or a .gguf file)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DiffarError(f"corrupt {path}: not readable JSON") from e
    if not isinstance(data, dict):
        raise DiffarError(f"corrupt {path}: not a JSON object")
    return data


def read_tensors(folder: Path) -> dict:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise DiffarError(f"corrupt {index}: it has no weight_map")
        shards = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise DiffarError(f"{folder} has no model.safetensors or model.safetensors.index.json "
                          "(diffar imports safetensors weights)")
    tensors = {}
    for name in shards:
        try:
            tensors.update(load_file(folder / name))
        except FileNotFoundError as e:
            raise DiffarError(f"{folder} lacks the weight shard {name}") from e
        except (OSError, SafetensorError) as e:
            raise DiffarError(f"corrupt {folder / name}: not a readable safetensors file") from e
    return tensors


def read_tokenizer(folder: Path, config: dict) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise DiffarError(f"{folder} has no tokenizer.json")
    settings = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise DiffarError(f"corrupt {path}: not a valid tokenizer file") from e
    specials = {role: token_text(settings.get(f"{role}_token")) or token_of_id(hf, config.get(f"{role}_token_id"))
                for role in ROLES}
    specials["pad"] = specials["pad"] or specials["eos"]  # Llamas often name no pad token; padding is masked
    return Tokenizer(hf, specials, chat_template(folder, settings))


def token_text(token) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def token_of_id(hf: HFTokenizer, token_id) -> str | None:
    """config.json's `*_token_id` (one id or a list, the first being the main one) as a token."""
    token_id = token_id[0] if isinstance(token_id, list) and token_id else token_id
    return hf.id_to_token(token_id) if isinstance(token_id, int) else None


def chat_template(folder: Path, settings: dict) -> str | None:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template
