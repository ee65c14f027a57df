"""The peer people run today: Hugging Face transformers' `generate` on the very same weights, timed by
`diffar bench ar --peer transformers` beside diffar's own decoder. transformers stays an optional dependency.

diffar's Llama keeps Hugging Face's rotate-half RoPE layout (importing/llama.py), so mapping the weights back
is the import read backwards: split the fused `qkv` into q/k/v and `gate_up` into gate/up, nothing permuted.
"""

from __future__ import annotations

import time

import torch

from diffar.decoding.result import GenerationResult
from diffar.errors import DiffarError
from diffar.models.transformer import Transformer

PEERS = ("transformers",)


def _transformers():
    try:
        import transformers
    except ImportError:
        raise DiffarError("--peer transformers needs the transformers package: pip install transformers") from None
    return transformers


def transformers_version() -> str:
    return _transformers().__version__


def hf_state(model: Transformer) -> dict[str, torch.Tensor]:
    """diffar `Transformer` state -> Hugging Face Llama tensor names (the inverse of `transformer_state`)."""
    state = {"model.embed_tokens.weight": model.tok_emb.weight, "model.norm.weight": model.norm.weight}
    if not model.config.tie_embeddings:
        state["lm_head.weight"] = model.lm_head.weight
    for i, block in enumerate(model.blocks):
        hf = f"model.layers.{i}."
        q, k, v = block.attn.qkv.weight.split(block.attn.widths)
        gate, up = block.ffn.gate_up.weight.chunk(2)
        state.update({hf + "input_layernorm.weight": block.attn_norm.weight,
                      hf + "self_attn.q_proj.weight": q, hf + "self_attn.k_proj.weight": k,
                      hf + "self_attn.v_proj.weight": v, hf + "self_attn.o_proj.weight": block.attn.proj.weight,
                      hf + "post_attention_layernorm.weight": block.ffn_norm.weight,
                      hf + "mlp.gate_proj.weight": gate, hf + "mlp.up_proj.weight": up,
                      hf + "mlp.down_proj.weight": block.ffn.down.weight})
    return state


def transformers_llama(model: Transformer, pad_id: int):
    """A `transformers.LlamaForCausalLM` with `model`'s weights, dtype and device (SDPA attention, as shipped);
    it knows no eos, so that it makes exactly the tokens asked for, as the bench's diffar runs do."""
    tf = _transformers()
    if not isinstance(getattr(model.blocks[0].attn.qkv, "weight", None), torch.Tensor):
        raise DiffarError("--peer transformers runs fp32 or bf16 models (transformers has no int8 CPU path to match)")
    c = model.config
    config = tf.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.ffn_hidden,
                            num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
                            head_dim=c.head_dim, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
                            rope_theta=c.rope_base, tie_word_embeddings=c.tie_embeddings, bos_token_id=None,
                            eos_token_id=None, pad_token_id=pad_id, attn_implementation="sdpa")
    weight = model.tok_emb.weight
    with torch.device(weight.device):
        peer = tf.LlamaForCausalLM(config).to(weight.dtype).eval()
    missing, unexpected = peer.load_state_dict(hf_state(model), strict=False)
    if unexpected or [name for name in missing if name != "lm_head.weight"]:
        raise DiffarError(f"diffar -> transformers weight map is incomplete: {missing or unexpected}")
    return peer


@torch.inference_mode()
def transformers_generate(peer, prompts: list[list[int]], new_tokens: int, pad_id: int, *, eos_id: int | None = None,
                          temperature: float = 0.0, prompt_lookup: int = 0) -> GenerationResult:
    """`generate` of `new_tokens` per row (fewer where a row reaches `eos_id`, which is not kept, as in diffar's
    results), left-padded as diffar batches, timed the same way (prompt in to last token out). Greedy, or
    plain sampling at `temperature` (no top-k); `prompt_lookup` > 0: its prompt-lookup decoding with that
    many drafted tokens (batch 1 only, in transformers)."""
    device = peer.model.embed_tokens.weight.device
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
    sampling = dict(do_sample=True, temperature=temperature, top_k=None, top_p=None) if temperature else \
        dict(do_sample=False)
    lookup = dict(prompt_lookup_num_tokens=prompt_lookup) if prompt_lookup else {}
    t0 = time.perf_counter()
    out = peer.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens, num_beams=1,
                        pad_token_id=pad_id, eos_token_id=eos_id, **sampling, **lookup)
    seconds = time.perf_counter() - t0
    tokens = out[:, width:].tolist()
    ended = [eos_id is not None and eos_id in row for row in tokens]
    tokens = [row[:row.index(eos_id)] if done else row for row, done in zip(tokens, ended)]
    return GenerationResult(tokens, seconds, {"target": new_tokens}, ended)
