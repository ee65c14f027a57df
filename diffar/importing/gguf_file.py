"""Read a Llama GGUF file (llama.cpp's format, often quantised) into Hugging Face's Llama layout.

The `gguf` package reads and dequantises the tensors. llama.cpp's converter reorders each head's q and k
rows from Hugging Face's rotate-half order into interleaved pairs, the order its RoPE rotates;
`unpermute_rope_rows` puts them back. transformers' GGUF tokenizer converter rebuilds the tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from diffar.errors import DiffarError
from diffar.importing.llama import LlamaSource, transformer_config
from diffar.models.transformer import TransformerConfig
from diffar.tokenizer import Tokenizer

# GGUF tensor names -> Hugging Face's, whole-model and per block.
MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
MAGIC = b"GGUF"


def read_gguf(path: Path) -> LlamaSource:
    try:
        import gguf
    except ImportError as e:
        raise DiffarError("importing a GGUF file needs the gguf package (pip install gguf)") from e
    try:
        reader = gguf.GGUFReader(path)
        meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("tokenizer.ggml")}
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise DiffarError(f"corrupt GGUF file {path}: {e}") from e
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise DiffarError(f"{path} holds a {arch!r} model; diffar imports Llama-family GGUF files (architecture "
                          "'llama') only")
    shapes = {t.name: tuple(reversed(t.shape.tolist())) for t in reader.tensors}  # GGUF lists dims innermost first
    config = transformer_config(llama_config(meta, shapes, path), str(path))
    return LlamaSource(config, read_tensors(reader, config, path), read_tokenizer(path),
                       origin={"format": "gguf", "name": path.name, "model": meta.get("general.name")})


def read_tensors(reader, config: TransformerConfig, path: Path) -> dict[str, torch.Tensor]:
    """Every tensor dequantised to float32, by its Hugging Face name, q/k rows back in rotate-half order."""
    from gguf.quants import dequantize

    heads = {"self_attn.q_proj.weight": config.n_head, "self_attn.k_proj.weight": config.n_kv_head}
    tensors = {}
    for t in reader.tensors:
        try:
            weights = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        except (ValueError, NotImplementedError) as e:
            raise DiffarError(f"corrupt GGUF file {path}: tensor {t.name} cannot be dequantised ({e})") from e
        name = hf_name(t.name, path)
        n_head = next((n for suffix, n in heads.items() if name.endswith(suffix)), None)
        if n_head is not None:
            weights = unpermute_rope_rows(weights, n_head)
        tensors[name] = torch.from_numpy(np.require(weights, np.float32, ["C", "W"]))  # copies a read-only map
    return tensors


def read_tokenizer(path: Path) -> Tokenizer:
    """transformers rebuilds a `tokenizers` tokenizer from the file's vocabulary, merges and pre-tokenizer name."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise DiffarError("importing a GGUF file needs the transformers package (pip install transformers)") from e
    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError) as e:
        raise DiffarError(f"{path}: its tokenizer cannot be converted ({e})") from e
    specials = {"bos": hf.bos_token, "eos": hf.eos_token, "pad": hf.pad_token or hf.eos_token}
    return Tokenizer(hf.backend_tokenizer, specials, hf.chat_template)


def llama_config(meta: dict, shapes: dict[str, tuple], path: Path) -> dict:
    """A Hugging Face Llama config.json's keys from GGUF metadata and the tensors' shapes."""
    def get(key, default=None):
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise DiffarError(f"corrupt GGUF file {path}: it lacks llama.{key}")
        return value

    heads, width = get("attention.head_count"), get("embedding_length")
    head_dim = get("attention.key_length", width // heads)
    if get("rope.dimension_count", head_dim) != head_dim:
        raise DiffarError(f"{path} rotates part of each head (partial RoPE), which diffar's Llama does not support")
    scaling = meta.get("llama.rope.scaling.type", "none")
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": width, "num_hidden_layers": get("block_count"),
            "vocab_size": get("vocab_size", shapes.get("token_embd.weight", (None,))[0]),
            "intermediate_size": get("feed_forward_length"), "max_position_embeddings": get("context_length"),
            "num_attention_heads": heads, "num_key_value_heads": get("attention.head_count_kv", heads),
            "head_dim": head_dim, "rope_theta": get("rope.freq_base", 10000.0),
            "rope_scaling": {"type": "default" if scaling == "none" else scaling},
            # stored as float32: 1e-5 reads back as 9.9999997e-06; its shortest float32 spelling is the original
            "rms_norm_eps": float(str(np.float32(get("attention.layer_norm_rms_epsilon")))),
            "tie_word_embeddings": "output.weight" not in shapes}


def hf_name(name: str, path: Path) -> str:
    stem, _, suffix = name.rpartition(".")
    parts = stem.split(".")
    if stem in MODEL_NAMES:
        return f"{MODEL_NAMES[stem]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{suffix}"
    raise DiffarError(f"{path} has a tensor diffar's Llama has no place for ({name})")


def unpermute_rope_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: within each head, row (i, half) -> row (half, i)."""
    rows, cols = weights.shape
    return weights.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
