"""Hugging Face's Llama layout -> a diffar `Transformer`: the one conversion every import source ends in.

diffar's `apply_rope` rotates the two halves of each head against each other, as Hugging Face's
`rotate_half` does, so q/k rows need no permutation here (gpt-fast's converter permutes them because its
RoPE rotates interleaved pairs; so does llama.cpp's, which `gguf_file.py` undoes). diffar fuses q/k/v into
one `qkv` matrix and gate/up into one `gate_up` matrix, so each layer runs two matmuls where Llama runs five.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffar.errors import DiffarError
from diffar.models.transformer import Transformer, TransformerConfig
from diffar.tokenizer import Tokenizer

# LlamaConfig's defaults, for the keys an older config.json leaves out.
LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                      tie_word_embeddings=False, hidden_act="silu", attention_bias=False, mlp_bias=False)


@dataclass
class LlamaSource:
    """A model read into Hugging Face's Llama layout: its diffar config (checked before any weights are read),
    its tensors by Hugging Face name (any float dtype), its tokenizer, and where it came from."""

    config: TransformerConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    origin: dict


def transformer_config(config: dict, where: str) -> TransformerConfig:
    """The diffar config of a Llama config.json, or a one-line error naming what diffar cannot run."""
    c = {**LLAMA_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    kind = (c.get("architectures") or [c.get("model_type")])[0]
    if kind is None:
        raise DiffarError(f"{where}'s config.json names no architecture (is it a Hugging Face model folder?)")
    if kind not in ("LlamaForCausalLM", "llama"):
        raise DiffarError(f"{where} is a {kind} model; diffar imports Llama-family models (LlamaForCausalLM) only")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    unsupported = [(c["hidden_act"] != "silu", f"activation {c['hidden_act']!r}"),
                   (c["attention_bias"] or c["mlp_bias"], "linear-layer biases"),
                   (rope.get("rope_type", rope.get("type", "default")) != "default",
                    f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r}")]
    for bad, what in unsupported:
        if bad:
            raise DiffarError(f"{where} uses {what}, which diffar's Llama does not support")
    try:
        return TransformerConfig(
            vocab_size=c["vocab_size"], n_layer=c["num_hidden_layers"], n_head=c["num_attention_heads"],
            n_kv_head=c.get("num_key_value_heads") or c["num_attention_heads"], d_model=c["hidden_size"],
            head_dim=c.get("head_dim") or 0, ffn_hidden=c["intermediate_size"],
            max_seq_len=c["max_position_embeddings"], rope_base=float(rope.get("rope_theta", c["rope_theta"])),
            norm_eps=c["rms_norm_eps"], tie_embeddings=bool(c["tie_word_embeddings"]))
    except DiffarError as e:
        raise DiffarError(f"{where}: {e}") from e


def transformer_state(tensors: dict[str, torch.Tensor], cfg: TransformerConfig, where: str) -> dict:
    """Hugging Face Llama tensors -> diffar `Transformer` state dict (fp32)."""
    tensors = dict(tensors)

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise DiffarError(f"corrupt {where}: tensor {name} is missing")
        return tensors.pop(name).float()

    state = {"tok_emb.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    for i in range(cfg.n_layer):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        state[ours + "attn_norm.weight"] = take(hf + "input_layernorm.weight")
        state[ours + "attn.qkv.weight"] = torch.cat([take(hf + f"self_attn.{x}_proj.weight") for x in "qkv"])
        state[ours + "attn.proj.weight"] = take(hf + "self_attn.o_proj.weight")
        state[ours + "ffn_norm.weight"] = take(hf + "post_attention_layernorm.weight")
        state[ours + "ffn.gate_up.weight"] = torch.cat([take(hf + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
        state[ours + "ffn.down.weight"] = take(hf + "mlp.down_proj.weight")
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store the shared matrix twice
        state["lm_head.weight"] = state["tok_emb.weight"]
    else:
        state["lm_head.weight"] = take("lm_head.weight")
    leftover = [name for name in tensors if not name.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise DiffarError(f"{where} has tensors diffar's Llama has no place for ({', '.join(leftover[:3])})")
    return state


def build_transformer(source: LlamaSource, where: str) -> Transformer:
    """The diffar model of a Llama source, in fp32 and eval mode."""
    model = Transformer(source.config)
    try:
        model.load_state_dict(transformer_state(source.tensors, source.config, where))
    except RuntimeError as e:
        raise DiffarError(f"corrupt {where}: tensor shapes do not match its config") from e
    return model.eval()
