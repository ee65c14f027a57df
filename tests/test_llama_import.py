"""Parity with the reference implementation (minGPT-style): a Llama imported from a Hugging Face folder
gives transformers' own logits, for a prefill and for every cached decode step, and its greedy text."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from diffar.checkpoint import load_checkpoint
from diffar.decoding.ar import Batch, decode_one_token, generate, prefill
from diffar.errors import DiffarError
from diffar.importing import import_model
from diffar.models.transformer import TransformerConfig

TEMPLATE = "{% for m in messages %}<bos>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
SHAPES = {  # GQA on and off, tied and untied, rope_theta != 10000, an explicit head_dim
    "mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0),
    "mqa-head-dim": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32, rope_theta=1e6,
                         rms_norm_eps=1e-5),
}


def hf_llama(tokenizer, folder, **shape) -> LlamaForCausalLM:
    """A tiny random Llama saved as a Hugging Face folder with `tokenizer` (bos <bos>, eos <eos>, no pad)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         max_position_embeddings=128, initializer_range=0.2, bos_token_id=tokenizer.bos_id,
                         eos_token_id=tokenizer.eos_id, **{"rope_theta": 10000.0, **shape})
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": {"content": "<eos>", "special": True}, "chat_template": TEMPLATE}))
    return model


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, tokenizer, tmp_path_factory):
    """(transformers' model, diffar's import of it in fp32, its tokenizer)."""
    root = tmp_path_factory.mktemp(request.param)
    reference = hf_llama(tokenizer, root / "hf", **SHAPES[request.param])
    import_model(root / "hf", root / "diffar", dtype="fp32")
    model, imported_tokenizer, _ = load_checkpoint(root / "diffar")
    return reference, model, imported_tokenizer


def hf_greedy(model: LlamaForCausalLM, ids: list[int], n: int, eos_id: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=eos_id, pad_token_id=eos_id)[0, len(ids):]
    out = out.tolist()
    return out[:out.index(eos_id)] if eos_id in out else out


@torch.no_grad()
def test_prefill_and_every_cached_step_match_transformers(pair):
    reference, model, _ = pair
    torch.manual_seed(1)
    prompt, continuation = torch.randint(10, 500, (2, 9)), torch.randint(10, 500, (2, 12))
    expected = reference(torch.cat([prompt, continuation], 1)).logits
    full, _ = model(prompt)
    torch.testing.assert_close(full, expected[:, :9], rtol=0, atol=1e-4)
    batch = Batch.from_prompts(prompt.tolist(), pad_id=0)
    model.setup_cache(2, 32)
    torch.testing.assert_close(prefill(model, batch), expected[:, 8], rtol=0, atol=1e-4)
    for i in range(continuation.shape[1]):
        logits = decode_one_token(model, batch, continuation[:, i], 9 + i)
        torch.testing.assert_close(logits, expected[:, 9 + i], rtol=0, atol=1e-4)


@torch.no_grad()
def test_greedy_text_equals_transformers_token_for_token(pair):
    reference, model, tokenizer = pair
    texts = ["And God said, Let there be light.", "To be, or not", "Thou shalt not steal; neither shalt thou"]
    prompts = [tokenizer.encode(t) for t in texts]
    expected = [hf_greedy(reference, p, 24, tokenizer.eos_id) for p in prompts]
    assert any(len(set(e)) > 3 for e in expected)  # the random model does not just repeat itself
    batched = generate(model, prompts, 24, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id)  # left-padded
    assert batched.tokens == expected


def test_special_tokens_and_chat_template_come_from_the_model(pair, tokenizer):
    _, model, imported = pair
    assert (imported.bos_id, imported.eos_id) == (tokenizer.bos_id, tokenizer.eos_id)
    assert imported.pad_id == imported.eos_id  # the folder names no pad token: padding reuses eos
    assert imported.sep_id is None and imported.mask_id is None
    assert imported.chat_template == TEMPLATE
    assert imported.encode("Let there be light") == tokenizer.encode("Let there be light")


def test_new_config_fields_round_trip_and_default_to_the_old_architecture(pair):
    cfg = pair[1].config
    assert TransformerConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    old = {k: v for k, v in cfg.to_dict().items() if k not in ("n_kv_head", "head_dim", "tie_embeddings")}
    legacy = TransformerConfig.from_dict({**old, "n_head": 4, "d_model": 64})  # a config.json from before
    assert (legacy.n_kv_head, legacy.head_dim, legacy.tie_embeddings) == (4, 16, True)


def test_bf16_import_is_the_default(tokenizer, tmp_path):
    hf_llama(tokenizer, tmp_path / "hf", num_attention_heads=4, num_key_value_heads=2)
    import_model(tmp_path / "hf", tmp_path / "out")
    meta = json.loads((tmp_path / "out" / "config.json").read_text())
    assert meta["dtype"] == "bf16" and meta["kind"] == "ar" and meta["imported_from"]["format"] == "huggingface"
    assert all(t.dtype == torch.bfloat16 for t in load_file(tmp_path / "out" / "model.safetensors").values())


@pytest.fixture
def folder(tokenizer, tmp_path):
    hf_llama(tokenizer, tmp_path / "hf", num_attention_heads=4, num_key_value_heads=2)
    return tmp_path / "hf"


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("damage, message", [
    (lambda f: edit_config(f, architectures=["Qwen2ForCausalLM"], model_type="qwen2"), "Llama-family"),
    (lambda f: edit_config(f, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}), "RoPE scaling"),
    (lambda f: edit_config(f, attention_bias=True), "biases"),
    (lambda f: (f / "config.json").unlink(), "has no config.json"),
    (lambda f: (f / "config.json").write_text("{oops"), "corrupt"),
    (lambda f: (f / "tokenizer.json").unlink(), "has no tokenizer.json"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\0" * 64), "corrupt"),
    (lambda f: (f / "model.safetensors").unlink(), "has no model.safetensors"),
    (lambda f: save_file({k: v for k, v in load_file(f / "model.safetensors").items() if "layers.1.mlp" not in k},
                         f / "model.safetensors"), "is missing"),
    (lambda f: edit_config(f, hidden_size=96, head_dim=24), "shapes do not match"),
])
def test_a_bad_folder_is_a_one_line_error(folder, tmp_path, damage, message):
    damage(folder)
    with pytest.raises(DiffarError, match=message) as error:
        import_model(folder, tmp_path / "out")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


def test_bad_paths_are_one_line_errors(folder, tmp_path):
    with pytest.raises(DiffarError, match="no model folder or GGUF file"):
        import_model(tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "model.gguf").write_bytes(b"not gguf at all")
    with pytest.raises(DiffarError, match="not a GGUF file"):
        import_model(tmp_path / "model.gguf", tmp_path / "out")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 20)
    with pytest.raises(DiffarError, match="corrupt GGUF file"):
        import_model(tmp_path / "cut.gguf", tmp_path / "out")
    (tmp_path / "taken").mkdir()
    with pytest.raises(DiffarError, match="already exists"):
        import_model(folder, tmp_path / "taken")
    with pytest.raises(DiffarError, match="unknown dtype"):
        import_model(folder, tmp_path / "out", dtype="fp8")


def test_the_cli_imports_and_generates(folder, tmp_path):
    from tests.conftest import run_cli

    done = run_cli("import", "--from", folder, "--out", tmp_path / "ckpt", "--dtype", "fp32")
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr
    done = run_cli("generate", "--checkpoint", tmp_path / "ckpt", "--prompt", "Let there be", "--max-new-tokens", "8")
    assert done.returncode == 0, done.stderr
    done = run_cli("import", "--from", tmp_path / "ckpt", "--out", tmp_path / "again")  # a diffar folder: no Llama
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "error:" in done.stderr
