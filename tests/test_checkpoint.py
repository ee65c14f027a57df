import json

import pytest
import torch

from diffar.checkpoint import load_checkpoint, resolve, save_run_checkpoint, write_checkpoint
from diffar.errors import DiffarError

META = {"kind": "ar", "task": "seq2seq", "corpus": "kjv2web"}


def _meta(model):
    return {**META, "model": model.config.to_dict()}


def test_round_trip_gives_identical_logits(tiny_model, tokenizer, tmp_path):
    write_checkpoint(tmp_path / "ckpt", tiny_model, _meta(tiny_model), tokenizer)
    model, tok, meta = load_checkpoint(tmp_path / "ckpt")
    x = torch.randint(0, 512, (2, 9))
    torch.testing.assert_close(model(x)[0], tiny_model(x)[0], rtol=0, atol=0)
    assert tok.sha256 == tokenizer.sha256 and meta["model"] == tiny_model.config.to_dict()


def test_bf16_export_is_close(tiny_model, tokenizer, tmp_path):
    write_checkpoint(tmp_path / "bf16", tiny_model, _meta(tiny_model), tokenizer, dtype=torch.bfloat16)
    model, _, _ = load_checkpoint(tmp_path / "bf16")
    assert model.tok_emb.weight.dtype == torch.float32  # upcast on load
    for (name, p), q in zip(tiny_model.named_parameters(), model.parameters()):
        assert torch.equal(q, p.bfloat16().float()), name  # exactly the bf16 rounding of each weight
    write_checkpoint(tmp_path / "fp32", tiny_model, _meta(tiny_model), tokenizer)
    size = {d: (tmp_path / d / "model.safetensors").stat().st_size for d in ("bf16", "fp32")}
    assert size["bf16"] < 0.55 * size["fp32"]


def test_run_folder_follows_latest_and_keeps_two(tiny_model, tokenizer, tmp_path):
    for step in (5, 10, 15):
        save_run_checkpoint(tmp_path, step, tiny_model, _meta(tiny_model), tokenizer, {"step": step})
    assert resolve(tmp_path).name == "ckpt-0000015"
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-0000010", "ckpt-0000015"]


def test_interrupted_write_leaves_previous_checkpoint(tiny_model, tokenizer, tmp_path, monkeypatch):
    save_run_checkpoint(tmp_path, 5, tiny_model, _meta(tiny_model), tokenizer, {"step": 5})
    save_run_checkpoint(tmp_path, 10, tiny_model, _meta(tiny_model), tokenizer, {"step": 10})

    def dies(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing train_state.pt")

    monkeypatch.setattr(torch, "save", dies)
    with pytest.raises(KeyboardInterrupt):
        save_run_checkpoint(tmp_path, 15, tiny_model, _meta(tiny_model), tokenizer, {"step": 15})
    assert (tmp_path / "ckpt-0000015.partial").exists() and not (tmp_path / "ckpt-0000015").exists()
    assert load_checkpoint(tmp_path)[2]["step"] == 10
    monkeypatch.undo()
    save_run_checkpoint(tmp_path, 20, tiny_model, _meta(tiny_model), tokenizer, {"step": 20})
    # the stale .partial never counts as one of the checkpoints kept
    assert sorted(p.name for p in tmp_path.glob("ckpt-???????")) == ["ckpt-0000010", "ckpt-0000020"]


def test_missing_and_corrupt_checkpoints(tiny_model, tokenizer, tmp_path):
    with pytest.raises(DiffarError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nothing")
    write_checkpoint(tmp_path / "c", tiny_model, _meta(tiny_model), tokenizer)
    weights = (tmp_path / "c" / "model.safetensors").read_bytes()
    (tmp_path / "c" / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(DiffarError, match="corrupt checkpoint .*model.safetensors holds 64 bytes"):
        load_checkpoint(tmp_path / "c")
    (tmp_path / "c" / "model.safetensors").write_bytes(b"\x00" * len(weights))
    with pytest.raises(DiffarError, match="model.safetensors cannot be read"):
        load_checkpoint(tmp_path / "c")
    (tmp_path / "c" / "config.json").write_text("{")
    with pytest.raises(DiffarError, match="config.json is unreadable"):
        load_checkpoint(tmp_path / "c")
    (tmp_path / "c" / "config.json").write_text(json.dumps({"kind": "gpt5"}))
    with pytest.raises(DiffarError, match="no known model kind"):
        load_checkpoint(tmp_path / "c")


def test_weights_of_another_shape_are_rejected(tiny_model, tokenizer, tmp_path):
    write_checkpoint(tmp_path / "c", tiny_model, {**_meta(tiny_model), "model": {**tiny_model.config.to_dict(),
                                                                                  "n_layer": 3}}, tokenizer)
    with pytest.raises(DiffarError, match="do not match"):
        load_checkpoint(tmp_path / "c")


@pytest.mark.parametrize("field, value, message", [
    ("d_model", 10**8, "weights do not match config.json"),  # terabytes: refused before a byte is allocated
    ("vocab_size", 10**9, "weights do not match config.json"),
    ("max_seq_len", 10**7, "max_seq_len must be at most 1,048,576"),
    ("n_head", 0, "n_head must be positive"),
    ("rope_base", -1, "rope_base must be a positive number"),
    ("norm_eps", "x", "norm_eps must be a positive number"),
])
def test_impossible_model_configs_are_rejected(tiny_model, tokenizer, tmp_path, field, value, message):
    write_checkpoint(tmp_path / "c", tiny_model, {**_meta(tiny_model), "model": {**tiny_model.config.to_dict(),
                                                                                  field: value}}, tokenizer)
    with pytest.raises(DiffarError, match=message):
        load_checkpoint(tmp_path / "c")


def test_foreign_tokenizer_is_rejected(tiny_model, tokenizer, tmp_path):
    from diffar.tokenizer import train_tokenizer

    write_checkpoint(tmp_path / "c", tiny_model, _meta(tiny_model), tokenizer)
    other = train_tokenizer(["some other text entirely"] * 10, vocab_size=300)
    other.save(tmp_path / "other.json")
    with pytest.raises(DiffarError, match="does not match"):
        load_checkpoint(tmp_path / "c", tokenizer_path=tmp_path / "other.json")
