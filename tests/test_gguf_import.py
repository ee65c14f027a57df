"""A GGUF file (llama.cpp's layout: its names, q/k rows in interleaved RoPE order) imports to the same
logits as the Hugging Face model it was written from; the real SmolLM2 file is checked in test_smollm2.py."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from diffar.checkpoint import load_checkpoint
from diffar.importing import import_model
from tests.test_llama_import import SHAPES, hf_llama


def write_gguf(reference: LlamaForCausalLM, tokenizer, path) -> None:
    """`reference` as llama.cpp's converter writes a Llama: GGUF names, and q/k rows of each head reordered
    from rotate-half into interleaved pairs (written here independently of diffar's importer)."""
    import gguf

    c = reference.config
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(w.add_block_count, c.num_hidden_layers), (w.add_context_length, c.max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_key_length, c.head_dim), (w.add_rope_dimension_count, c.head_dim),
                       (w.add_rope_freq_base, c.rope_parameters["rope_theta"]),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_vocab_size, c.vocab_size)]:
        add(value)
    vocab = sorted(tokenizer.hf.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t.startswith("<") and t.endswith(">") else 1 for t, _ in vocab])
    merges = json.loads(tokenizer.hf.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tokenizer.bos_id)
    w.add_eos_token_id(tokenizer.eos_id)
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}
    for name, tensor in reference.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        parts = name.split(".")
        if parts[1] == "layers":
            kind = names[".".join(parts[3:-1])]
            name = f"blk.{parts[2]}.{kind}.weight"
            if kind in heads:
                n = heads[kind]
                tensor = tensor.reshape(n, 2, tensor.shape[0] // n // 2, -1).transpose(1, 2).reshape(tensor.shape)
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[name]
        w.add_tensor(name, tensor.float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("shape", ["mha-tied", "gqa-untied", "mqa-head-dim"])
@torch.no_grad()
def test_a_gguf_file_imports_to_the_same_logits(tokenizer, tmp_path, shape):
    reference = hf_llama(tokenizer, tmp_path / "hf", **SHAPES[shape])
    write_gguf(reference, tokenizer, tmp_path / "tiny.gguf")
    import_model(tmp_path / "tiny.gguf", tmp_path / "out", dtype="fp32")
    model, imported, meta = load_checkpoint(tmp_path / "out")
    assert meta["imported_from"]["format"] == "gguf" and model.config.tie_embeddings == (shape == "mha-tied")
    tokens = torch.randint(10, 500, (2, 16), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(model(tokens)[0], reference(tokens).logits, rtol=0, atol=1e-4)
    assert (imported.bos_id, imported.eos_id) == (tokenizer.bos_id, tokenizer.eos_id)
    assert imported.encode("Let there be light") == tokenizer.encode("Let there be light")
